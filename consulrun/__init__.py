"""consulrun: run each scheduled occurrence of a systemd timer job on exactly one node.

The packages, lowest first; each may import its own modules and those of the
layers below it, never one above (tests/test_layout.py holds this):

  errors, records, timefmt   the foundation: exit statuses and exceptions, immutable records, times
  consul/     the only package that speaks HTTP: the agent transport, the client, addresses
  manifest/   reading a manifest: schema, YAML, durations, calendar specs, cron lines, unit settings
  protocol/   the lock protocol and the run: lock, occurrence, fencing, turns, the child process,
              triggers, pauses, the run's pings and health-check writes
  report/     what people and monitors read: status, history, the exporter, the watchdog
  units/      systemd units: rendering, the guarantee warnings, installing (here and over ssh)
  commands/   one module per command: its click options, calling one core function
  cli, entry, manpage        the command group, the entry point (`run` without click), the man pages
"""

__version__ = "0.1.0"
