"""The Prometheus rules the package ships: valid, every alert tested by promtool, a runbook paragraph each,
and built only on metrics that something really exposes."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import yaml

from tests.conftest import require_tool

REPO = Path(__file__).resolve().parents[1]
RULES = REPO / "docs" / "prometheus" / "consulrun-rules.yml"
CASES = RULES.with_name("consulrun-rules.test.yml")
RUNBOOK = REPO / "docs" / "alerts.md"
METRICS = REPO / "consulrun" / "report" / "metrics.py"
# Series the rules take from node_exporter's systemd collector (--collector.systemd), not from consulrun.
NODE_EXPORTER = {"node_systemd_timer_last_trigger_seconds", "node_systemd_unit_state"}


def rules() -> list[dict]:
    return [rule for group in yaml.safe_load(RULES.read_text())["groups"] for rule in group["rules"]]


def test_promtool_checks_the_rules_and_passes_their_tests() -> None:
    promtool = require_tool("promtool")
    check = subprocess.run([promtool, "check", "rules", str(RULES)], capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr
    result = subprocess.run([promtool, "test", "rules", CASES.name], cwd=CASES.parent, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


def test_every_alert_has_a_firing_test_case_and_every_recording_rule_a_query() -> None:
    cases = yaml.safe_load(CASES.read_text())["tests"]
    fired = {t["alertname"] for case in cases for t in case.get("alert_rule_test", []) if t["exp_alerts"]}
    quiet = {t["alertname"] for case in cases for t in case.get("alert_rule_test", []) if not t["exp_alerts"]}
    queried = " ".join(t["expr"] for case in cases for t in case.get("promql_expr_test", []))
    alerts = {r["alert"] for r in rules() if "alert" in r}
    assert alerts - fired == set(), "alerts no test sees firing"
    assert alerts - quiet == set(), "alerts no test sees quiet"
    assert [r["record"] for r in rules() if "record" in r and r["record"] not in queried] == []


def test_names_follow_the_mixin_conventions_and_each_alert_has_its_runbook_paragraph() -> None:
    headings = re.findall(r"^## (\S+)$", RUNBOOK.read_text(), re.M)
    for rule in rules():
        if "record" in rule:
            assert re.fullmatch(r"consulrun:[a-z_]+:[a-z0-9_]+", rule["record"]), rule["record"]
            continue
        name = rule["alert"]
        assert re.fullmatch(r"Consulrun(Job|Exporter|Watchdog)[A-Z][A-Za-z]+", name), name
        assert rule["labels"]["severity"] in ("warning", "critical"), name
        assert set(rule["annotations"]) == {"summary", "description", "runbook_url"}, name
        assert rule["annotations"]["runbook_url"] == f"docs/alerts.md#{name.lower()}", name
        assert name in headings, f"docs/alerts.md has no '## {name}' paragraph"


def test_rules_use_only_metrics_the_exporter_or_node_exporter_serves() -> None:
    served = set(re.findall(r'"(consulrun_[a-z_]+)"', METRICS.read_text()))
    served |= {name + "_total" for name in ("consulrun_job_runs",)}  # prometheus_client adds _total to counters
    used = set()
    for rule in rules():
        used |= set(re.findall(r"\b([a-z_]+(?:_[a-z]+)+)\s*(?:\{|\)|\s|$)", rule["expr"]))
    metric_names = {n for n in used if n.startswith(("consulrun_", "node_"))}
    assert metric_names, "no metric names found in the rules"
    assert metric_names - served - NODE_EXPORTER == set(), "rules on metrics nothing exposes"
