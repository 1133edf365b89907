"""The same install on other nodes, over the system's `ssh` (the user's config, keys and known_hosts).

The manifest travels on ssh's standard input to `consulrun install -` on each
node, so nothing but the manifest crosses (token files stay where they are:
units only name them). Nodes run in parallel; each one's install is the local,
all-or-nothing install.

Host names come from the command line and from hosts files, which may be
written by someone else: a name is checked before it reaches ssh (one starting
with `-` would be read as an ssh option, e.g. `-oProxyCommand=...`), it is
passed after `--`, and the remote command is one string whose every word is
quoted for the node's shell, since ssh joins its arguments with spaces and
hands them to that shell.
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from consulrun.consul.values import printable
from consulrun.errors import UsageError, os_reason

# [user@]host: a DNS name or ssh config alias, an IPv4 address, or an IPv6 address (bare or in brackets).
_HOST = re.compile(r"(?:[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}@)?"
                   r"(?:[A-Za-z0-9_][A-Za-z0-9_.-]{0,252}|\[[0-9A-Fa-f:.]+\]|[0-9A-Fa-f]*:[0-9A-Fa-f:.]+)")


@dataclass
class HostResult:
    host: str
    ok: bool
    summary: str
    stdout: str = ""
    stderr: str = ""

    @property
    def warnings(self) -> list[str]:
        """The node's own `warning: ...` lines (e.g. no agent answering there), for the user to see."""
        return [printable(line[len("warning: "):]) for line in _lines(self.stderr) if line.startswith("warning: ")]


@dataclass
class Hosts:
    names: list[str] = field(default_factory=list)
    duplicates: list[str] = field(default_factory=list)


def host_problem(host: str) -> str | None:
    """Why `host` cannot be given to ssh as a destination, or None."""
    if host.startswith("-"):
        return f"host {host!r} starts with '-' (ssh would read it as an option)"
    if not _HOST.fullmatch(host):
        return f"host {host[:80]!r} is not [USER@]HOST (a host name, an IP address or an ssh config alias)"
    return None


def read_hosts(given: Iterable[str], hosts_file: Path | None) -> Hosts:
    """`--host` values, then the hosts file's (one per line, `#` comments), each checked; repeats kept once."""
    entries = [(host.strip(), "--host") for host in given]
    if hosts_file is not None:
        try:
            lines = hosts_file.read_text(encoding="utf-8").splitlines()
        except OSError as exc:
            raise UsageError(f"--hosts-file: {hosts_file}: {os_reason(exc)}") from None
        except UnicodeDecodeError:
            raise UsageError(f"--hosts-file: {hosts_file}: not UTF-8 text") from None
        for number, line in enumerate(lines, 1):
            host = line.split("#", 1)[0].strip()
            if host:
                entries.append((host, f"{hosts_file}:{number}"))
    out = Hosts()
    for host, where in entries:
        problem = host_problem(host)
        if problem:
            raise UsageError(f"{where}: {problem}")
        if host in out.names:
            out.duplicates.append(host)
        else:
            out.names.append(host)
    return out


def remote_command(argv: list[str]) -> str:
    """The one command string the node's shell runs: each word quoted, so spaces and `;` stay inside words."""
    return " ".join(shlex.quote(arg) for arg in argv)


def ssh_argv(host: str, remote_argv: list[str], ssh_options: list[str]) -> list[str]:
    return ["ssh", "-o", "BatchMode=yes", *[part for opt in ssh_options for part in ("-o", opt)], "--", host,
            remote_command(remote_argv)]


def _summary(code: int, out: str, err: str) -> str:
    """The node's last word, its control characters escaped (the node chose every byte of it)."""
    return printable(_last_word(code, out, err))


def _lines(text: str) -> list[str]:
    """Lines as the terminal would end them (at \\n only): a \\r or another break inside a line stays, to be shown."""
    return [line.rstrip("\r") for line in text.strip().split("\n")] if text.strip() else []


def _last_word(code: int, out: str, err: str) -> str:
    lines = [line for line in (_lines(err) + _lines(out)) if line.strip() and not line.startswith("warning: ")]
    if code == 255 and not out:
        return "ssh failed: " + (lines[-1] if lines else "no answer")
    if code != 0:
        errors = [line for line in lines if line.startswith("Error:")]
        return f"exit {code}: " + (errors[0][len('Error: '):] if errors else (lines[-1] if lines else "no output"))
    return _lines(out)[-1] if out.strip() else "ok"


