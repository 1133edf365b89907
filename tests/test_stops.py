"""stops.py without systemd: which unit a wrapper runs in, read from its cgroup as systemd placed it."""

from __future__ import annotations

import pytest

from consulrun.protocol.procinfo import own_unit


@pytest.mark.parametrize(("cgroup", "unit"), [
    ("0::/system.slice/consulrun-tick.service\n", "consulrun-tick.service"),  # cgroup v2
    ("12:pids:/system.slice/x.service\n1:name=systemd:/system.slice/consulrun-a.b.service\n0::/\n",
     "consulrun-a.b.service"),  # hybrid: systemd's own hierarchy, not a controller's
    ("4:memory:/system.slice/consulrun-old.service\n", "consulrun-old.service"),  # v1 without name=systemd
    ("0::/user.slice/user-0.slice/session-3.scope\n", None),  # a shell: no unit, so no stop is second-guessed
    ("", None),
])
def test_own_unit(cgroup: str, unit: str | None) -> None:
    assert own_unit(lambda: cgroup) == unit

