"""Reading a manifest: its JSON Schema, the YAML source with line numbers, systemd durations and
OnCalendar= specs, cron fields and crontab import, unit settings and the escaping of their values,
the `hardening` preset's settings, shell syntax, `after:` chains (`chains`), and `loader`, which turns a file into validated
`Manifest` and `Job` records.

May import: the foundation and `consulrun.consul` (an agent address is parsed where Consul's is).
Never click, never the protocol: a manifest is data, read the same way by every command.
"""
