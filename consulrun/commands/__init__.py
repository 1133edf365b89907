"""One module per command: each declares its click options (those shared by several are defined
once, in `options`), calls one core function and prints. `runargs` reads `run`'s arguments without
click, for the hot path of every timer tick.

May import: every package below it. `consulrun.cli` lists the commands.
"""
