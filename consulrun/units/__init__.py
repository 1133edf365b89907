"""systemd units: rendering a manifest into .timer/.service files (`render`), the warnings for
guarantees a manifest's own settings cannot give (`guarantees`), installing them on this node
(`install`) and on others over ssh (`remote`), which manifest owns a unit (`owner`),
the watchdog's units every manifest with health checks shares (`shared`), and the units of
job chains (`chains`).

May import: the foundation, `consulrun.consul`, `consulrun.manifest`, `consulrun.protocol`,
`consulrun.report` (the watchdog's job list). Never click.
"""
