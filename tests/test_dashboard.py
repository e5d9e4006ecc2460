"""The Grafana dashboard: lint rules, freshness of the committed files, the CLI, the compose example."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvcompose.dashboard import dashboard_json, provisioning_files
from kvcompose.dashboard.provisioning import DASHBOARDS_PATH, SCRAPE_INTERVAL
from kvcompose.dashboard.queries import ENGINE_MATCHERS, ENGINE_SERIES, GPU_MATCHER, VARIABLE_MATCHERS

from .dashboard_support import (
    COMMITTED_DASHBOARD, EXAMPLE_PIPELINE, REPO, all_panels, dashboards, targets,
)

PROVISIONING = REPO / "dashboards" / "provisioning"
OBSERVABILITY = REPO / "examples" / "observability"
REGENERATE = "kvcompose dashboard --output dashboards/kvcompose.json --provisioning dashboards/provisioning"
DATASOURCE_REF = {"type": "prometheus", "uid": "${datasource}"}
VARIABLES = ["datasource", "model_name", "engine", "connector", "op"]
# Grafana unit ids the dashboard may use; "count:<unit>" is Grafana's custom counted unit.
GRAFANA_UNITS = {"none", "short", "percentunit", "s", "ops", "Bps", "bytes"}
CUSTOM_UNIT = re.compile(r"^count:\S+$")
GRAFANA_BUILTINS = {"__rate_interval", "__all"}

DASHBOARDS = dashboards()


@pytest.fixture(params=sorted(DASHBOARDS))
def dashboard(request: pytest.FixtureRequest) -> dict[str, Any]:
    return DASHBOARDS[request.param]


def kvcompose(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvcompose", *args], capture_output=True, text=True, timeout=60)


# --- freshness ---------------------------------------------------------------------------------

def test_committed_dashboard_is_what_the_generator_writes() -> None:
    assert COMMITTED_DASHBOARD.read_text() == dashboard_json(), \
        f"dashboards/kvcompose.json is stale: run `{REGENERATE}`"


def test_committed_provisioning_is_what_the_generator_writes() -> None:
    written = {str(path.relative_to(PROVISIONING)): path.read_text() for path in PROVISIONING.rglob("*.yaml")}
    assert written == provisioning_files(), f"dashboards/provisioning is stale: run `{REGENERATE}`"


# --- lint rules --------------------------------------------------------------------------------

def test_schema_version_is_pinned(dashboard: dict[str, Any]) -> None:
    assert dashboard["schemaVersion"] == 39


def test_every_panel_has_a_known_unit(dashboard: dict[str, Any]) -> None:
    for panel in all_panels(dashboard):
        if panel["type"] == "row":
            continue
        unit = panel["fieldConfig"]["defaults"].get("unit")
        assert unit in GRAFANA_UNITS or (unit and CUSTOM_UNIT.match(unit)), f"{panel['title']!r}: unit {unit!r}"


def test_panel_ids_are_unique(dashboard: dict[str, Any]) -> None:
    ids = [panel["id"] for panel in all_panels(dashboard)]
    assert len(ids) == len(set(ids)) and all(isinstance(i, int) and i > 0 for i in ids), ids


def test_every_target_has_an_explicit_unique_ref_id(dashboard: dict[str, Any]) -> None:
    for panel in all_panels(dashboard):
        if panel["type"] == "row":
            assert "targets" not in panel
            continue
        ref_ids = [target["refId"] for target in panel["targets"]]
        assert ref_ids and all(ref_ids) and len(ref_ids) == len(set(ref_ids)), panel["title"]


def test_no_hard_coded_datasource(dashboard: dict[str, Any]) -> None:
    references = list(_datasource_references(dashboard))
    assert references, "no datasource references found"
    for where, reference in references:
        assert reference == DATASOURCE_REF, where
    for panel in all_panels(dashboard):
        if panel["type"] != "row":
            assert panel["datasource"] == DATASOURCE_REF and all(
                t["datasource"] == DATASOURCE_REF for t in panel["targets"]), panel["title"]


def test_rates_use_the_rate_interval(dashboard: dict[str, Any]) -> None:
    rates = 0
    for target in targets(dashboard):
        ranges = re.findall(r"\[([^\]]*)\]", target.expr)
        assert all(r == "$__rate_interval" for r in ranges), target.where
        assert len(ranges) == target.expr.count("rate("), target.where  # every range feeds a rate()
        rates += len(ranges)
    assert rates > 10


def test_every_selector_filters_on_the_template_variables(dashboard: dict[str, Any]) -> None:
    """Every series is narrowed to the selected models and engines; a child's series to the selected children
    too. The engine's own series carry no child, and the GPU cache's capacity stays whatever children are
    selected (the curve's first mark)."""
    for target in targets(dashboard):
        selectors = re.findall(r"([\w:]+)\{([^{}]*)\}", target.expr)
        assert selectors, target.where
        for metric, matchers in selectors:
            per_child = metric not in ENGINE_SERIES and GPU_MATCHER not in matchers
            wanted = VARIABLE_MATCHERS if per_child else ENGINE_MATCHERS
            assert all(m in matchers for m in wanted), f"{target.where}: {metric}{{{matchers}}}"
            assert per_child or "$connector" not in matchers, f"{target.where}: {metric}{{{matchers}}}"


def test_template_variables(dashboard: dict[str, Any]) -> None:
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert list(variables) == VARIABLES
    assert (variables["datasource"]["type"], variables["datasource"]["query"]) == ("datasource", "prometheus")
    for name in VARIABLES[1:]:
        variable = variables[name]
        assert variable["type"] == "query" and variable["multi"] and variable["includeAll"], name
        assert variable["allValue"] == ".*", name
        assert variable["query"]["query"] == variable["definition"]
        assert variable["definition"].startswith("label_values(") and variable["definition"].endswith(f", {name})")


def test_every_variable_used_is_defined(dashboard: dict[str, Any]) -> None:
    used = set(re.findall(r"\$\{?(\w+)", json.dumps(dashboard)))
    assert used - GRAFANA_BUILTINS == set(VARIABLES)


def test_panels_fit_the_grid_without_overlapping(dashboard: dict[str, Any]) -> None:
    for view in _views(dashboard):
        boxes = [(p["title"], p["gridPos"]) for p in view]
        for title, box in boxes:
            assert box["x"] >= 0 and box["x"] + box["w"] <= 24 and box["h"] > 0, title
        for i, (title_a, a) in enumerate(boxes):
            for title_b, b in boxes[i + 1:]:
                apart = (a["x"] + a["w"] <= b["x"] or b["x"] + b["w"] <= a["x"]
                         or a["y"] + a["h"] <= b["y"] or b["y"] + b["h"] <= a["y"])
                assert apart, f"{title_a!r} overlaps {title_b!r}"


def test_the_issue_panels_are_present() -> None:
    exprs = " ".join(t.expr for t in targets(DASHBOARDS["committed"]))
    for needle in ("kvcompose_pipeline_info", 'kvcompose_lookups_total{model_name=~"$model_name", engine=~"$engine", '
                   'connector=~"$connector", result="hit"}', "kvcompose_loaded_tokens_total",
                   "histogram_quantile(0.5, sum by (le, connector, op) (rate(kvcompose_call_duration_seconds_bucket",
                   "histogram_quantile(0.9,", "histogram_quantile(0.99,", "kvcompose_call_duration_seconds_count",
                   "kvcompose_call_errors_total", "kvcompose_load_error_blocks_total", "kvcompose_child_state",
                   "vllm:kv_offload_load_bytes_total", "vllm:nixl_xfer_time_seconds_bucket",
                   "histogram_quantile(0.5, sum by (le, connector, direction) "
                   "(rate(kvcompose_transfer_lifetime_seconds_bucket", "kvcompose_transfer_bytes_total",
                   "kvcompose_transfers_in_flight", "kvcompose_transfers_failed_total",
                   # this round: the three transfer times, tier economics, live health, vLLM's own hit counts
                   "histogram_quantile(0.99, sum by (le, connector, direction) "
                   "(rate(kvcompose_transfer_copy_seconds_bucket", "kvcompose_transfer_copy_seconds_sum",
                   "kvcompose_engine_wait_seconds_total", "kvcompose_cache_size_hit_ratio",
                   "kvcompose_tier_capacity_blocks", "kvcompose_kv_block_bytes", "kvcompose_prefill_seconds_saved_total",
                   "kvcompose_prefill_seconds_per_token", "kvcompose_write_waste_ratio", "kvcompose_tokens_forgone_total",
                   "kvcompose_calls_in_progress_seconds", "kvcompose_spans_dropped_total", "kvcompose_spans_queued",
                   "kvcompose_exporter_restarts_total", "vllm:external_prefix_cache_hits_total",
                   "vllm:external_prefix_cache_queries_total"):
        assert needle in exprs, needle


def test_transfer_latency_targets_ask_for_exemplars(dashboard: dict[str, Any]) -> None:
    for panel in all_panels(dashboard):
        for target in panel.get("targets", []):
            reads_transfer_buckets = "kvcompose_transfer_lifetime_seconds_bucket" in target["expr"]
            assert target.get("exemplar", False) is reads_transfer_buckets, panel["title"]


def test_xy_charts_plot_a_label_of_every_query_against_its_value_column(dashboard: dict[str, Any]) -> None:
    """An XY chart reads instant tables, one frame per query: x is a label each query keeps (`by (...)`),
    turned into a number; y is the value column Grafana's Prometheus datasource names for that query."""
    charts = [panel for panel in all_panels(dashboard) if panel["type"] == "xychart"]
    assert [panel["title"] for panel in charts] == ["Hit ratio by cache size"]
    for panel in charts:
        (convert, order) = panel["transformations"]
        (conversion,) = convert["options"]["conversions"]
        x = conversion["targetField"]
        assert conversion["destinationType"] == "number" and order["options"]["sort"] == [{"field": x}]
        ref_ids = [target["refId"] for target in panel["targets"]]
        values = [f"Value #{ref_id}" for ref_id in ref_ids] if len(ref_ids) > 1 else ["Value"]
        series = panel["options"]["series"]
        assert panel["options"]["seriesMapping"] == "manual"
        assert [(s["frame"], s["x"], s["y"]) for s in series] == [(i, x, v) for i, v in enumerate(values)]
        for target in panel["targets"]:
            assert (target["format"], target["instant"]) == ("table", True), panel["title"]
            assert re.match(rf"^\w+ by \([^)]*\b{x}\b[^)]*\) \(", target["expr"]), target["expr"]


# --- pipeline layout ---------------------------------------------------------------------------

def test_pipeline_layout_has_one_row_per_child_scoped_to_it() -> None:
    dashboard = DASHBOARDS["native-pipeline"]
    rows = [panel for panel in dashboard["panels"] if panel["type"] == "row"]
    assert [row["title"] for row in rows] == [
        "Pipeline native", "Live health", "hot (OffloadingConnector)", "cold (NixlConnector)", "Tier economics",
        "Routing",
        "Tenants"]
    for row in rows[2:4]:
        titles = [panel["title"] for panel in _row_panels(dashboard, row)]
        assert {"Copy time p50 / p99", "Transfer lifetime p50 / p99", "Engine wait"} <= set(titles)
    assert dashboard["uid"] == "kvcompose-native" and dashboard["title"] == "kvcompose: native"
    for row, child, native, other in ((rows[2], "hot", "vllm:kv_offload_", "vllm:nixl_"),
                                      (rows[3], "cold", "vllm:nixl_", "vllm:kv_offload_")):
        panels = _row_panels(dashboard, row)
        exprs = [target["expr"] for panel in panels for target in panel["targets"]]
        assert all(f'connector="{child}"' in expr and 'connector=~"$connector"' in expr for expr in exprs)
        assert any(native in expr for expr in exprs) and not any(other in expr for expr in exprs)
    for row in (rows[0], rows[1], rows[4]):  # every child in one panel
        exprs = [t["expr"] for panel in _row_panels(dashboard, row) for t in panel["targets"]]
        assert exprs and not any(f'connector="{child}"' in expr for expr in exprs for child in ("hot", "cold"))


# --- the command line --------------------------------------------------------------------------

def test_cli_prints_the_committed_dashboard() -> None:
    result = kvcompose("dashboard")
    assert result.returncode == 0, result.stderr
    assert result.stdout == COMMITTED_DASHBOARD.read_text()


def test_cli_writes_dashboard_and_provisioning(tmp_path: Path) -> None:
    output = tmp_path / "pipeline.json"
    result = kvcompose("dashboard", "--pipeline", str(EXAMPLE_PIPELINE), "--output", str(output),
                       "--provisioning", str(tmp_path / "provisioning"))
    assert (result.returncode, result.stdout, result.stderr) == (0, "", "")
    assert json.loads(output.read_text()) == DASHBOARDS["example-pipeline"]
    for relative, content in provisioning_files().items():
        assert (tmp_path / "provisioning" / relative).read_text() == content


@pytest.mark.parametrize(
    ("text", "field"),
    [("version: 1\nname: x\nchildren:\n  - {name: a, connector: ExampleConector}\n", "children[0].connector"),
     ("version: 1\nname: x\nchildren: []\n", "children")],
)
def test_cli_bad_pipeline_exits_2_with_one_line_naming_the_field(tmp_path: Path, text: str, field: str) -> None:
    path = tmp_path / "p.yaml"
    path.write_text(text)
    result = kvcompose("dashboard", "--pipeline", str(path))
    assert (result.returncode, result.stdout) == (2, "")
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and field in lines[0] and str(path) in lines[0], result.stderr


@pytest.mark.parametrize("args", [["dashboard", "--pipeline"], ["dashboard", "extra"], ["dashboard", "--bogus"]])
def test_cli_misuse_exits_2_with_one_line(args: list[str]) -> None:
    result = kvcompose(*args)
    assert result.returncode == 2
    assert len(result.stderr.splitlines()) == 1 and " error: " in result.stderr


def test_cli_unwritable_output_exits_2_with_one_line(tmp_path: Path) -> None:
    target = tmp_path / "missing-dir" / "kvcompose.json"
    result = kvcompose("dashboard", "--output", str(target))
    assert (result.returncode, result.stdout) == (2, "")
    assert result.stderr.splitlines() == [f"{target}: cannot write: No such file or directory"]


def test_cli_dashboard_does_not_import_vllm() -> None:
    code = ("import sys, runpy; sys.argv = ['kvcompose', 'dashboard', '--pipeline', %r, '--output', '/dev/null']\n"
            "try:\n    runpy.run_module('kvcompose', run_name='__main__')\n"
            "except SystemExit as e:\n    assert e.code == 0, e.code\n"
            "assert not [m for m in sys.modules if m == 'vllm' or m.startswith('vllm.')], 'vllm was imported'\n"
            ) % str(EXAMPLE_PIPELINE)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr


# --- examples/observability --------------------------------------------------------------------

def test_compose_mounts_the_committed_dashboard_where_the_provider_reads() -> None:
    compose = yaml.safe_load((OBSERVABILITY / "docker-compose.yml").read_text())
    assert set(compose["services"]) == {"prometheus", "grafana", "jaeger"}
    mounts = dict(volume.removesuffix(":ro").split(":") for volume in compose["services"]["grafana"]["volumes"])
    for source in mounts:
        assert (OBSERVABILITY / source).exists(), source
    assert mounts["../../dashboards/kvcompose.json"] == f"{DASHBOARDS_PATH}/kvcompose.json"
    for folder in ("datasources", "dashboards"):
        assert mounts[f"../../dashboards/provisioning/{folder}"] == f"/etc/grafana/provisioning/{folder}"
    jaeger = compose["services"]["jaeger"]
    assert "4318:4318" in jaeger["ports"] and jaeger["environment"]["COLLECTOR_OTLP_ENABLED"] == "true"


def test_compose_prometheus_config_is_valid_and_matches_the_datasource_interval() -> None:
    config = OBSERVABILITY / "prometheus.yml"
    promtool = shutil.which("promtool")
    assert promtool, "promtool is missing: `make test` installs it (scripts/ensure-prometheus.sh)"
    checked = subprocess.run([promtool, "check", "config", str(config)], capture_output=True, text=True, timeout=60)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert yaml.safe_load(config.read_text())["global"]["scrape_interval"] == SCRAPE_INTERVAL


def test_compose_keeps_exemplars_and_links_them_to_jaeger() -> None:
    """Prometheus scrapes /metrics/ (OpenMetrics, with exemplars) and stores exemplars; Grafana's
    Prometheus datasource sends an exemplar's trace_id to the provisioned Jaeger datasource."""
    compose = yaml.safe_load((OBSERVABILITY / "docker-compose.yml").read_text())
    assert "--enable-feature=exemplar-storage" in compose["services"]["prometheus"]["command"]
    (job,) = yaml.safe_load((OBSERVABILITY / "prometheus.yml").read_text())["scrape_configs"]
    assert job["metrics_path"] == "/metrics/"
    datasources = {source["type"]: source for source in yaml.safe_load(
        provisioning_files()["datasources/kvcompose.yaml"])["datasources"]}
    (destination,) = datasources["prometheus"]["jsonData"]["exemplarTraceIdDestinations"]
    assert destination == {"name": "trace_id", "datasourceUid": datasources["jaeger"]["uid"]}
    jaeger_ui = next(port for port in compose["services"]["jaeger"]["ports"] if port.startswith("16686:"))
    assert datasources["jaeger"]["url"] == f"http://jaeger:{jaeger_ui.split(':')[1]}"


# --- helpers -----------------------------------------------------------------------------------

def _datasource_references(node: Any, where: str = "") -> Iterator[tuple[str, Any]]:
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "datasource":
                yield where, value
            yield from _datasource_references(value, f"{where}.{key}")
    elif isinstance(node, list):
        for index, value in enumerate(node):
            yield from _datasource_references(value, f"{where}[{index}]")


def _views(dashboard: dict[str, Any]) -> Iterator[list[dict[str, Any]]]:
    """What Grafana lays out at once: the top level, and each collapsed row as if expanded."""
    yield dashboard["panels"]
    for panel in dashboard["panels"]:
        if panel["type"] == "row" and panel["collapsed"]:
            yield [panel, *panel["panels"]]


def _row_panels(dashboard: dict[str, Any], row: dict[str, Any]) -> list[dict[str, Any]]:
    if row["collapsed"]:
        return row["panels"]
    panels = dashboard["panels"]
    start = panels.index(row) + 1
    end = next((i for i in range(start, len(panels)) if panels[i]["type"] == "row"), len(panels))
    return panels[start:end]
