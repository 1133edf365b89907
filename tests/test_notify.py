"""Healthchecks.io-style pings from `consulrun run --ping-url`, against a real HTTP server on loopback."""

from __future__ import annotations

import base64
import json
import socket
from pathlib import Path

import pytest

from consulrun.protocol.notify import ping_url_problem, result_suffix
from tests.harness.agents import Agent, wait_for
from tests.harness.runs import SKIP, consulrun, finish


def last_session(consul: Agent, job: str) -> str:
    """The session of the job's last run, as its lock's value records it: the run id its pings carry."""
    return json.loads(base64.b64decode(consul.get(f"kv/consulrun/{job}/lock")[0]["Value"]))["last"]["session"]


def test_runner_pings_start_then_success(consul: Agent, monitor: tuple[str, list[str]]) -> None:
    url, paths = monitor
    code, _, err = finish(consulrun("run", "--ping-url", url, "pinged", "--", "true"))
    assert code == 0, err
    # Healthchecks.io pairs a start with its end by the run id: both carry the run's session id.
    rid = last_session(consul, "pinged")
    assert paths == [f"/ping/c0ffee/start?rid={rid}", f"/ping/c0ffee?rid={rid}"]


def test_failing_job_pings_its_exit_status(consul: Agent, monitor: tuple[str, list[str]]) -> None:
    url, paths = monitor
    code, _, err = finish(consulrun("run", "--ping-url", url + "/", "failing", "--", "sh", "-c", "exit 3"))
    assert code == 3, err
    rid = last_session(consul, "failing")
    assert paths == [f"/ping/c0ffee/start?rid={rid}", f"/ping/c0ffee/3?rid={rid}"]


def test_lost_run_pings_fail(consul: Agent, monitor: tuple[str, list[str]], tmp_path: Path) -> None:
    url, paths = monitor
    started = tmp_path / "started"
    holder = consulrun("run", "--ping-url", url, "ping-fenced", "--", "sh", "-c", f"touch {started}; exec sleep 300")
    wait_for(started.exists, 20, "the job to start")
    session = consul.get("kv/consulrun/ping-fenced/lock")[0]["Session"]
    consul.api("PUT", f"session/destroy/{session}")
    code, _, err = finish(holder, timeout=30)
    assert code == 75, err
    assert paths == [f"/ping/c0ffee/start?rid={session}", f"/ping/c0ffee/fail?rid={session}"]


def test_skipping_node_pings_nothing(consul: Agent, monitor: tuple[str, list[str]], tmp_path: Path) -> None:
    url, paths = monitor
    started, release = tmp_path / "started", tmp_path / "release"
    holder = consulrun("run", "busy", "--", "sh", "-c", f"touch {started}; while [ ! -e {release} ]; do sleep 0.05; done")
    try:
        wait_for(started.exists, 20, "the holder's job to start")
        code, _, err = finish(consulrun("run", "--skip-exit-code", str(SKIP), "--ping-url", url, "busy", "--", "true"))
        assert code == SKIP, err
        assert "skipped:" in err
    finally:
        release.touch()
        finish(holder)
    assert paths == []


def test_unanswering_monitor_neither_fails_nor_holds_the_job(consul: Agent, tmp_path: Path) -> None:
    """A monitor that accepts connections and never answers: the job runs and its status passes through."""
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)  # never accepted: every request times out
        ran = tmp_path / "ran"
        code, _, err = finish(consulrun("run", "--ping-url", f"http://127.0.0.1:{silent.getsockname()[1]}/x", "slowmon",
                                        "--", "sh", "-c", f"touch {ran}; exit 4"), timeout=60)
    assert code == 4, err
    assert ran.exists()
    assert "ping http://127.0.0.1:" in err and "failed" in err
    assert "/x" not in err  # the check's path (its secret) is not logged


@pytest.mark.parametrize("outcome, suffix", [({"exit_status": 0}, ""), ({"exit_status": 2}, "/2"),
                                              ({"exit_status": 75, "lost": "fenced"}, "/fail"),
                                              ({"lost": "SIGTERM before the job started"}, "/fail"), ({}, "/fail")])
def test_result_suffix(outcome: dict, suffix: str) -> None:
    assert result_suffix(outcome) == suffix


@pytest.mark.parametrize("url, ok", [("https://hc-ping.com/0f2b6e3c-1d2a-4c8e-9b7e-2f1d0a9c8b7e", True),
                                     ("http://[::1]:8000/ping/x", True), ("http://mon.example", True),
                                     ("ftp://x/y", False), ("https://x/y?z=1", False), ("https://x/a b", False),
                                     ("hc-ping.com/uuid", False), ("https://x/" + "a" * 2100, False)])
def test_ping_url_rule(url: str, ok: bool) -> None:
    assert (ping_url_problem(url) is None) is ok


def test_output_lines_need_a_ping_url() -> None:
    code, _, err = finish(consulrun("run", "--ping-output-lines", "5", "nourl", "--", "true"))
    assert code == 2 and "--ping-output-lines sends the output with the final ping: it needs --ping-url" in err, err


def test_with_output_lines_the_final_ping_is_a_post_and_outside_a_unit_it_carries_nothing(
        consul: Agent, monitor: tuple[str, list[str]], monkeypatch: pytest.MonkeyPatch) -> None:
    """The body is the run's journal, found by systemd's INVOCATION_ID: a hand run has none to send (the booted
    test in test_onfailure.py reads a real journal)."""
    url, paths = monitor
    monkeypatch.delenv("INVOCATION_ID", raising=False)
    code, _, err = finish(consulrun("run", "--ping-url", url, "--ping-output-lines", "5", "posted", "--",
                                    "sh", "-c", "echo hi; exit 2"))
    assert code == 2, err
    rid = last_session(consul, "posted")
    assert paths.requests == [  # type: ignore[attr-defined]
        ("GET", f"/ping/c0ffee/start?rid={rid}", b""), ("POST", f"/ping/c0ffee/2?rid={rid}", b"")]
