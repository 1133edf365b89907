"""The values systemd accepts for the resource and sandbox settings a job's `service:` may set.

systemd does not refuse a unit for a bad value: it logs `Invalid memory limit 'lots', ignoring`
when the unit loads and runs the job without the limit or the sandbox asked for. So these
values are checked when the manifest loads, as systemd 252 parses them (systemd.resource-control(5),
systemd.exec(5)); tests/unit_values.txt holds cases with systemd-analyze verify's verdict beside
each, and the test checks that ours agrees. A setting not listed here is written as given: its
value is the job's to get right.
"""

from __future__ import annotations

import re
from collections.abc import Callable

Check = Callable[[str], "str | None"]

_TRUE = ("1", "yes", "y", "true", "t", "on")
_FALSE = ("0", "no", "n", "false", "f", "off")
_BOOLEAN = _TRUE + _FALSE
_NUMBER = r"[0-9]+(?:\.[0-9]+)?"
_SIZE = re.compile(rf"{_NUMBER}\s*[KMGTPE]?")  # systemd's parse_size, base 1024
_PERCENT = re.compile(r"(?P<n>[0-9]+(?:\.[0-9]{1,2})?)%|(?P<m>[0-9]+(?:\.[0-9])?)‰|(?P<d>[0-9]+)‱")
_INTEGER = re.compile(r"[+-]?[0-9]+")
_NAMESPACES = ("cgroup", "ipc", "net", "mnt", "pid", "user", "uts")


def _permyriad(value: str) -> int | None:
    """A percentage (`50%`, `12.5%`, `500‰`, `10‱`) in ten-thousandths, or None."""
    found = _PERCENT.fullmatch(value)
    if found is None:
        return None
    if found["n"] is not None:
        return round(float(found["n"]) * 100)
    if found["m"] is not None:
        return round(float(found["m"]) * 10)
    return int(found["d"])


def boolean(value: str) -> str | None:
    return None if value.lower() in _BOOLEAN else "is not a boolean (yes or no)"


def choice(*words: str, or_boolean: bool = False) -> Check:
    def check(value: str) -> str | None:
        if value in words or (or_boolean and value.lower() in _BOOLEAN):
            return None
        return "is not " + " or ".join((["yes", "no"] if or_boolean else []) + list(words))
    return check


def integer(low: int, high: int, *words: str) -> Check:
    def check(value: str) -> str | None:
        if value in words or (_INTEGER.fullmatch(value) and low <= int(value) <= high):
            return None
        return f"is not a whole number from {low} to {high}" + "".join(f" or {w}" for w in words)
    return check


def size(percent: bool, zero: bool = True) -> Check:
    """A byte count with a K, M, G, T, P or E suffix (base 1024) or infinity; with `percent`, a
    percentage of the memory too; without `zero`, 0 is refused (MemoryMax=0 is out of range)."""
    def check(value: str) -> str | None:
        if value == "infinity" or (_SIZE.fullmatch(value) and (zero or _nonzero(value))):
            return None
        share = _permyriad(value) if percent else None
        if share is not None and share <= 10000:
            return None
        share_too = " or a percentage up to 100%" if percent else ""
        return "is not a size (512M, 2G), infinity" + share_too
    return check


def _nonzero(value: str) -> bool:
    return float(re.sub(r"[^0-9.]", "", value)) > 0


def tasks(value: str) -> str | None:
    if value == "infinity" or (re.fullmatch(r"\+?[0-9]+", value) and int(value) > 0):
        return None
    share = _permyriad(value)
    if share is not None and share <= 10000:
        return None
    return "is not a number of tasks above 0, a percentage up to 100%, or infinity"


def cpu_quota(value: str) -> str | None:
    if (_permyriad(value) or 0) > 0 and "%" in value:
        return None
    return "is not a percentage above 0% (100% is one CPU)"


def rlimit(sizes: bool) -> Check:
    """LimitNOFILE= (a count) and LimitCORE= (a size, with a suffix): one value or SOFT:HARD, each a
    number or infinity."""
    number = _SIZE if sizes else re.compile("[0-9]+")

    def check(value: str) -> str | None:
        parts = value.split(":")
        if len(parts) <= 2 and all(p == "infinity" or number.fullmatch(p) for p in parts):
            return None
        what = "a size" if sizes else "a number"
        return f"is not a limit: {what} or infinity, or SOFT:HARD"
    return check


