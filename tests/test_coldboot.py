"""A cold boot of the whole cluster: every node powered off across an occurrence, then booted together; and, on
the same nodes (each agent a unit systemd restarts), an agent SIGKILLed under a running job.

Each node's Consul agent is a systemd unit of its own (`Type=notify`, as Consul's packaged unit has), so it
starts at boot beside the jobs' timers. A `Persistent=true` timer then fires its catch-up for the missed
occurrence at once, while the agents are still starting: nothing listens yet, no leader is elected, the node is
not yet in the catalog. The catch-up must wait that out (within its start budget) and run on exactly one node.
"""

from __future__ import annotations

import base64
import json
import os
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest

from consulrun.protocol import keys as kvkeys
from tests.conftest import artifact_dir, container_binds, require_tool
from tests.harness.agents import wait_for
from tests.harness.netns import Network
from tests.harness.nodes import install, journal, manifest
from tests.harness.nspawn import Container

pytestmark = [pytest.mark.systemd, pytest.mark.consul]

AGENT_UNIT = """[Unit]
Description=Consul agent (test node {index})
Wants=network-online.target
After=network-online.target

[Service]
Type={kind}
{pre}ExecStart={consul} agent -node node{index} -bind {ip} -client 127.0.0.1 -data-dir /var/lib/consul \
-hcl "disable_update_check = true" -hcl "ports {{ dns = -1 }}" -hcl "performance {{ raft_multiplier = 1 }}" {role}
Restart=on-failure
TimeoutStartSec=3min

[Install]
WantedBy=multi-user.target
"""


# How the node's agent is installed: (unit name, Type=, what runs before it).
#  packaged:  Consul's packaged consul.service, Type=notify. Consul says READY=1 once it has joined the LAN
#             (agent.go, JoinLAN), so every node lists every other in retry_join, the server too (a lone server
#             that joins nobody would never be ready). The jobs' After=consul.service waits for that.
#  unordered: a unit of another name (the manifest does not name it), Type=exec, slow to start (waiting for its
#             network or configuration): nothing orders the jobs after it, so their catch-up meets an agent that
#             does not listen yet, then one without a leader or without its node registered.
#  named:     that unit slow to start, Type=notify, named in the manifest (consul.agent_unit): the jobs' units
#             want it and wait for it, so their catch-up never meets an agent that does not listen.
AGENTS = {"packaged": ("consul.service", "notify", ""),
          "unordered": ("consul-agent.service", "exec", "ExecStartPre=/bin/sleep 5\n"),
          "named": ("consul-agent.service", "notify", "ExecStartPre=/bin/sleep 5\n")}


def _agent_unit(ctr: Container, consul: str, index: int, network: Network, how: str) -> None:
    """The node's agent as an enabled unit in its own /etc: it starts when the node boots."""
    name, kind, pre = AGENTS[how]
    joins = " ".join(f"-retry-join {network.address(i)}" for i in range(3))
    role = ("-server -bootstrap-expect=1 " if index == 1 else "") + joins
    units = ctr.dir / "upper" / "etc" / "systemd" / "system"
    (units / "multi-user.target.wants").mkdir(parents=True, exist_ok=True)
    (units / name).write_text(AGENT_UNIT.format(index=index, consul=consul, ip=network.address(index - 1),
                                                role=role, kind=kind, pre=pre))
    (units / "multi-user.target.wants" / name).symlink_to(f"/etc/systemd/system/{name}")


def _boot_all(nodes: list[Container]) -> None:
    """Boot every node at once (each waits for its agent, which waits for the others)."""
    with ThreadPoolExecutor(len(nodes)) as pool:
        for started in [pool.submit(ctr.start, 240) for ctr in nodes]:
            started.result()


def _power_off_all(nodes: list[Container]) -> None:
    for ctr in nodes:
        ctr.power_off()
    for ctr in nodes:
        ctr.stop()