def install_on(host: str, manifest_text: str, remote_argv: list[str], ssh_options: list[str],
               timeout_s: float) -> HostResult:
    if host_problem(host):  # read_hosts checked it already; this function must be safe on its own too
        raise UsageError(host_problem(host) or "")
    try:
        # Bytes, decoded here: text mode would turn a node's bare \r into a line break, and what the node printed
        # is shown as it is, its control characters escaped (`_summary`).
        result = subprocess.run(ssh_argv(host, remote_argv, ssh_options), input=manifest_text.encode("utf-8"),
                                capture_output=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return HostResult(host, False, f"timed out after {timeout_s:.0f}s")
    except OSError as exc:
        return HostResult(host, False, f"cannot run ssh: {os_reason(exc)}")
    out, err = (stream.decode("utf-8", "replace") for stream in (result.stdout, result.stderr))
    return HostResult(host, result.returncode == 0, _summary(result.returncode, out, err), out, err)


# The package crosses on ssh's standard input into a private file on the node, which dpkg installs; the file goes
# whatever happens. Nothing in this command comes from the user, so it needs no quoting.
_DPKG_INSTALL = ('f=$(mktemp) || exit 1; trap \'rm -f "$f"\' EXIT; cat > "$f" || exit 1; '
                 'DEBIAN_FRONTEND=noninteractive dpkg -i "$f" >&2')
_DEB_MAGIC = b"!<arch>\ndebian-binary"


def read_package(path: Path) -> bytes:
    """The .deb `install --host --with-package` puts on each node, checked to be one before anything crosses."""
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise UsageError(f"--with-package: {path}: {os_reason(exc)}") from None
    if not data.startswith(_DEB_MAGIC):
        raise UsageError(f"--with-package: {path}: not a .deb package (scripts/package builds one)")
    return data


def package_on(host: str, package: bytes, ssh_options: list[str], timeout_s: float) -> HostResult:
    """`dpkg -i` the package on `host` over ssh; ok, or why not (dpkg's own last word)."""
    if host_problem(host):
        raise UsageError(host_problem(host) or "")
    argv = ["ssh", "-o", "BatchMode=yes", *[part for opt in ssh_options for part in ("-o", opt)], "--", host,
            _DPKG_INSTALL]
    try:
        result = subprocess.run(argv, input=package, capture_output=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return HostResult(host, False, f"package: timed out after {timeout_s:.0f}s")
    except OSError as exc:
        return HostResult(host, False, f"cannot run ssh: {os_reason(exc)}")
    out, err = (stream.decode("utf-8", "replace") for stream in (result.stdout, result.stderr))
    if result.returncode == 0:
        return HostResult(host, True, "package installed", out, err)
    return HostResult(host, False, "package: " + _summary(result.returncode, out, err), out, err)


def install_all(hosts: list[str], manifest_text: str, remote_argv: list[str], ssh_options: list[str],
                parallel: int, timeout_s: float, progress: Callable[[HostResult, int, int], None],
                package: bytes | None = None) -> list[HostResult]:
    """Install on every host (the package first, if given); `progress` is called as each one finishes.
    Results keep the hosts' order."""
    results: dict[str, HostResult] = {}
    lock = threading.Lock()

    def one(host: str) -> None:
        result = package_on(host, package, ssh_options, timeout_s) if package is not None else None
        if result is None or result.ok:
            result = install_on(host, manifest_text, remote_argv, ssh_options, timeout_s)
        with lock:
            results[host] = result
            progress(result, len(results), len(hosts))

    with ThreadPoolExecutor(max_workers=max(1, parallel)) as pool:
        list(pool.map(one, hosts))
    return [results[h] for h in hosts]


# --- what crosses when override templates go along ------------------------------------------------------------

_TEMPLATE_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*\.j2")
_BUNDLE_MAX = 4 * 1024 * 1024


def make_bundle(manifest_text: str, templates: Path) -> str:
    """The manifest and the folder's `*.j2` templates as one JSON document for `install - --stdin-bundle`."""
    files: dict[str, str] = {}
    try:
        for path in sorted(templates.iterdir()):
            if path.is_file() and _TEMPLATE_NAME.fullmatch(path.name):
                files[path.name] = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise UsageError(f"--templates: {getattr(exc, 'filename', None) or templates}: {os_reason(exc)}") from None
    except UnicodeDecodeError:
        raise UsageError(f"--templates: {templates}: a template is not UTF-8 text") from None
    if not files:
        raise UsageError(f"--templates: {templates}: holds no *.j2 template")
    bundle = json.dumps({"manifest": manifest_text, "templates": files}, sort_keys=True)
    if len(bundle) > _BUNDLE_MAX:
        raise UsageError(f"--templates: {templates}: manifest and templates exceed {_BUNDLE_MAX // 1024 // 1024} MiB")
    return bundle


def open_bundle(raw: str, folder: Path) -> str:
    """Write a bundle's templates into `folder`; return its manifest text. The bundle is checked like any input."""
    try:
        data = json.loads(raw)
    except ValueError:
        raise UsageError("--stdin-bundle: standard input is not a JSON bundle") from None
    if not (isinstance(data, dict) and isinstance(data.get("manifest"), str) and isinstance(data.get("templates"), dict)):
        raise UsageError("--stdin-bundle: the bundle needs a 'manifest' text and a 'templates' mapping")
    for name, text in data["templates"].items():
        if not (isinstance(name, str) and _TEMPLATE_NAME.fullmatch(name) and isinstance(text, str)):
            raise UsageError(f"--stdin-bundle: {str(name)[:80]!r} is not a template name (NAME.j2) with text")
        (folder / name).write_text(text, encoding="utf-8")
    return data["manifest"]


def run_remote(host: str, argv: list[str], consul_path: str, ssh_options: list[str] | None = None) -> int:
    """Run `consulrun ARGV...` on `host` over ssh, its output passed through; its exit status, or 255 from ssh."""
    problem = host_problem(host)
    if problem:
        raise UsageError(f"--host: {problem}")
    try:
        return subprocess.run(ssh_argv(host, [consul_path, *argv], ssh_options or [])).returncode
    except OSError as exc:
        raise UsageError(f"cannot run ssh: {os_reason(exc)}") from None