def umask(value: str) -> str | None:
    if re.fullmatch(r"[0-7]+", value) and int(value, 8) <= 0o7777:
        return None
    return "is not an octal file mode mask (0077)"


def namespaces(value: str) -> str | None:
    if value.lower() in _BOOLEAN:
        return None
    words = value.removeprefix("~").split()
    if (words or value == "~") and all(word in _NAMESPACES for word in words):
        return None
    return f"is not yes, no, or a list of namespace types ({' '.join(_NAMESPACES)}), ~ to deny them"


_WEIGHT = integer(1, 10000)
CHECKS: dict[str, Check] = {
    **dict.fromkeys(("CPUAccounting", "MemoryAccounting", "IOAccounting", "IPAccounting",
                     "TasksAccounting", "NoNewPrivileges", "PrivateTmp", "PrivateDevices",
                     "PrivateIPC", "PrivateMounts", "PrivateUsers", "ProtectKernelTunables",
                     "ProtectKernelModules", "ProtectKernelLogs", "ProtectControlGroups",
                     "ProtectClock", "ProtectHostname", "RestrictRealtime", "RestrictSUIDSGID",
                     "LockPersonality", "MemoryDenyWriteExecute", "RemoveIPC", "DynamicUser",
                     "MountAPIVFS"), boolean),
    "ProtectSystem": choice("full", "strict", or_boolean=True),
    "ProtectHome": choice("read-only", "tmpfs", or_boolean=True),
    "ProtectProc": choice("noaccess", "invisible", "ptraceable", "default"),
    "ProcSubset": choice("all", "pid"),
    "KeyringMode": choice("inherit", "private", "shared"),
    "DevicePolicy": choice("auto", "closed", "strict"),
    "RestrictNamespaces": namespaces,
    "ManagedOOMSwap": choice("auto", "kill"),
    "ManagedOOMMemoryPressure": choice("auto", "kill"),
    "ManagedOOMPreference": choice("none", "avoid", "omit"),
    "OOMPolicy": choice("continue", "stop", "kill"),
    "CPUSchedulingPolicy": choice("other", "batch", "idle", "fifo", "rr"),
    "IOSchedulingClass": choice(*"012345678", "none", "realtime", "best-effort", "idle"),
    "Nice": integer(-20, 19),
    "OOMScoreAdjust": integer(-1000, 1000),
    "CPUSchedulingPriority": integer(0, 99),
    "IOSchedulingPriority": integer(0, 7),
    "CPUWeight": integer(1, 10000, "idle"),
    "StartupCPUWeight": integer(1, 10000, "idle"),
    "IOWeight": _WEIGHT,
    "StartupIOWeight": _WEIGHT,
    "CPUQuota": cpu_quota,
    **dict.fromkeys(("MemoryMin", "MemoryLow", "MemorySwapMax"), size(percent=True)),
    **dict.fromkeys(("MemoryHigh", "MemoryMax"), size(percent=True, zero=False)),
    "TasksMax": tasks,
    **dict.fromkeys(("LimitNOFILE", "LimitNPROC", "LimitLOCKS", "LimitSIGPENDING"),
                    rlimit(sizes=False)),
    **dict.fromkeys(("LimitCORE", "LimitMEMLOCK", "LimitAS", "LimitDATA", "LimitFSIZE",
                     "LimitSTACK", "LimitRSS", "LimitMSGQUEUE"), rlimit(sizes=True)),
    "UMask": umask,
}


def problem(name: str, value: str) -> str | None:
    """Why systemd would ignore `value` for `name` (`'lots' is not a size ...`), or None. An empty
    value resets a setting to its default, which systemd accepts for each of these."""
    check = CHECKS.get(name)
    if check is None or value == "":
        return None
    why = check(value.strip())
    return f"{name}={value} is ignored by systemd: {value.strip()!r} {why}" if why else None
