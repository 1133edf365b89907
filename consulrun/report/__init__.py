"""What people and monitors read: `status` (who holds what, and the verdict), `history`, the
Prometheus exporter (`metrics`, served by `httpd`) and the watchdog that turns verdicts into Consul health checks.

May import: the foundation, `consulrun.consul`, `consulrun.manifest`, `consulrun.protocol`.
Never click: the commands print what these return.
"""
