"""The `consulrun` command: `run` (every timer tick, on every node) is read without click when it can be."""

from __future__ import annotations

import sys


def main() -> None:
    if sys.argv[1:2] == ["run"]:
        from consulrun.commands.runargs import main as run

        run(sys.argv[2:])  # returns only if it leaves the arguments to click
    from consulrun.cli import main as cli

    cli()
