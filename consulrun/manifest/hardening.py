"""`hardening: strict`: a sandbox preset a job opts into, with what consulrun itself needs already allowed.

`systemd-analyze security` (systemd 252) scores a plain consulrun unit 9.2 to
9.5 (UNSAFE); with this preset and a `user:` of its own, 1.1 to 1.4 (OK). The preset is written
before the job's own `service:` settings, and systemd reads a unit's lines in
order, so the job's own setting wins:

- a setting systemd takes once (ProtectSystem=, UMask=, ...): the preset's
  line is left out and the job's is written instead;
- a list setting (SystemCallFilter=, IPAddressAllow=, RestrictAddressFamilies=,
  CapabilityBoundingSet=, ...): the job's lines follow the preset's and extend
  them as systemd extends lists; a job's empty value resets the list, as in
  systemd (`IPAddressDeny: ""` lifts the IP filter).

What consulrun needs, and so what the preset keeps open:
- its agent: IP traffic to the agent's address only (`localhost` for a
  loopback agent, the default 127.0.0.1:8500; none for a unix socket), over
  http or https alike (the filter is on addresses, not ports); a host name
  cannot be filtered on, and is refused unless the job says which addresses
  (systemd enforces the filter on the unified cgroup hierarchy only);
- the hold marker (protocol/procinfo.py), an abstract unix socket in the host's
  network namespace: AF_UNIX, and no PrivateNetwork= (which is refused);
- the boot id (/proc/sys/kernel/random/boot_id), by which `reap` tells a dead
  wrapper from a live one: so no ProcSubset=pid;
- its token: LoadCredential= is read by systemd before the sandbox is set up;
- `reap` in ExecStopPost=, which runs in the same sandbox: the same agent,
  marker and /proc (ProtectProc=invisible leaves a user's own processes
  visible). But systemd (252, tested) gives ExecStopPost= no credentials once
  the unit has a mount namespace (its /run/credentials is made inaccessible),
  so with a token a hardened unit's reap runs as root (`!`: no User=, the
  sandbox and its empty capability set still apply), with only the agent's
  settings for an environment, and reads the root-only `consul.token_file`
  itself. It stays inside the sandbox: in a container,
  ProtectKernelTunables= and ProtectProc= show the host's boot id instead of
  the container's, and reap must see the one its wrapper saw;
- the on-failure unit: a unit of its own, not sandboxed by this (its command
  is the operator's notifier: mail, curl to anywhere);
- /home, /root and /run/user read-only instead of hidden when consulrun (or the
  Python it runs in), the job's command or working directory, or the agent's
  TLS files live there; and no PrivateTmp= when one of them is under /tmp or
  /var/tmp (a checkout's venv there would not be found).
"""

from __future__ import annotations

import ipaddress
import os

TYPE_CHECKING = False
if TYPE_CHECKING:
    from consulrun.manifest.loader import Job, Manifest

HOME_PATHS = ("/home/", "/root/", "/run/user/")
TMP_PATHS = ("/tmp/", "/var/tmp/")
# Settings whose lines systemd adds up (an empty value resets them): a job's lines extend the preset's.
LIST_SETTINGS = frozenset({"SystemCallFilter", "RestrictAddressFamilies", "IPAddressAllow", "IPAddressDeny",
                           "CapabilityBoundingSet", "AmbientCapabilities"})
# (setting, value), in the order written; the agent's IPAddressAllow= and ProtectHome= are added per job.
STRICT: tuple[tuple[str, str], ...] = (
    ("ProtectSystem", "strict"),
    ("PrivateTmp", "yes"),
    ("PrivateDevices", "yes"),
    ("PrivateIPC", "yes"),
    ("PrivateMounts", "yes"),
    ("ProtectKernelTunables", "yes"),
    ("ProtectKernelModules", "yes"),
    ("ProtectKernelLogs", "yes"),
    ("ProtectControlGroups", "yes"),
    ("ProtectClock", "yes"),
    ("ProtectHostname", "yes"),
    ("ProtectProc", "invisible"),
    ("NoNewPrivileges", "yes"),
    ("RestrictNamespaces", "yes"),
    ("RestrictRealtime", "yes"),
    ("RestrictSUIDSGID", "yes"),
    ("LockPersonality", "yes"),
    ("MemoryDenyWriteExecute", "yes"),
    ("KeyringMode", "private"),
    ("UMask", "0077"),
    ("CapabilityBoundingSet", ""),
    ("RestrictAddressFamilies", "AF_UNIX AF_INET AF_INET6"),
    ("IPAddressDeny", "any"),
    ("SystemCallArchitectures", "native"),
    ("SystemCallFilter", "@system-service"),
    ("SystemCallFilter", "~@privileged @resources"),
    ("SystemCallErrorNumber", "EPERM"),
)


