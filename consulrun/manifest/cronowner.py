"""Which Debian package owns a cron file: `import-crontab` leaves a package's cron files to cron.

A package installs its cron file on every node that has the package, for that node's own
housekeeping (Debian's `e2scrub_all` scrubs the node's own filesystems): such a job is per-node
by nature, and a converter cannot tell from the line whether one node of the cluster may do it
for all. The answer comes from `dpkg-query -S`, found on PATH (so a test can put its own there);
without dpkg (not a Debian system) no file is known to be a package's.
"""

from __future__ import annotations

import os
import shutil
import subprocess

_GLOB = set("*?[]\\")


def package_owner(path: str) -> str | None:
    """The package(s) that own `path` as dpkg lists them (`e2fsprogs`), or None: not a package's
    file, not a file (standard input), no dpkg here, or a path dpkg would read as a pattern."""
    if path in ("-", "<stdin>") or not os.path.isfile(path):
        return None
    dpkg_query = shutil.which("dpkg-query")
    if dpkg_query is None:
        return None
    candidates = dict.fromkeys([os.path.abspath(path), os.path.realpath(path)])
    for candidate in candidates:
        if _GLOB & set(candidate):
            continue
        try:
            found = subprocess.run([dpkg_query, "-S", candidate], capture_output=True, text=True,
                                   timeout=60, env={**os.environ, "LC_ALL": "C"})
        except (OSError, subprocess.TimeoutExpired):
            return None
        owner = _parse(found.stdout, candidate) if found.returncode == 0 else None
        if owner:
            return owner
    return None


def _parse(listing: str, path: str) -> str | None:
    """The owners in `dpkg-query -S PATH`'s output (`pkg1, pkg2: PATH`), past diversion lines."""
    for line in listing.splitlines():
        if line.startswith("diversion by ") or line.startswith("local diversion "):
            continue
        packages, sep, listed = line.partition(": ")
        if sep and listed == path:
            return packages.strip()
    return None
