"""`nodes:`: a job runs only on the Consul nodes its node meta and name globs pick; the others skip without a
write, take no turn, get no units, and `status` says when no healthy node is left to run it."""

from __future__ import annotations

import json
import os
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests

from consulrun.manifest.placement import Placement
from consulrun.protocol import turns
from tests.harness.agents import Cluster, cluster_up, wait_for
from tests.harness.runs import consulrun, finish

pytestmark = [pytest.mark.consul, pytest.mark.cluster]

DAILY = "*-*-* 00:00:00"  # today's midnight is the occurrence: the same for every run of a test
META = {"node1": {"role": "db"}, "node2": {"role": "db", "zone": "b"}, "node3": {"role": "db"},
        "node4": {"role": "web"}}


@pytest.fixture(scope="module")
def cluster(consul_bin: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """node1 (server) and node2, node3, node4 (clients) with node meta, each in its own network namespace."""
    if os.geteuid() != 0:
        pytest.fail("the cluster needs root for network namespaces", pytrace=False)
    with cluster_up(consul_bin, tmp_path_factory.mktemp("placement"), "10.213.89.0/24", "p", clients=3,
                    node_meta=META) as started:
        # The leader registers a joining node without its meta; the node's own anti-entropy sync adds it.
        wait_for(lambda: all(node["Meta"].get("role") == META[node["Node"]]["role"]
                             for node in started.server.get("catalog/nodes")), 90, "every node's meta in the catalog")
        yield started


def run_on(cluster: Cluster, node: str, *args: str) -> tuple[int, str, str]:
    agent = cluster.by_name(node)
    return finish(consulrun("run", *args, netns=agent.netns, env={"CONSUL_HTTP_ADDR": agent.http_addr}))


def keys(cluster: Cluster, job: str) -> list[str]:
    found = requests.get(f"{cluster.server.url}/v1/kv/consulrun/{job}/", params={"keys": "true"}, timeout=10)
    return [] if found.status_code == 404 else found.json()


def sessions(cluster: Cluster) -> list[dict]:
    return cluster.server.get("session/list")


def test_a_node_the_job_does_not_run_on_skips_with_one_line_and_no_write(cluster: Cluster) -> None:
    before = sessions(cluster)
    code, _, err = run_on(cluster, "node4", "--skip-exit-code", "42", "--node-meta", "role=db", "--schedule", DAILY,
                          "dbonly", "--", "true")
    assert code == 42, err
    assert err.splitlines() == ["consulrun: dbonly: skipped: this node (node4) is not one the job runs on "
                                "(nodes: meta role=db)"], err
    assert keys(cluster, "dbonly") == [] and sessions(cluster) == before  # not a session, not a key
    code, _, err = run_on(cluster, "node2", "--node-meta", "role=db", "--node-meta", "zone=b", "--schedule", DAILY,
                          "dbonly", "--", "true")
    assert code == 0 and "acquired consulrun/dbonly/lock for occurrence" in err, err
    assert "take turns" not in err, err  # it sees itself among the nodes that may run the job


def test_names_are_globs_and_any_of_them_will_do(cluster: Cluster) -> None:
    code, _, err = run_on(cluster, "node2", "--node-name", "node[3-9]", "--node-name", "web-*", "globbed", "--",
                          "true")
    assert code == 0 and "skipped: this node (node2) is not one the job runs on (nodes: names node[3-9] or web-*)" \
        in err, err
    code, _, err = run_on(cluster, "node4", "--node-name", "node[3-9]", "--node-name", "web-*", "globbed", "--",
                          "true")
    assert code == 0 and "acquired consulrun/globbed/lock" in err, err


def test_the_turns_rank_only_the_nodes_the_job_runs_on(cluster: Cluster) -> None:
    """node4 (web) is alive but may not run it: it holds no turn, so the second db client is ranked 2 of 3."""
    from datetime import datetime, timezone

    from consulrun.protocol import occurrence

    occ = occurrence.current([DAILY], datetime.now(timezone.utc))
    assert occ is not None
    order = turns.order(f"consulrun/ranked\n{occ.id}", [("node1", True), ("node2", False), ("node3", False)])
    second = order[1]  # a client: a client's turns put the clients first
    code, _, err = run_on(cluster, second, "--node-meta", "role=db", "--schedule", DAILY, "ranked", "--", "true")
    assert code == 0, err
    assert f"occurrence {occ.id} is unclaimed and this node is ranked 2 of 3 for it" in err, err


def test_status_reports_a_job_no_healthy_node_may_run(cluster: Cluster, tmp_path: Path) -> None:
    manifest = tmp_path / "jobs.yaml"
    manifest.write_text(f"jobs:\n  nowhere: {{command: ['true'], schedule: '{DAILY}', nodes: {{meta: {{role: cache}}}}}}\n"
                        f"  somewhere: {{command: ['true'], schedule: '{DAILY}', nodes: {{names: [node4]}}}}\n")
    agent = cluster.server
    code, out, err = finish(consulrun("status", str(manifest), "--json", netns=agent.netns,
                                      env={"CONSUL_HTTP_ADDR": agent.http_addr}))
    jobs = {job["job"]: job for job in json.loads(out)["jobs"]}
    assert code == 3, (out, err)
    assert [p["kind"] for p in jobs["nowhere"]["problems"]] == ["unplaced"], jobs["nowhere"]
    assert "no healthy node is one it runs on (nodes: meta role=cache)" in jobs["nowhere"]["problems"][0]["detail"]
    assert "unplaced" not in [p["kind"] for p in jobs["somewhere"]["problems"]], jobs["somewhere"]


def test_install_puts_no_units_for_a_job_this_node_may_not_run(cluster: Cluster, tmp_path: Path) -> None:
    manifest = tmp_path / "placed.yaml"
    manifest.write_text(f"jobs:\n  here: {{command: ['true'], schedule: '{DAILY}', nodes: {{meta: {{role: db}}}}}}\n"
                        f"  there: {{command: ['true'], schedule: '{DAILY}', nodes: {{meta: {{role: web}}}}}}\n"
                        f"  anywhere: {{command: ['true'], schedule: '{DAILY}'}}\n")
    agent = cluster.by_name("node2")
    consulrun_path = shutil.which("consulrun", path=str(Path(sys.executable).parent)) or "/usr/bin/true"
    code, out, err = finish(consulrun("install", str(manifest), "--dry-run", "--unit-dir", str(tmp_path / "units"),
                                      "--consulrun-path", consulrun_path, netns=agent.netns,
                                      env={"CONSUL_HTTP_ADDR": agent.http_addr}))
    assert code == 0, err
    assert "not for this node (node2): there runs on nodes with meta role=web; its units are not installed here" \
        in out, out
    wrote = {line.split()[-1] for line in out.splitlines() if line.startswith("+++ ")}
    assert any("consulrun-here.service" in w for w in wrote) and any("consulrun-anywhere.timer" in w for w in wrote)
    assert not any("consulrun-there" in w for w in wrote), out


def test_placement_matches_every_meta_pair_and_any_name_glob() -> None:
    both = Placement(meta=(("role", "db"), ("zone", "b")), names=("node*",))
    assert both.matches("node2", {"role": "db", "zone": "b", "extra": "x"})
    assert not both.matches("node2", {"role": "db"})
    assert not both.matches("db1", {"role": "db", "zone": "b"})
    assert Placement(names=("a", "b?")).matches("b1", {}) and not Placement(names=("a",)).matches("A", {})
    assert both.describe() == "meta role=db, zone=b; names node*"
    assert both.argv() == ["--node-meta", "role=db", "--node-meta", "zone=b", "--node-name", "node*"]


def test_a_bad_node_meta_option_is_a_usage_error() -> None:
    for args, words in ((["--node-meta", "role"], "--node-meta: 'role' is not KEY=VALUE"),
                        (["--node-meta", "ro le=x"], "--node-meta: 'ro le=x' is not KEY=VALUE"),
                        (["--node-name", "a b"], "--node-name: 'a b' is not a node name glob")):
        code, _, err = finish(consulrun("run", *args, "j", "--", "true"))
        assert (code, err.strip()) == (2, f"Error: {words}" + err.strip().split(words, 1)[1]), err


def test_the_exporter_says_unplaced(cluster: Cluster, tmp_path: Path) -> None:
    manifest = tmp_path / "jobs.yaml"
    manifest.write_text(f"jobs:\n  nowhere2: {{command: ['true'], schedule: '{DAILY}', nodes: {{meta: {{role: cache}}}}}}\n")
    agent = cluster.server
    env = {"CONSUL_HTTP_ADDR": agent.http_addr}
    assert finish(consulrun("pause", str(manifest), "nowhere2", netns=agent.netns, env=env))[0] == 0  # some state
    code, out, err = finish(consulrun("exporter", str(manifest), "--textfile", "-", netns=agent.netns,
                                      env={"CONSUL_HTTP_ADDR": agent.http_addr}))
    assert code == 0, err
    assert 'consulrun_job_state{job_name="nowhere2",state="unplaced"} 1.0' in out, out
