"""Run a Markdown page's shell blocks in order, as a reader would, and check the output the page shows.

The page marks what runs with HTML comments, which the rendered page does not show:

    <!-- run -->           the ```sh block below runs; its last command must exit 0
    <!-- run: exit N -->   the same, its last command must exit N
    <!-- output -->        the ```text block below is what the run block above it prints
                           (standard output and standard error together, in order)

Every run block goes to one bash process, in order, as if typed into one terminal: `cd`, variables and
background jobs carry over from block to block. In an output block, a line `...` stands for any number of
lines (none included), and a `<word>` (lower-case letters, digits, spaces and dashes between angle brackets,
e.g. `<time>`, `<pid>`, `<node>`) for any text within its line: times, PIDs, session IDs, the node's name.
Two or more spaces stand for any run of spaces, since a table's columns are as wide as what they hold.
Every other character must be printed as shown.
"""

from __future__ import annotations

import os
import re
import select
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

MARK = re.compile(r"^<!-- (run(?:: exit (\d+))?|output) -->$")
PLACEHOLDER = re.compile(r"<[a-z][a-z0-9 -]*>")


@dataclass
class Block:
    line: int  # where the block starts on the page, for messages
    script: str
    exit_status: int = 0
    output: str | None = None


def blocks(page: str) -> list[Block]:
    """The marked blocks of a page, each run block with the output block that follows it, if any."""
    lines = page.splitlines()
    found: list[Block] = []
    index = 0
    while index < len(lines):
        mark = MARK.match(lines[index])
        if not mark:
            index += 1
            continue
        fence = lines[index + 1] if index + 1 < len(lines) else ""
        kind = "text" if mark.group(1) == "output" else "sh"
        if fence != f"```{kind}":
            raise ValueError(f"line {index + 2}: a {mark.group(1)!r} mark must be followed by a ```{kind} block")
        end = lines.index("```", index + 2)
        body = "\n".join(lines[index + 2:end]) + "\n"
        if kind == "sh":
            found.append(Block(index + 3, body, int(mark.group(2) or 0)))
        elif not found or found[-1].output is not None:
            raise ValueError(f"line {index + 2}: an output block needs a run block before it")
        else:
            found[-1].output = body
        index = end + 1
    return found


def matches(expected: str, actual: str) -> bool:
    """Whether `actual` is what `expected` shows, placeholders and `...` lines allowed for."""
    pattern = []
    for line in expected.rstrip("\n").split("\n"):
        if line == "...":
            pattern.append(r"(?:[^\n]*\n)*?")
            continue
        parts = [r" +".join(re.escape(piece) for piece in re.split(r"  +", part)) for part in PLACEHOLDER.split(line)]
        pattern.append(r"[^\n]+?".join(parts) + r"\n")
    return re.fullmatch("".join(pattern), actual.rstrip("\n") + "\n") is not None


class Shell:
    """One bash, fed block by block; every process it starts is in its own process group, ended at close."""

    def __init__(self, cwd: Path, env: dict[str, str]) -> None:
        self.process = subprocess.Popen(["bash", "--norc", "--noprofile"], cwd=cwd, env=env, stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
        self.count = 0

    def run(self, script: str, timeout: float) -> tuple[int, str]:
        """Run one block; return its last command's exit status and everything it printed."""
        assert self.process.stdin and self.process.stdout
        self.count += 1
        marker = f"__pagerun_{self.count}__"
        self.process.stdin.write(f"{script}\nprintf '\\n{marker} %s\\n' $?\n".encode())
        self.process.stdin.flush()
        out = b""
        deadline = time.monotonic() + timeout
        found = re.compile(rb"\n" + marker.encode() + rb" (\d+)\n")
        while not (hit := found.search(out)):
            left = deadline - time.monotonic()
            if left <= 0 or self.process.poll() is not None:
                raise TimeoutError(f"block did not finish in {timeout}s; it printed:\n{out.decode(errors='replace')}")
            ready, _, _ = select.select([self.process.stdout], [], [], min(left, 1.0))
            if ready:
                out += os.read(self.process.stdout.fileno(), 65536)
        return int(hit.group(1)), out[:hit.start()].decode(errors="replace")

    def close(self) -> None:
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.process.wait(timeout=30)


def run_page(page: str, cwd: Path, env: dict[str, str], rewrite=lambda script: script,
             timeout: float = 180) -> list[str]:
    """Run every marked block of `page`; return one message per block that did not do what the page shows."""
    problems = []
    shell = Shell(cwd, env)
    try:
        for block in blocks(page):
            status, printed = shell.run(rewrite(block.script), timeout)
            if status != block.exit_status:
                problems.append(f"block at line {block.line}: exit status {status}, the page says "
                                f"{block.exit_status}; it printed:\n{printed}")
            elif block.output is not None and not matches(block.output, printed):
                problems.append(f"block at line {block.line} printed:\n{printed}\nthe page shows:\n{block.output}")
            if problems:
                break  # later blocks build on this one
    finally:
        shell.close()
    return problems
