"""`consulrun exporter`: metrics from a real Consul agent, checked by promtool and scraped by a real Prometheus."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests

from tests.conftest import artifact_dir, require_tool
from tests.harness.agents import Agent, free_port, wait_for
from tests.harness.metrics import samples
from tests.harness.runs import consulrun, finish

pytestmark = pytest.mark.consul


def export(*args: str, env: dict[str, str] | None = None) -> tuple[int, str, str]:
    return finish(consulrun("exporter", *args, env=env))


def promtool_check(text: str) -> None:
    result = subprocess.run([require_tool("promtool"), "check", "metrics"], input=text, capture_output=True, text=True)
    assert (result.returncode, result.stdout, result.stderr) == (0, "", ""), result


@pytest.fixture
def runs(consul: Agent) -> None:
    """Two scheduled runs of `nightly` (a success, then a failure) and a manual success of `adhoc`."""
    for code in (0, 3):
        second = int(time.time())
        wait_for(lambda: int(time.time()) > second, 5, "a new occurrence of the every-second schedule", 0.02)
        got, _, err = finish(consulrun("run", "--schedule", "*:*:*", "nightly", "--", "sh", "-c", f"exit {code}"))
        assert got == code, err
    got, _, err = finish(consulrun("run", "adhoc", "--", "true"))
    assert got == 0, err


def test_textfile_metrics_pass_promtool_and_say_what_happened(runs: None, tmp_path: Path) -> None:
    out = tmp_path / "textfile" / "consulrun.prom"
    out.parent.mkdir()
    code, stdout, err = export("--textfile", str(out))
    assert (code, stdout) == (0, ""), err
    text = out.read_text()
    assert [p.name for p in out.parent.iterdir()] == ["consulrun.prom"]  # no temporary file left behind
    promtool_check(text)
    got = samples(text)
    assert got[("consulrun_exporter_consul_up", ())] == 1
    assert got[("consulrun_job_runs_total", (("job_name", "nightly"), ("outcome", "success")))] == 1
    assert got[("consulrun_job_runs_total", (("job_name", "nightly"), ("outcome", "failed")))] == 1
    assert got[("consulrun_job_runs_total", (("job_name", "adhoc"), ("outcome", "success")))] == 1
    assert got[("consulrun_job_last_exit_status", (("job_name", "nightly"),))] == 3
    assert got[("consulrun_job_last_exit_status", (("job_name", "adhoc"),))] == 0
    assert got[("consulrun_job_state", (("job_name", "nightly"), ("state", "failed")))] == 1
    assert got[("consulrun_job_state", (("job_name", "nightly"), ("state", "held")))] == 0
    assert got[("consulrun_job_health", (("job_name", "nightly"),))] == 1
    assert got[("consulrun_job_last_success_timestamp_seconds", (("job_name", "nightly"),))] <= \
        got[("consulrun_job_last_start_timestamp_seconds", (("job_name", "nightly"),))]
    assert got[("consulrun_job_last_duration_seconds", (("job_name", "adhoc"),))] >= 0
    # Both scheduled runs started within a few seconds of their occurrence; the manual run has no occurrence.
    assert got[("consulrun_job_schedule_lag_seconds_count", (("job_name", "nightly"),))] == 2
    assert got[("consulrun_job_schedule_lag_seconds_bucket", (("job_name", "nightly"), ("le", "+Inf")))] == 2
    assert ("consulrun_job_schedule_lag_seconds_count", (("job_name", "adhoc"),)) not in got


def test_held_job_is_held(consul: Agent, tmp_path: Path) -> None:
    started = tmp_path / "started"
    holder = consulrun("run", "long", "--", "sh", "-c", f"touch {started}; exec sleep 300")
    try:
        wait_for(started.exists, 20, "the job to start")
        code, text, err = export("--textfile", "-")
        assert code == 0, err
        promtool_check(text)
        got = samples(text)
        assert got[("consulrun_job_state", (("job_name", "long"), ("state", "held")))] == 1
        assert ("consulrun_job_last_end_timestamp_seconds", (("job_name", "long"),)) not in got
    finally:
        holder.terminate()
        finish(holder)


def test_a_paused_job_says_since_when(consul: Agent) -> None:
    """The gauge the ConsulrunJobPausedTooLong alert reads: the pause's start, only while a pause is in force."""
    assert finish(consulrun("run", "paused", "--", "true"))[0] == 0
    before = time.time()
    code, _, err = finish(consulrun("pause", "paused", "--reason", "maintenance"))
    assert code == 0, err
    code, text, err = export("--textfile", "-")
    assert code == 0, err
    promtool_check(text)
    since = samples(text).get(("consulrun_job_paused_since_timestamp_seconds", (("job_name", "paused"),)))
    assert since is not None and before - 2 <= since <= time.time(), text
    assert finish(consulrun("resume", "paused"))[0] == 0
    code, text, err = export("--textfile", "-")
    assert code == 0 and "consulrun_job_paused_since_timestamp_seconds{" not in text, text


