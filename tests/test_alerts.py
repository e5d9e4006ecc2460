"""The alert rules: promtool's checks and unit tests, their runbooks, tunable thresholds, and the series they read.

deploy/prometheus/alerts_test.yaml holds the promtool unit tests (a firing and a quiet case per alert);
these tests run them, check that every alert has both, and that every expression finds series in what
kvcompose's and vLLM's real metric classes export.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvcompose.alerts import ALERTS, RUNBOOK_URL_BASE, SEVERITIES, number, rule_groups
from kvcompose.deploy import ALERTS_FILE, alerts_text

from .dashboard_support import COMMITTED_DASHBOARD, REPO, all_panels
from .test_dashboard_promql import SAMPLES, _real_exposition, expr_test, run_promtool

PROMETHEUS_DIR = REPO / "deploy" / "prometheus"
RULES = REPO / ALERTS_FILE
UNIT_TESTS = PROMETHEUS_DIR / "alerts_test.yaml"
RUNBOOKS = REPO / "docs" / "runbooks"
REGENERATE = "kvcompose generate  (or: python -m kvcompose.deploy generate)"
METRIC = re.compile(r"\b(kvcompose_\w+|vllm:\w+)")
WITHOUT_CONNECTOR = {"kvcompose_spans_dropped_total", "kvcompose_exporter_restarts_total",  # per engine, not per child
                     "kvcompose_router_predictions_total", "kvcompose_router_predicted_tokens_total",
                     "kvcompose_router_overpredicted_tokens_total"}
# In the real exposition (test_dashboard_promql._real_exposition) one state each: hot stuck, cold half-open.
CHILDREN_IN_STATE = {"KVComposeChildStuck": {"hot"}, "KVComposeChildCircuitOpen": {"cold"}}
RUNBOOK_SECTIONS = ["## Symptom", "## Impact", "## Diagnose", "## Mitigate", "## Escalate"]
PANEL_REFERENCE = re.compile(r"[Pp]anel\s+\*\*(.+?)\*\*")


def promtool() -> str:
    path = shutil.which("promtool")
    assert path, "promtool is missing: `make test` installs it (scripts/ensure-prometheus.sh, Debian's prometheus)"
    return path


def rules_by_alert() -> dict[str, dict[str, Any]]:
    """The committed rules, by alert name (one rule each: promtool's lint refuses two of one name and labels)."""
    rules = [rule for group in yaml.safe_load(RULES.read_text())["groups"] for rule in group["rules"]]
    assert [rule["alert"] for rule in rules] == [alert.name for alert in ALERTS]
    return {rule["alert"]: rule for rule in rules}


def metrics_read(expr: str) -> set[str]:
    return set(METRIC.findall(expr))


def kvcompose(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvcompose.deploy", *args], capture_output=True, text=True, timeout=60)


# --- the committed rule file -------------------------------------------------------------------

def test_committed_rule_file_is_what_the_generator_writes() -> None:
    assert RULES.read_text() == alerts_text(rule_groups()), f"{ALERTS_FILE} is stale: run `{REGENERATE}`"


def test_promtool_accepts_the_rules_and_their_unit_tests_pass() -> None:
    check = subprocess.run([promtool(), "check", "rules", str(RULES)], capture_output=True, text=True, timeout=60)
    assert check.returncode == 0, check.stdout + check.stderr
    assert f"SUCCESS: {len(rules_by_alert())} rules found" in check.stdout
    test = subprocess.run([promtool(), "test", "rules", str(UNIT_TESTS)], capture_output=True, text=True,
                          timeout=300, cwd=PROMETHEUS_DIR)
    assert test.returncode == 0, (test.stdout + test.stderr)[-6000:]


def test_every_alert_has_a_firing_case_and_a_quiet_case_on_its_own_series() -> None:
    cases: dict[str, dict[str, list[set[str]]]] = {}
    for group in yaml.safe_load(UNIT_TESTS.read_text())["tests"]:
        series = {METRIC.match(s["series"].strip("'")).group(1) for s in group["input_series"]}
        for case in group["alert_rule_test"]:
            outcome = "firing" if case["exp_alerts"] else "quiet"
            cases.setdefault(case["alertname"], {}).setdefault(outcome, []).append(series)
    for alert, rule in rules_by_alert().items():
        read = metrics_read(rule["expr"])
        assert set(cases.get(alert, {})) == {"firing", "quiet"}, f"{alert}: {sorted(cases.get(alert, {}))}"
        # A quiet case proves something only when the series the alert reads are there.
        assert any(read <= series for series in cases[alert]["quiet"]), f"{alert}: quiet without its series"


def test_every_alert_names_its_severity_numbers_and_runbook() -> None:
    dashboard_titles = {panel["title"] for panel in all_panels(json.loads(COMMITTED_DASHBOARD.read_text()))}
    for alert, rule in rules_by_alert().items():
        assert rule["labels"]["severity"] in SEVERITIES, alert
        annotations = rule["annotations"]
        assert set(annotations) == {"summary", "description", "runbook_url"}, alert
        assert annotations["runbook_url"] == f"{RUNBOOK_URL_BASE}/{alert}.md"
        assert "$value" in annotations["description"], alert
        # `by (...)` would drop the labels that say where to look: aggregations name what they fold.
        assert not re.search(r"\b(by|on|ignoring)\s*\(", rule["expr"]), f"{alert}: {rule['expr']}"
        if metrics_read(rule["expr"]) - WITHOUT_CONNECTOR:
            assert "$labels.connector" in annotations["summary"], alert
        runbook = (RUNBOOKS / f"{alert}.md").read_text()
        positions = [runbook.find(section) for section in RUNBOOK_SECTIONS]
        assert -1 not in positions and positions == sorted(positions), f"{alert}.md: sections {RUNBOOK_SECTIONS}"
        assert runbook.startswith(f"# {alert}\n"), alert
        panels = PANEL_REFERENCE.findall(runbook)
        assert panels and runbook.count("**") == 2 * len(panels), f"{alert}.md: bold text is for `panel **TITLE**`"
        for panel in panels:
            assert panel in dashboard_titles, f"{alert}.md names panel {panel!r}, not in dashboards/kvcompose.json"
        assert "Jaeger, service `kvcompose`" in runbook, f"{alert}.md names no Jaeger query"


def test_runbook_index_lists_every_alert_and_threshold_with_its_default() -> None:
    index = (RUNBOOKS / "README.md").read_text()
    alerts = re.findall(r"^\| \[(\w+)\]\((\w+)\.md\) \| (\w+) \| (\w+) \|", index, re.MULTILINE)
    assert alerts == [(a.name, a.name, a.severity, a.for_) for a in ALERTS]
    thresholds = re.findall(r"^\| `(\w+)\.(\w+)` \| `([^`]+)` \| (.+) \|$", index, re.MULTILINE)
    assert thresholds == [(a.name, p.name, number(p.default), p.help) for a in ALERTS for p in a.thresholds]
    assert {path.stem for path in RUNBOOKS.glob("KVCompose*.md")} == {alert.name for alert in ALERTS}


# --- thresholds --------------------------------------------------------------------------------

def test_a_changed_threshold_changes_what_fires(tmp_path: Path) -> None:
    """The transfer case of alerts_test.yaml, with the load threshold raised over hot's 0.995 s p99:
    only cold's slow saves still fire."""
    group = next(g for g in yaml.safe_load(UNIT_TESTS.read_text())["tests"]
                 if g["alert_rule_test"][0]["alertname"] == "KVComposeTransferSlow")
    firing = next(case for case in group["alert_rule_test"] if case["exp_alerts"])
    firing["exp_alerts"] = [alert for alert in firing["exp_alerts"] if alert["exp_labels"]["direction"] == "save"]
    assert len(firing["exp_alerts"]) == 1
    result = kvcompose("alerts", "--set", "KVComposeTransferSlow.load_p99_seconds=1.5",
                       "--output", str(tmp_path / "alerts.yaml"))
    assert result.returncode == 0, result.stderr
    rules = {rule["alert"]: rule for group in yaml.safe_load((tmp_path / "alerts.yaml").read_text())["groups"]
             for rule in group["rules"]}
    assert 'above {{ if eq $labels.direction "load" }}1.5{{ else }}2{{ end }} s' in \
        rules["KVComposeTransferSlow"]["annotations"]["description"]
    (tmp_path / "test.yaml").write_text(yaml.safe_dump({
        "rule_files": ["alerts.yaml"], "evaluation_interval": "1m", "tests": [group]}, sort_keys=False))
    test = subprocess.run([promtool(), "test", "rules", "test.yaml"], capture_output=True, text=True, timeout=120,
                          cwd=tmp_path)
    assert test.returncode == 0, (test.stdout + test.stderr)[-4000:]


def test_severity_for_and_runbook_base_are_settable() -> None:
    result = kvcompose("alerts", "--prometheus-rule", "--runbook-url-base", "https://wiki.example.com/kv/",
                       "--set", "KVComposeChildCircuitOpen.severity=warning", "--set", "KVComposeChildErrors.for=30m")
    assert result.returncode == 0, result.stderr
    document = yaml.safe_load(result.stdout)
    assert (document["apiVersion"], document["kind"]) == ("monitoring.coreos.com/v1", "PrometheusRule")
    rules = {rule["alert"]: rule for group in document["spec"]["groups"] for rule in group["rules"]}
    assert rules["KVComposeChildCircuitOpen"]["labels"] == {"severity": "warning"}
    assert rules["KVComposeChildErrors"]["for"] == "30m"
    assert "for 30m" in rules["KVComposeChildErrors"]["annotations"]["description"]
    assert rules["KVComposeSpansDropped"]["annotations"]["runbook_url"] == \
        "https://wiki.example.com/kv/KVComposeSpansDropped.md"


@pytest.mark.parametrize(("setting", "message"), [
    ("KVComposeTransferSlow.load_p99_seconds=fast",
     "--set KVComposeTransferSlow.load_p99_seconds: expected a number >= 0 (got 'fast')"),
    ("KVComposeTransferSlow.load_p99_seconds=-1",
     "--set KVComposeTransferSlow.load_p99_seconds: expected a number >= 0 (got '-1')"),
    ("KVComposeChildErrors.for=10 minutes",
     "--set KVComposeChildErrors.for: expected a Prometheus duration such as 30s, 5m or 1h (got '10 minutes')"),
    ("KVComposeChildErrors.severity=page",
     "--set KVComposeChildErrors.severity: expected one of critical, warning, info (got 'page')"),
    ("KVComposeChildErrors.ratio=0.1",
     "--set KVComposeChildErrors.ratio: unknown parameter of KVComposeChildErrors; "
     "expected one of error_ratio, for, severity"),
    ("KVComposeChildError.error_ratio=0.1", "--set KVComposeChildError.error_ratio: unknown alert; expected one of "),
    ("KVComposeChildErrors.error_ratio", "--set KVComposeChildErrors.error_ratio: expected ALERT.PARAMETER=VALUE"),
])
def test_a_bad_setting_exits_2_with_one_line_naming_it(setting: str, message: str) -> None:
    result = kvcompose("alerts", "--set", setting)
    assert (result.returncode, result.stdout) == (2, "")
    assert result.stderr.count("\n") == 1 and result.stderr.startswith(message), result.stderr


# --- the series the rules read -----------------------------------------------------------------

def test_every_rule_finds_series_in_what_the_real_metric_classes_export(
        vllm_config_with: Callable, tmp_path: Path) -> None:
    """With thresholds out of the way (every one 0, the hit-ratio drop factor huge), each rule must find the
    series of kvcompose's and vLLM's metric classes, fed one of every stat, and keep their `connector`:
    catches renamed metrics, lost labels and misspelt label values."""
    families = _real_exposition(vllm_config_with)
    exported = {sample.name for family in families for sample in family.samples}
    children_of: dict[str, set[str]] = {}
    series = []
    for family in families:
        grows = family.type in ("counter", "histogram")
        for sample in family.samples:
            if sample.name.endswith("_created"):
                continue
            children_of.setdefault(sample.name, set()).add(sample.labels.get("connector", ""))
            labels = ", ".join(f'{key}="{value}"' for key, value in sorted(sample.labels.items()))
            values = f"0+{sample.value}x{SAMPLES}" if grows else f"{sample.value}x{SAMPLES}"
            series.append((f"{sample.name}{{{labels}}}", values))

    open_thresholds = {f"{alert.name}.{p.name}": "1e9" if p.name == "drop_factor" else "0"
                       for alert in ALERTS for p in alert.thresholds}
    cases = []
    for rule in (rule for group in rule_groups(open_thresholds) for rule in group["rules"]):
        read = metrics_read(rule["expr"])
        missing = read - exported
        assert not missing, f"{rule['alert']} reads {sorted(missing)}, which nothing exports"
        children = CHILDREN_IN_STATE.get(rule["alert"]) or set.intersection(*(children_of[name] for name in read))
        cases.append(expr_test(f"group by (connector) ({rule['expr']})",
                               [({"connector": child} if child else {}, 1) for child in sorted(children)]))
    assert len(cases) >= 5
    run_promtool(series, cases, tmp_path)