@pytest.fixture(params=sorted(AGENTS))
def cluster(consul_bin: str, tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[tuple[list[Container], Network]]:
    """Three nodes, each with its agent as an enabled unit installed as AGENTS[param] says."""
    require_tool("systemd-nspawn")
    if os.geteuid() != 0:
        pytest.fail("booting systemd containers needs root", pytrace=False)
    network = Network(3, subnet="10.213.97.0/24", tag="k").up()
    nodes = [Container(f"crk{i}-{os.getpid() % 10000}", tmp_path, netns=network.namespace(i - 1),
                       binds=container_binds()) for i in (1, 2, 3)]
    try:
        for index, ctr in enumerate(nodes, 1):
            ctr.dir.mkdir(parents=True, exist_ok=True)
            _agent_unit(ctr, consul_bin, index, network, request.param)
        _boot_all(nodes)
        yield nodes, network
    finally:
        _power_off_all(nodes)
        network.down()


def _leader_sees_all(ctr: Container, consul: str) -> bool:
    nodes = ctr.exec(consul, "catalog", "nodes", check=False).stdout.split()
    return all(f"node{i}" in nodes for i in (1, 2, 3))


def _history(ctr: Container, consul: str, job: str) -> dict[str, dict]:
    out = ctr.exec(consul, "kv", "export", f"consulrun/{job}/history/", check=False)
    if out.returncode != 0:
        return {}
    return {kvkeys.history_order(e["key"])[0]: json.loads(base64.b64decode(e["value"])) for e in json.loads(out.stdout)}


def _settled(ctr: Container, unit: str) -> bool:
    """The catch-up run of `unit` on this node has started and ended (a oneshot is inactive or failed after)."""
    shown = ctr.systemctl("show", unit, "-p", "ActiveState,InactiveExitTimestampMonotonic", check=False).stdout
    values = dict(line.split("=", 1) for line in shown.splitlines() if "=" in line)
    return values.get("InactiveExitTimestampMonotonic", "0") != "0" and \
        values.get("ActiveState") in ("inactive", "failed")


def _keep_journals(request: pytest.FixtureRequest, ctrs: list[Container], unit: str, agent: str) -> Path:
    """Each node's journal of `unit` and its agent's units, this boot, into the test's artifacts (what the
    assertions after it read); the artifacts' directory."""
    dest = artifact_dir(request.node)
    dest.mkdir(parents=True, exist_ok=True)
    for ctr in ctrs:
        log = ctr.exec("journalctl", "--no-pager", "-b", "-u", unit, "-u", agent, check=False)
        (dest / f"{ctr.name}.journal").write_text(log.stdout + log.stderr)
    return dest


def test_cold_boot_of_every_node_runs_the_missed_occurrence_once(cluster, consul_bin: str,
                                                                  request: pytest.FixtureRequest) -> None:
    nodes, _ = cluster
    wait_for(lambda: _leader_sees_all(nodes[0], consul_bin), 120, "the three agents to form a cluster")
    # One occurrence a day, due shortly: the nodes are off when it comes (and the start budget is the full 2m).
    due = (datetime.now(timezone.utc) + timedelta(seconds=40)).replace(microsecond=0)
    occurrence = due.strftime("%Y-%m-%dT%H:%M:%SZ")
    job = {"command": ["sh", "-c", "echo $CONSULRUN_OCCURRENCE $(hostname) >> /shared/runs"],
           "schedule": due.strftime("*-*-* %H:%M:%S UTC"), "timer": {"persistent": True}}
    how = request.node.callspec.params["cluster"]
    text = manifest({"nightly": job}, **({"consul": {"agent_unit": AGENTS[how][0]}} if how == "named" else {}))
    for ctr in nodes:
        result = install(ctr, text)
        assert result.returncode == 0, result.stderr
    assert datetime.now(timezone.utc) < due - timedelta(seconds=5), "installing took too long for this test"
    _power_off_all(nodes)
    while datetime.now(timezone.utc) < due + timedelta(seconds=2):  # the occurrence passes with every node off
        time.sleep(0.5)
    _boot_all(nodes)
    unit = "consulrun-nightly.service"

    def runs() -> list[list[str]]:
        return [line.split() for ctr in nodes if (ctr.shared / "runs").exists()
                for line in (ctr.shared / "runs").read_text().splitlines()]

    try:
        wait_for(lambda: all(_settled(ctr, unit) for ctr in nodes), 240, "every node's catch-up run to end",
                 interval=1)
        wait_for(lambda: _history(nodes[0], consul_bin, "nightly").get(occurrence, {}).get("state") == "done", 60,
                 f"occurrence {occurrence} to be recorded done", interval=1)
    finally:
        dest = _keep_journals(request, nodes, unit, "consul*")
        (dest / "runs.txt").write_text("\n".join(" ".join(r) for r in runs()))
    assert [occ for occ, _ in runs()] == [occurrence], runs()  # exactly once, on one node
    journals = [(artifact_dir(request.node) / f"{ctr.name}.journal").read_text() for ctr in nodes]
    said = [line for text in journals for line in text.splitlines() if "retrying for up to" in line]
    if how == "unordered":  # its wrappers met an agent not listening yet
        assert said and all("connection refused); retrying for up to " in line and ", as the system booted " in line
                            for line in said), said
    else:  # ordered after an agent that says when it is ready: never refused
        assert not any("connection refused" in line for line in said), said
    for ctr in nodes:  # no node failed its catch-up (a 69 would have notified)
        result = ctr.systemctl("show", unit, "-p", "Result", check=False).stdout.strip()
        assert result == "Result=success", (ctr.name, result)


@pytest.mark.parametrize("cluster", ["packaged"], indirect=True)
def test_an_agent_sigkilled_and_restarted_by_systemd_takes_its_running_job_with_it(cluster, consul_bin: str,
                                                                                     request: pytest.FixtureRequest
                                                                                     ) -> None:
    """docs/guarantees.md, Fencing, *Killing the agent kills the job, even when systemd restarts it* (issue #31,
    item 7). The runner's agent (consul.service, Restart=on-failure) is SIGKILLed mid-job; systemd restarts it
    15 s later (a drop-in): after the other members have declared its node failed, which invalidates its
    session, and before the wrapper's own fencing deadline (24 s at lock-delay 30 s) would stop the job for want
    of answers. The restarted agent is a healthy node again, but the session is gone: the job is stopped as soon
    as the agent answers (exit 75), and under retry the other client runs the occurrence again, to its end, only
    after the first run's job was dead."""
    nodes, _ = cluster
    wait_for(lambda: _leader_sees_all(nodes[0], consul_bin), 120, "the three agents to form a cluster")
    clients = nodes[1:]  # node1 is the one server: killing its agent would be the cluster's outage, not a node's
    for ctr in clients:
        dropin = ctr.unit_dir / "consul.service.d"
        dropin.mkdir(parents=True, exist_ok=True)
        (dropin / "restart.conf").write_text("[Service]\nRestartSec=15s\n")
        ctr.systemctl("daemon-reload")
    due = (datetime.now(timezone.utc) + timedelta(seconds=45)).replace(microsecond=0)
    occurrence = due.strftime("%Y-%m-%dT%H:%M:%SZ")
    mark = f'echo "$CONSULRUN_OCCURRENCE {{what}} $(date +%s.%N)" >> /shared/runs'
    job = {"command": ["sh", "-c", f"trap '{mark.format(what='killed')}; exit 143' TERM; {mark.format(what='start')}; "
                                   f"sleep 40 & wait; {mark.format(what='end')}"],
           "schedule": due.strftime("*-*-* %H:%M:%S UTC"), "on_holder_loss": "retry",
           "lock": {"ttl": "10s", "lock_delay": "30s"}, "nodes": {"names": ["node2", "node3"]}}
    text = manifest({"steady": job})
    for ctr in clients:
        result = install(ctr, text)
        assert result.returncode == 0, result.stderr
    assert datetime.now(timezone.utc) < due - timedelta(seconds=5), "installing took too long for this test"
    unit = "consulrun-steady.service"

    def marks(ctr: Container) -> dict[str, float]:
        path = ctr.shared / "runs"
        found = [line.split() for line in path.read_text().splitlines()] if path.exists() else []
        return {f[1]: float(f[2]) for f in found if len(f) == 3 and f[0] == occurrence}

    try:
        holder = wait_for(lambda: next((c for c in clients if "start" in marks(c)), None), 90,
                          "a client to start the occurrence")
        other = next(c for c in clients if c is not holder)
        wait_for(lambda: "standing by" in journal(other, unit), 30, "the other client to stand by")
        time.sleep(3)
        holder.systemctl("kill", "-s", "KILL", "consul.service")
        wait_for(lambda: "end" in marks(other), 180, "the other client to run the occurrence to its end", interval=1)
    finally:
        _keep_journals(request, clients, unit, "consul.service")
    assert int(holder.systemctl("show", "-P", "NRestarts", "consul.service").stdout.strip()) >= 1  # systemd did
    assert holder.systemctl("show", "-P", "ExecMainStatus", unit).stdout.strip() == "75"
    said = journal(holder, unit)
    lost = [line for line in said.splitlines() if "lock lost: " in line]
    assert lost and "not confirmed" not in lost[0], said  # stopped by what the restarted agent said, not by silence
    first, second = marks(holder), marks(other)
    assert "killed" in first and "end" not in first, first
    assert second["start"] > first["killed"], (first, second)  # never two at once
    record = json.loads(other.exec(consul_bin, "kv", "get", "consulrun/steady/occurrence").stdout)
    assert (record["state"], record["exit_status"], record["attempt"], record["takeover"]) == ("done", 0, 2, True)
    assert record["earlier"][0]["node"] == f"node{nodes.index(holder) + 1}", record
