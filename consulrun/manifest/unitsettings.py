"""Extra systemd settings per job: which names systemd knows, and which consulrun keeps for itself.

A job's `service:` mapping (and the capitalised keys of its `timer:` mapping)
adds settings to the generated unit without a forked template. The names
systemd knows come from its own documentation (systemd.directives(7), saved
in `systemd_settings.json` by `scripts/systemd-settings`); the settings the
templates write, and those that would break the one-run-per-occurrence
guarantee, are refused with the manifest key to use instead.
"""

from __future__ import annotations

import difflib
import json
import re
from importlib import resources
from typing import Any

from consulrun.consul.client import CREDENTIAL_VARIABLES
from consulrun.manifest import unitescape, unitvalues

_KNOWN: dict[str, Any] = json.loads(resources.files("consulrun.manifest").joinpath("systemd_settings.json").read_text())
SECTION_TITLES = {"service": "[Service]", "timer": "[Timer]", "unit": "[Unit] or [Install]"}

_FENCING = "consulrun sets it so that systemd kills the whole job before another node can take the lock (see Fencing)"
_OUTSIDE_LOCK = "it would run on every node, outside the lock; make it part of the job's command"
_MONOTONIC = ("a monotonic trigger fires for no scheduled occurrence the nodes could agree on; "
              "use the job's schedule (OnCalendar=)")

OWNED: dict[str, dict[str, str]] = {
    "service": {
        "ExecStart": "consulrun writes it (consulrun run ... -- COMMAND); set the job's command",
        "Type": "consulrun's units are Type=oneshot, which its timers and exit statuses rely on",
        "RemainAfterExit": "a oneshot service that stays active is never started again by its timer",
        "KillMode": _FENCING,
        "KillSignal": _FENCING,
        "SendSIGKILL": _FENCING,
        "FinalKillSignal": _FENCING,
        "TimeoutStopSec": _FENCING,
        "TimeoutSec": "it sets TimeoutStopSec=, which consulrun derives from the lock settings; set the job's timeout",
        "TimeoutStartSec": "set the job's timeout",
        "User": "set the job's user",
        "Group": "set the job's group",
        "WorkingDirectory": "set the job's working_directory",
        "Environment": "set the job's environment",
        "EnvironmentFile": "set the job's environment_file",
        "SuccessExitStatus": "consulrun lists its skip code there; set lock.skip_exit_code",
        "ExecStartPre": _OUTSIDE_LOCK,
        "ExecStartPost": _OUTSIDE_LOCK,
        "ExecCondition": _OUTSIDE_LOCK,
        "ExecStop": _OUTSIDE_LOCK,
        "ExecStopPost": _OUTSIDE_LOCK,
        "ExecReload": _OUTSIDE_LOCK,
    },
    "timer": {
        "OnCalendar": "set the job's schedule",
        "Unit": "a consulrun timer starts its own job's service",
        "AccuracySec": "set timer.accuracy",
        "RandomizedDelaySec": "set timer.randomized_delay",
        "Persistent": "set timer.persistent",
        "OnActiveSec": _MONOTONIC,
        "OnBootSec": _MONOTONIC,
        "OnStartupSec": _MONOTONIC,
        "OnUnitActiveSec": _MONOTONIC,
        "OnUnitInactiveSec": _MONOTONIC,
    },
}
# Settings that change systemd's stop sequence, which fencing relies on (systemd.kill(5), systemd.service(5)): on a
# stop or a timeout the cgroup gets KillSignal= (SIGTERM, which the wrapper turns into its own kill of the job), then,
# after TimeoutStopSec= (derived from the lock settings), FinalKillSignal= (SIGKILL) with SendSIGKILL=yes. KillMode=,
# KillSignal=, FinalKillSignal=, SendSIGKILL= and TimeoutStopSec= are consulrun's (OWNED). These would also weaken it:
_ABORT = ("an abort sends WatchdogSignal= instead of the final kill and then waits TimeoutAbortSec= "
          "(infinity: for ever) before SIGKILL, past the time consulrun gives systemd to kill the whole job "
          "(see Fencing)")
KILL_SEQUENCE: dict[str, str] = {
    "WatchdogSignal": "it replaces the final SIGKILL when a stop or start times out with the abort mode (SIGCONT there "
                      "kills nothing), and a oneshot unit's watchdog never runs",
    "TimeoutAbortSec": "it is the wait between an abort's WatchdogSignal= and the final SIGKILL (infinity: for ever); "
                       "consulrun's units never abort, and this must not become a way to outlive the lock",
    "RestartKillSignal": "on `systemctl restart` the wrapper must get SIGTERM as on a stop, to kill the job, wait for "
                         "all of it and record the run",
}
# Settings taking one of several modes, of which some weaken the stop sequence: mode -> why.
KILL_SEQUENCE_MODES: dict[str, dict[str, str]] = {
    "TimeoutStopFailureMode": {"abort": _ABORT},
    "TimeoutStartFailureMode": {"abort": _ABORT},
}
# Credentials are a list setting a job may well extend; only the id the templates use is consulrun's.
_CREDENTIAL_SETTINGS = {"LoadCredential", "LoadCredentialEncrypted", "SetCredential", "SetCredentialEncrypted"}
CONSUL_TOKEN_CREDENTIAL = "consul-token"
_TRUE = frozenset({"1", "yes", "y", "true", "t", "on"})  # systemd's parse_boolean
# Settings that would write a secret into the unit file, which every user can read (docs/manifest.md).
SECRET_IN_UNIT = {
    "SetCredential": "it writes the credential's value into the unit file, which every user can read; put the secret "
                     "in a root-only file and use LoadCredential=ID:PATH (or SetCredentialEncrypted=)",
}
# systemd resolves `%` specifiers in some settings and not in others (CPUQuota=50%% is an invalid quota). These take a
# percentage and resolve none (tests/test_unit_settings.py asks systemd-analyze); elsewhere a `%` is refused.
PERCENT_SETTINGS = frozenset({"CPUQuota", "MemoryMin", "MemoryLow", "MemoryHigh", "MemoryMax", "MemorySwapMax",
                              "TasksMax", "ManagedOOMMemoryPressureLimit"})


