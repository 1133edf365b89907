"""`mode: each-node` on real systemd nodes: the units `consulrun install` wrote, timers firing for real.

Three booted containers, each with its own Consul agent (a server on node1,
clients on node2 and node3), run a job every 20 s that takes 2 s, one node at
a time: every node runs every occurrence once, no two at once (containers share
the host's clock, so the runs' own times compare), each node's record and
history sit under its own key, and `status` shows a row per node.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterator

import pytest

from tests.harness.agents import wait_for
from tests.harness.nodes import CONSULRUN, install, journal, manifest, node_kv as _kv, three_agents
from tests.harness.nspawn import Container

pytestmark = [pytest.mark.systemd, pytest.mark.consul]

JOB = {"command": ["sh", "-c", "echo start $CONSULRUN_OCCURRENCE $(hostname) $(date +%s.%N) >> /shared/runs; sleep 2; "
                               "echo end $CONSULRUN_OCCURRENCE $(hostname) $(date +%s.%N) >> /shared/runs"],
       "schedule": "*:*:0/20", "mode": "each-node", "lock": {"concurrency": 1}}


@pytest.fixture(scope="module")
def nodes(consul_bin: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Container]]:
    with three_agents(consul_bin, tmp_path_factory.mktemp("eachnode"), subnet="10.213.141.0/24", tag="w",
                      name="cre") as cluster:
        yield cluster


def _runs(nodes: list[Container]) -> list[tuple[str, str, float, float]]:
    """(occurrence, host, start, end) of every run that ended, on every node."""
    out = []
    for ctr in nodes:
        path = ctr.shared / "runs"
        starts: dict[str, float] = {}
        for line in path.read_text().splitlines() if path.exists() else []:
            what, occ, host, when = line.split()
            if what == "start":
                starts[occ] = float(when)
            elif occ in starts:
                out.append((occ, host, starts.pop(occ), float(when)))
    return out


def test_real_timers_run_every_node_once_per_occurrence_one_at_a_time(nodes: list[Container]) -> None:
    for ctr in nodes:
        assert install(ctr, manifest({"roll": JOB})).returncode == 0

    def complete() -> list[str]:  # occurrences every node has run
        count = Counter(occ for occ, _, _, _ in _runs(nodes))
        return sorted(occ for occ, n in count.items() if n == len(nodes))

    try:
        wait_for(lambda: len(complete()) >= 2, 90, "two occurrences run on every node")
        runs = _runs(nodes)
        status = nodes[2].exec(CONSULRUN, "status", "roll", check=False)
        as_json = nodes[0].exec(CONSULRUN, "status", "--json", "roll", check=False)
        records = _kv(nodes[0], "consulrun/roll/nodes/")
        said = "\n".join(journal(ctr, "consulrun-roll.service") for ctr in nodes)
    finally:
        for ctr in nodes:
            ctr.exec(CONSULRUN, "uninstall", "/shared/jobs.yaml")
            (ctr.shared / "runs").unlink(missing_ok=True)
    count = Counter(occ for occ, _, _, _ in runs)
    for occ in sorted(occ for occ, n in count.items() if n == len(nodes))[:2]:
        mine = [r for r in runs if r[0] == occ]
        assert len({host for _, host, _, _ in mine}) == len(nodes), mine  # every node, each once
        ordered = sorted(mine, key=lambda r: r[2])
        assert all(a[3] <= b[2] for a, b in zip(ordered, ordered[1:])), ordered  # one at a time
    assert Counter((occ, host) for occ, host, _, _ in runs).most_common(1)[0][1] == 1, runs  # never twice on a node
    for node in ("node1", "node2", "node3"):
        record = records[f"consulrun/roll/nodes/{node}/occurrence"]
        assert record["state"] in ("done", "running") and record["node"] == node, record
        assert any(k.startswith(f"consulrun/roll/nodes/{node}/history/") for k in records), sorted(records)
    assert "every slot is held" in said, said  # the later nodes waited for the slot, as the rolling order has it
    rows = [line.split()[0] for line in status.stdout.splitlines()]
    assert {"roll@node1", "roll@node2", "roll@node3"} <= set(rows), status.stdout + status.stderr
    job = json.loads(as_json.stdout)["jobs"][0]
    assert [row["node"] for row in job["nodes"]] == ["node1", "node2", "node3"], as_json.stdout
    assert all(row["healthy"] for row in job["nodes"]), as_json.stdout