def test_manifest_schedule_makes_missed_runs_a_state(consul: Agent, tmp_path: Path) -> None:
    """With the manifest, the exporter judges as `status` does: an every-second job that ran once is soon missed."""
    manifest = tmp_path / "jobs.yaml"
    manifest.write_text("jobs:\n  tick: {command: 'true', schedule: '*:*:*', timer: {accuracy: 1s}}\n")
    code, _, err = finish(consulrun("run", "--schedule", "*:*:*", "tick", "--", "true"))
    assert code == 0, err

    def missed() -> bool:
        code, text, err = export(str(manifest), "--grace", "0s", "--textfile", "-")
        assert code == 0, err
        return samples(text)[("consulrun_job_state", (("job_name", "tick"), ("state", "missed")))] == 1

    wait_for(missed, 20, "the exporter to report the next occurrences missed")


def test_consul_unreachable_withdraws_job_metrics_and_fails(tmp_path: Path) -> None:
    out = tmp_path / "consulrun.prom"
    code, _, err = export("--textfile", str(out), env={"CONSUL_HTTP_ADDR": "127.0.0.1:9"})
    assert code == 69
    assert err.count("\n") == 1 and "not reachable" in err
    text = out.read_text()
    promtool_check(text)
    got = samples(text)
    assert got[("consulrun_exporter_consul_up", ())] == 0
    assert not [name for name, _ in got if name.startswith("consulrun_job_")]


def test_bad_listen_address_is_a_usage_error(consul: Agent) -> None:
    code, _, err = export("--listen", "localhost")
    assert code == 2
    assert err.startswith("Error: --listen:") and err.count("\n") == 1


def test_busy_listen_address_is_one_line(consul: Agent) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        code, _, err = export("--listen", f"127.0.0.1:{taken.getsockname()[1]}")
    assert code == 74
    assert err.startswith("Error: --listen: cannot listen on 127.0.0.1:") and err.count("\n") == 1


@pytest.fixture
def exporter(consul: Agent) -> Iterator[str]:
    """A long-running exporter on a loopback port; yields its address."""
    address = f"127.0.0.1:{free_port()}"
    proc = consulrun("exporter", "--listen", address)
    try:
        wait_for(lambda: requests.get(f"http://{address}/metrics", timeout=2).ok, 30, "the exporter to serve")
        yield address
    finally:
        proc.terminate()
        proc.communicate(timeout=20)


def test_exporter_follows_consul_with_blocking_queries(exporter: str) -> None:
    def nightly_runs() -> float:
        got = samples(requests.get(f"http://{exporter}/metrics", timeout=5).text)
        return got.get(("consulrun_job_runs_total", (("job_name", "follow"), ("outcome", "success"))), 0.0)

    for n in (1, 2):
        code, _, err = finish(consulrun("run", "follow", "--", "true"))
        assert code == 0, err
        # A blocking query returns on the change: no waiting for the 15 s refresh.
        wait_for(lambda: nightly_runs() == n, 10, f"the exporter to count run {n}")


def test_real_prometheus_scrapes_the_exporter(runs: None, exporter: str, tmp_path: Path,
                                              request: pytest.FixtureRequest) -> None:
    prometheus = require_tool("prometheus")
    port = free_port()
    config = tmp_path / "prometheus.yml"
    config.write_text("global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
                      "scrape_configs:\n"
                      f"  - job_name: consulrun\n    static_configs: [{{targets: ['{exporter}']}}]\n")
    log = tmp_path / "prometheus.log"
    with log.open("wb") as out:
        proc = subprocess.Popen([prometheus, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                                 f"--web.listen-address=127.0.0.1:{port}"], stdout=out, stderr=subprocess.STDOUT)
    try:
        def failed_runs() -> list:
            answer = requests.get(f"http://127.0.0.1:{port}/api/v1/query", timeout=5, params={
                "query": 'consulrun_job_runs_total{job_name="nightly",outcome="failed"}'}).json()
            return answer["data"]["result"]

        result = wait_for(failed_runs, 60, "Prometheus to scrape the exporter")
        assert result[0]["value"][1] == "1"
        assert result[0]["metric"]["instance"] == exporter
        assert result[0]["metric"]["job"] == "consulrun"  # the scrape job's label, untouched by ours
        up = requests.get(f"http://127.0.0.1:{port}/api/v1/query", timeout=5,
                          params={"query": "consulrun_exporter_consul_up"}).json()["data"]["result"]
        assert up[0]["value"][1] == "1"
    except BaseException:
        dest = artifact_dir(request.node)
        dest.mkdir(parents=True, exist_ok=True)
        dest.joinpath("prometheus.log").write_bytes(log.read_bytes())
        try:
            targets = requests.get(f"http://127.0.0.1:{port}/api/v1/targets", timeout=5).text
        except requests.RequestException as exc:
            targets = str(exc)
        dest.joinpath("targets.json").write_text(targets)
        raise
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_help_lists_exporter() -> None:
    result = subprocess.run([sys.executable, "-m", "consulrun", "--help"], capture_output=True, text=True)
    assert "exporter" in result.stdout


@pytest.mark.systemd
def test_example_exporter_unit_passes_systemd_analyze_verify(tmp_path: Path) -> None:
    unit = (Path(__file__).resolve().parents[1] / "examples" / "consulrun-exporter.service").read_text()
    assert "ExecStart=/usr/local/bin/consulrun exporter " in unit
    (tmp_path / "consulrun-exporter.service").write_text(unit.replace("/usr/local/bin/consulrun", sys.executable))
    result = subprocess.run([require_tool("systemd-analyze"), "verify", "--man=no", "consulrun-exporter.service"],
                            capture_output=True, text=True, cwd=tmp_path)
    assert (result.returncode, result.stderr) == (0, "")