def known(section: str) -> list[str]:
    """Setting names systemd documents for `section` ("service", "timer" or "unit")."""
    return _KNOWN[section]


def name_problem(section: str, name: Any) -> str | None:
    """Why `name` cannot be a setting of the job's `section`, or None if it can."""
    title = SECTION_TITLES[section]
    if not isinstance(name, str):
        return f"{name!r} is not a systemd setting name"
    if name.endswith("=") and name[:-1] in known(section):
        return f"write the setting name without '=': {name[:-1]}"
    if name in OWNED[section]:
        return f"{name}= is consulrun's: {OWNED[section][name]}"
    if section == "service" and name in SECRET_IN_UNIT:
        return f"{name}= is refused: {SECRET_IN_UNIT[name]}"
    if section == "service" and name in KILL_SEQUENCE:
        return f"{name}= is refused: {KILL_SEQUENCE[name]}"
    if name in known(section):
        return None
    for other in ("service", "timer", "unit"):
        if other != section and name in known(other):
            where = (f"put it under {other}:" if other != "unit"
                     else "consulrun writes only [Service] and [Timer] settings")
            return f"{name}= is a {SECTION_TITLES[other]} setting, not a {title} one; {where}"
    by_lower = {n.lower(): n for n in known(section)}
    hint = by_lower.get(name.lower()) or next(iter(difflib.get_close_matches(name, known(section), n=1)), None)
    suffix = f" (did you mean {hint!r}?)" if hint else ""
    return f"{name!r} is not a {title} setting systemd documents{suffix}"


def values(value: str | int | bool | list[str | int | bool]) -> list[str]:
    """A manifest value as the unit-file values it becomes: a list is one line per item."""
    items = value if isinstance(value, list) else [value]
    return [("true" if item else "false") if isinstance(item, bool) else str(item) for item in items]


def value_problem(name: str, value: str) -> str | None:
    """Why `value` cannot be given to `name` although it can be written, or None."""
    if name in _CREDENTIAL_SETTINGS and value.split(":", 1)[0] == CONSUL_TOKEN_CREDENTIAL:
        return f"the credential id {CONSUL_TOKEN_CREDENTIAL!r} is consulrun's (consul.token_file); choose another id"
    if value.strip().lower() in KILL_SEQUENCE_MODES.get(name, {}):
        allowed = " or ".join(m for m in ("terminate", "kill") if m not in KILL_SEQUENCE_MODES[name])
        why = KILL_SEQUENCE_MODES[name][value.strip().lower()]
        return f"{name}={value.strip()} is refused ({allowed} are accepted): {why}"
    if name == "PrivateNetwork" and value.strip().lower() in _TRUE:
        return ("PrivateNetwork=yes is refused: consulrun reaches the node's agent over the host's network, and marks "
                "a running holder with an abstract unix socket in the host's network namespace, which the node's "
                "other units and reap must see (a new namespace's loopback is not the agent's)")
    if name == "PassEnvironment" and CREDENTIAL_VARIABLES & set(value.split()):
        return ("would hand the service manager's Consul credentials to the job; consulrun passes the node's token with "
                "consul.token_file, and to the job only with pass_consul_token: true")
    systemd_would_ignore = unitvalues.problem(name, value)
    if systemd_would_ignore:
        return systemd_would_ignore
    if "%" in value and name not in PERCENT_SETTINGS:
        return (f"has a '%', which {name}= may or may not read as a specifier; consulrun writes '%' only in settings "
                f"known to take it literally ({', '.join(s + '=' for s in sorted(PERCENT_SETTINGS))})")
    return None


def escape(name: str, value: str) -> str:
    """The unit-file text of one value of setting `name` (checked by `value_problem` when the manifest loaded)."""
    context = unitescape.Context.NO_SPECIFIERS if name in PERCENT_SETTINGS else unitescape.Context.PLAIN
    return unitescape.escape(value, context)


def is_setting_name(key: Any) -> bool:
    """systemd setting names are capitalised; consulrun's own keys (`timer.accuracy`) are not."""
    return isinstance(key, str) and re.match(r"[A-Z]", key) is not None


def block_problems(block: Any, section: str) -> list[tuple[tuple[Any, ...], str, bool]]:
    """(path within the block, message, whether the key is at fault) for a `service:` or `timer:` mapping.

    Names must be documented for the section and not consulrun's; values must
    be writable to a unit file. Types are the schema's to report.
    """
    if not isinstance(block, dict):
        return []
    problems: list[tuple[tuple[Any, ...], str, bool]] = []
    for name, value in block.items():
        if section == "timer" and not is_setting_name(name):
            continue  # consulrun's own timer keys, checked by the schema
        problem = name_problem(section, name)
        if problem:
            problems.append(((name,), problem, True))
            continue
        items = list(enumerate(value)) if isinstance(value, list) else [(None, value)]
        for index, item in items:
            if isinstance(item, (list, dict, float)) or item is None:
                continue
            where = (name,) if index is None else (name, index)
            text = values(item)[0]
            try:
                unitescape.escape(text, unitescape.Context.PLAIN)
            except unitescape.UnrepresentableError as exc:
                problems.append((where, f"cannot be written to a unit file: {exc}", False))
                continue
            problem = value_problem(name, text)
            if problem:
                problems.append((where, problem, False))
    return problems