def _allowed_host(host: str) -> str | None:
    """IPAddressAllow='s value for a host consulrun talks to: `localhost` for loopback, the literal for an IP."""
    if host == "localhost":
        return "localhost"
    try:
        address = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return None
    return "localhost" if address.is_loopback else str(address)


def _agent_host(manifest: Manifest) -> tuple[str, str | None]:
    """(how the agent is named, its IPAddressAllow= value or None if it has no IP or cannot be filtered on)."""
    from consulrun.consul.address import parse_address

    text = manifest.consul.address or "127.0.0.1:8500"  # the consul CLI's default, which run uses too
    endpoint = parse_address(text)
    if endpoint.socket_path:
        return text, ""
    return text, _allowed_host(endpoint.host)


def _ping_host(url: str) -> str:
    from urllib.parse import urlsplit

    return urlsplit(url).hostname or ""


def _sets_ip_filter(job: Job) -> bool:
    return any(name in ("IPAddressAllow", "IPAddressDeny") for name, _ in job.service_settings)


def problems(manifest: Manifest, job: Job) -> list[str]:
    """Why `job`'s preset cannot be written as asked: a peer it must reach that an IP filter cannot name."""
    if job.hardening != "strict" or _sets_ip_filter(job):
        return []
    out = []
    agent, allowed = _agent_host(manifest)
    if allowed is None:
        out.append(f"strict allows IP traffic to the Consul agent only, and consul.address {agent!r} names a host, "
                   "which systemd's IP filter cannot name: write the agent's IP address, or list its addresses "
                   "under service: IPAddressAllow")
    if job.ping_url and _allowed_host(_ping_host(job.ping_url)) is None:
        out.append(f"strict allows IP traffic to the Consul agent only, and ping_url's host "
                   f"{_ping_host(job.ping_url)!r} is another: list its addresses under service: IPAddressAllow, "
                   "or lift the filter with service: {IPAddressDeny: ''}")
    return out


def _program_paths(path: str) -> list[str]:
    """`path`, where its symbolic links lead, and its script's interpreter (a venv's python, e.g. a pyenv under
    /root): all of them must stay visible. Read on this machine, where `install` renders the node's units."""
    found = [path, os.path.realpath(path)]
    try:
        with open(path, "rb") as handle:
            first = handle.read(256).split(b"\n", 1)[0]
    except OSError:
        return found
    if first.startswith(b"#!") and first[2:].split():
        interpreter = os.fsdecode(first[2:].split()[0])
        found += [interpreter, os.path.realpath(interpreter)]
    return found


def _needed_paths(manifest: Manifest, job: Job, consulrun_path: str) -> list[str]:
    """What the unit must see: consulrun (and its Python), the job's command and folder, the agent's TLS files."""
    consul = manifest.consul
    return [*_program_paths(consulrun_path), job.command[0] if job.command else "", job.working_directory or "",
            consul.ca_file or "", consul.cert_file or "", consul.key_file or ""]


def _in_home(path: str) -> bool:
    return path.startswith(HOME_PATHS) or path.rstrip("/") in ("/home", "/root")


def _home_visible(manifest: Manifest, job: Job, consulrun_path: str) -> bool:
    return any(map(_in_home, _needed_paths(manifest, job, consulrun_path)))


def _tmp_needed(manifest: Manifest, job: Job, consulrun_path: str) -> bool:
    """PrivateTmp= gives the unit an empty /tmp and /var/tmp: a consulrun (a checkout's venv) or a job there
    would not be found (systemd: `Failed to locate executable`), so the preset leaves the host's /tmp then."""
    return any(p.startswith(TMP_PATHS) for p in _needed_paths(manifest, job, consulrun_path))


