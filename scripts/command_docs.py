"""Write the usage block of every page under docs/commands/ from the CLI's own `--help`.

    .venv-test/bin/python scripts/command_docs.py           # rewrite the blocks (and add a page for a new command)
    .venv-test/bin/python scripts/command_docs.py --check   # exit 1 naming the stale pages; change nothing

Each page holds its command's help between two marker lines; the prose around them is written by hand and
kept. The help is rendered at a fixed width (the terminal's is ignored), so the same CLI gives the same bytes
everywhere, as the man pages under docs/man/man1 do (tests/test_docs.py checks both are current).
"""

from __future__ import annotations

import sys
from pathlib import Path

import click

REPO = Path(__file__).resolve().parents[1]
PAGES = REPO / "docs" / "commands"
WIDTH = 100
BEGIN = "<!-- usage: written by scripts/command_docs.py from --help; edit the CLI, not this block -->"
END = "<!-- end of usage -->"


def _help(command: click.Command, name: str, parent: click.Context | None) -> str:
    ctx = click.Context(command, info_name=name, parent=parent, terminal_width=WIDTH, max_content_width=WIDTH)
    return command.get_help(ctx).rstrip() + "\n"


def usage_blocks() -> dict[str, str]:
    """Page file name -> the usage block it must hold (markers included)."""
    from consulrun.cli import main

    root = click.Context(main, info_name="consulrun", terminal_width=WIDTH, max_content_width=WIDTH)
    texts = {"index.md": _help(main, "consulrun", None)}
    for name, command in sorted(main.commands.items()):
        if not command.hidden:
            texts[f"{name}.md"] = _help(command, name, root)
    return {page: f"{BEGIN}\n```text\n{text}```\n{END}\n" for page, text in texts.items()}


def render(page: str, current: str | None, block: str) -> str:
    """The page with its usage block replaced; a new page gets a title, the block and a line asking for prose."""
    if current is None:
        title = "consulrun" if page == "index.md" else f"consulrun {page.removesuffix('.md')}"
        return f"# {title}\n\n{block}\nTo be written: what it is for, how it behaves, examples.\n"
    if BEGIN not in current or END not in current:
        raise SystemExit(f"Error: docs/commands/{page}: no usage markers ({BEGIN!r} ... {END!r})")
    head, rest = current.split(BEGIN, 1)
    tail = rest.split(END + "\n", 1)[1] if END + "\n" in rest else rest.split(END, 1)[1]
    return head + block + tail


def main(argv: list[str]) -> int:
    check = argv == ["--check"]
    if argv and not check:
        print("usage: scripts/command_docs.py [--check]", file=sys.stderr)
        return 2
    stale = []
    blocks = usage_blocks()
    for page, block in blocks.items():
        path = PAGES / page
        current = path.read_text(encoding="utf-8") if path.exists() else None
        wanted = render(page, current, block)
        if wanted != current:
            stale.append(page)
            if not check:
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(wanted, encoding="utf-8")
                print(path.relative_to(REPO))
    extra = sorted(p.name for p in PAGES.glob("*.md") if p.name not in blocks) if PAGES.exists() else []
    if extra:
        print(f"docs/commands: pages for no command: {', '.join(extra)}", file=sys.stderr)
    if check and (stale or extra):
        if stale:
            print(f"run `python scripts/command_docs.py`: out of date: {', '.join(stale)}", file=sys.stderr)
        return 1
    return 1 if extra else 0


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    sys.exit(main(sys.argv[1:]))
