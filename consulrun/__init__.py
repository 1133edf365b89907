"""consulrun: run each scheduled occurrence of a systemd timer job on exactly one node."""

__version__ = "0.1.0"