def relaxed(manifest: Manifest, job: Job, consulrun_path: str) -> list[tuple[str, str]]:
    """(what the preset writes instead of its usual setting, the path that made it so) for each
    setting relaxed for `job` because something it needs lives in a home or a temporary folder,
    which `generate` names: a unit quietly less sandboxed than the docs' preset list says is
    one nobody chose. A setting the job's own `service:` sets is the job's choice, not listed."""
    if job.hardening != "strict":
        return []
    own = {name for name, _ in job.service_settings}
    needed = [p for p in _needed_paths(manifest, job, consulrun_path) if p]
    out = []
    home = next((p for p in needed if _in_home(p)), None)
    if home and "ProtectHome" not in own:
        out.append(("ProtectHome=read-only (not yes)", home))
    tmp = next((p for p in needed if p.startswith(TMP_PATHS)), None)
    if tmp and "PrivateTmp" not in own:
        out.append(("PrivateTmp= left out", tmp))
    return out


def relaxed_lines(manifest: Manifest, consulrun_path: str) -> list[str]:
    """One line for each setting the preset relaxed and why, naming the jobs it was relaxed for."""
    jobs: dict[tuple[str, str], list[str]] = {}
    for job in manifest.jobs:
        for setting, path in relaxed(manifest, job, consulrun_path):
            jobs.setdefault((setting, path), []).append(job.name)
    out = []
    for (setting, path), names in jobs.items():
        home = setting.startswith("ProtectHome")
        where = "/home, /root or /run/user" if home else "/tmp or /var/tmp"
        hides = "ProtectHome=yes" if home else "PrivateTmp=yes"
        out.append(f"hardening: strict is relaxed for {', '.join(names)}: {setting}, as {path} is "
                   f"under {where}, which {hides} would hide from the unit")
    return out


# Settings that give a unit a mount namespace (systemd.exec(5)), and with it no credentials in ExecStopPost=.
MOUNT_NAMESPACE_SETTINGS = frozenset({
    "ProtectSystem", "ProtectHome", "PrivateTmp", "PrivateDevices", "PrivateMounts", "ProtectKernelTunables",
    "ProtectKernelModules", "ProtectKernelLogs", "ProtectControlGroups", "ProtectProc", "ProcSubset",
    "ReadWritePaths", "ReadOnlyPaths", "InaccessiblePaths", "ExecPaths", "NoExecPaths", "TemporaryFileSystem",
    "BindPaths", "BindReadOnlyPaths", "RootDirectory", "RootImage", "MountImages", "ExtensionImages",
    "ExtensionDirectories", "DynamicUser", "MountAPIVFS", "LogNamespace", "ProtectHostname", "PrivateIPC",
    "PrivateUsers", "ProtectClock", "NetworkNamespacePath"})
_OFF = frozenset({"", "0", "no", "n", "false", "f", "off", "default", "all"})


def reap_as_root(manifest: Manifest, job: Job) -> bool:
    """Whether `job`'s ExecStopPost= reap runs as root in the unit's sandbox (`!`) and reads the token file itself:
    in a unit with a mount namespace, a control command after the main process finds no credentials (see the
    module's docstring), whether the preset or the job's own settings made it. Counting a setting that makes no
    namespace costs nothing (root reads the file either way); missing one would leave reap without its token."""
    if not manifest.consul.token_file:
        return False
    return job.hardening == "strict" or any(name in MOUNT_NAMESPACE_SETTINGS and value.strip().lower() not in _OFF
                                            for name, value in job.service_settings)


def service_lines(manifest: Manifest, job: Job, consulrun_path: str) -> list[tuple[str, str]]:
    """The preset's [Service] lines for `job` (none unless it asks for one), less what its own settings replace."""
    if job.hardening != "strict":
        return []
    lines = list(STRICT)
    if _tmp_needed(manifest, job, consulrun_path):
        lines.remove(("PrivateTmp", "yes"))
    lines.insert(1, ("ProtectHome", "read-only" if _home_visible(manifest, job, consulrun_path) else "yes"))
    _, allowed = _agent_host(manifest)
    if allowed:
        lines.insert(lines.index(("IPAddressDeny", "any")) + 1, ("IPAddressAllow", allowed))
    if job.ping_url:
        ping = _allowed_host(_ping_host(job.ping_url))
        if ping and ping != allowed:
            lines.insert(lines.index(("IPAddressDeny", "any")) + 1, ("IPAddressAllow", ping))
    own = {name for name, _ in job.service_settings}
    return [(name, value) for name, value in lines if name in LIST_SETTINGS or name not in own]
