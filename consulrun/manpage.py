"""consulrun(1) and consulrun-COMMAND(1), made from the CLI's own help text with click-man.

    python -m consulrun.manpage DIR      # e.g. /usr/local/share/man/man1; then `man consulrun`

The wheel ships them (made this way, kept in docs/man/man1 and checked up to
date by a test) under <prefix>/share/man/man1, where `man` finds them beside
the <prefix>/bin on PATH, so the units' `Documentation=man:consulrun-run(1)`
resolves on a plain `pip install`.

Generated, not written by hand, so the pages cannot drift from `--help`.
click-man leaves out the exit statuses (the group's epilog) and passes
click's `\\b` (keep-lines) markers through as roff escapes; both are put right
here. click-man is an optional dependency: `pip install 'consulrun[man]'`.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import click

from consulrun import __version__

SEE_ALSO = r"\fBsystemd.timer\fP(5), \fBsystemd.service\fP(5), \fBsystemd.time\fP(7), \fBconsul\fP(1)"


def _keep_lines(text: str) -> str:
    """Turn click's `\\b` paragraphs (printed as written) into roff no-fill blocks."""
    out: list[str] = []
    literal = False
    for line in text.split("\n"):
        if line == "\b":
            out.append(".nf")
            literal = True
            continue
        if literal and (line in (".PP", "") or line.startswith(".SH") or line.startswith(".TP")):
            out.append(".fi")
            literal = False
        out.append(line.replace("\\", "\\e") if literal else line)
    if literal:
        out.append(".fi")
    return "\n".join(out)


def _exit_statuses(epilog: str) -> str:
    lines = [line.strip() for line in epilog.strip().splitlines() if line.strip() and line.strip() != "\b"]
    return ".SH \"EXIT STATUS\"\n.nf\n" + "\n".join(line.replace("-", r"\-") for line in lines[1:]) + "\n.fi\n"


def write_pages(target: Path, cli: click.Group | None = None) -> list[Path]:
    """Write one page for the group and one per command into `target`; return their paths."""
    try:
        from click_man.core import generate_man_page
    except ImportError:
        raise click.ClickException("click-man is not installed: pip install 'consulrun[man]'") from None
    from consulrun.cli import EXIT_CODES_HELP, main

    group = cli or main
    target.mkdir(parents=True, exist_ok=True)
    root = click.Context(group, info_name="consulrun")
    pages = [(root, "consulrun")] + [(click.Context(cmd, info_name=name, parent=root), f"consulrun-{name}")
                                     for name, cmd in sorted(group.commands.items()) if not cmd.hidden]
    others = ", ".join(rf"\fB{name}\fP(1)" for _, name in pages)
    written = []
    for ctx, name in pages:
        # No date (click-man puts today's): the pages shipped in the wheel must be the same bytes every day.
        text = _keep_lines(re.sub(r'^(\.TH "[^"]*" "1" )"[^"]*"', r'\1""', generate_man_page(ctx, version=__version__),
                                  count=1, flags=re.M))
        if name in ("consulrun", "consulrun-run"):
            text += _exit_statuses(EXIT_CODES_HELP)
        text += f".SH \"SEE ALSO\"\n{others}, {SEE_ALSO}\n"
        path = target / f"{name}.1"
        path.write_text(text, encoding="utf-8")
        written.append(path)
    return written


if __name__ == "__main__":
    if len(sys.argv) != 2 or sys.argv[1].startswith("-"):
        sys.exit("usage: python -m consulrun.manpage DIR   (e.g. /usr/local/share/man/man1)")
    try:
        for page in write_pages(Path(sys.argv[1])):
            print(page)
    except click.ClickException as exc:
        exc.show()
        sys.exit(exc.exit_code)
    except OSError as exc:
        sys.exit(f"Error: {sys.argv[1]}: {exc.strerror}")
