"""The chaos suite: consulrun's locks under injected faults, judged by a history checker (docs/chaos.md)."""
