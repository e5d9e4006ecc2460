"""Every dashboard query against a real Prometheus scraping a real `vllm serve` with kvcompose.

The served pipeline (examples/observability/pipeline.yaml) has two healthy
ExampleConnector children, "hot" and "cold". After a workload every panel query must return
data, except those whose series this run cannot produce (listed below with
the reason). Those are still sent, and must parse and succeed.
"""

from __future__ import annotations

import math
import time
from typing import Any

import pytest

from kvcompose.metrics.summary import summarize
from kvcompose.testing.tiny_model import prompt_words

from .dashboard_support import (
    dashboards, fill, label_values_parts, metrics_read, query_and_scope, targets, variable_queries,
)
from .prometheus_support import SCRAPE_INTERVAL_S, api, instant, wait

pytestmark = pytest.mark.engine

CHILDREN = ["hot", "cold"]
# Series a healthy run of two ExampleConnector children cannot produce:
# Series that appear with a child's first exception, and its breaker's first opening:
MAY_BE_EMPTY = {"kvcompose_call_errors_total", "kvcompose_circuit_breaker_opens_total"}
NATIVE_PREFIXES = ("vllm:kv_offload_", "vllm:nixl_")  # no OffloadingConnector or NIXL child is served
ALL = ".*"  # what Grafana sends for a variable set to "All"
VARIABLES = {"model_name": ALL, "engine": ALL, "connector": ALL, "op": ALL}
# $__rate_interval is at least 4 scrape intervals (4 s here); 2 m keeps the whole workload in the window.
RATE_INTERVAL = "2m"


def may_be_empty(expr: str) -> bool:
    return any(metric in MAY_BE_EMPTY or metric.startswith(NATIVE_PREFIXES) for metric in metrics_read(expr))


def test_every_panel_query_returns_data_after_a_workload(served_pipeline: Any, prometheus: str) -> None:
    # A series' first sample gives rate() nothing to compare with: create every series first (in case
    # this test runs first), then the workload the panels must show.
    _complete_and_wait_for_scrape(served_pipeline, prometheus, [prompt_words(seed=605, length=96)])
    prompt = prompt_words(seed=606, length=96)
    _complete_and_wait_for_scrape(served_pipeline, prometheus, [prompt, prompt])  # the second loads from "hot"
    at = time.time()

    empty_allowed, checked = [], 0
    for name, dashboard in dashboards().items():
        if name == "native-pipeline":
            continue  # its native rows need OffloadingConnector and NIXL children
        for target in targets(dashboard):
            query, scope = query_and_scope(target.expr, CHILDREN)
            result = instant(prometheus, fill(target.expr, VARIABLES, RATE_INTERVAL), at)["result"]
            checked += 1
            if may_be_empty(target.expr):
                empty_allowed.append(query.name)
                continue
            connectors = {series["metric"].get("connector") for series in result}
            assert connectors == ({scope.child} if scope.child else set(CHILDREN)), f"{name} {target.where}: {result}"
            _check_values(query.name, result)
    assert checked > 30
    assert set(empty_allowed) == {
        "error_rate", "breaker_opens", "offload_load_bytes", "offload_store_bytes", "offload_load_bandwidth",
        "offload_store_bandwidth", "offload_lookup_p99", "offload_cpu_usage", "offload_allocation_failures",
        "nixl_transfer_p50", "nixl_transfer_p99", "nixl_bytes", "nixl_failed_transfers", "nixl_expired_requests"}


def test_template_variables_list_the_served_pipeline(served_pipeline: Any, prometheus: str) -> None:
    expected = {"model_name": {served_pipeline.model}, "engine": {"0"}, "connector": set(CHILDREN)}
    now = time.time()
    for variable, query in variable_queries(dashboards()["committed"]).items():
        series, label = label_values_parts(query)
        values = set(api(prometheus, f"label/{label}/values",
                         {"match[]": fill(series, VARIABLES, RATE_INTERVAL), "start": now - 600, "end": now}))
        if variable == "op":
            assert {"lookup", "update_state_after_alloc", "build_connector_meta", "start_load_kv"} <= values, values
        else:
            assert values == expected[variable], variable


def test_metrics_with_a_slash_answers_openmetrics_for_exemplars(served_pipeline: Any) -> None:
    """The transfer histogram's exemplars need OpenMetrics: `vllm serve` answers it on /metrics/ (the
    prometheus_client app it mounts), while /metrics stays in the classic text format."""
    import urllib.request

    def scrape(path: str) -> tuple[str, str]:
        request = urllib.request.Request(f"{served_pipeline.url}{path}",
                                         headers={"Accept": "application/openmetrics-text; version=1.0.0"})
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.headers["Content-Type"], response.read().decode()

    content_type, body = scrape("/metrics/")
    assert content_type.startswith("application/openmetrics-text"), content_type
    assert "kvcompose_transfer_lifetime_seconds_bucket{" in body and body.rstrip().endswith("# EOF")
    assert scrape("/metrics")[0].startswith("text/plain")


def _complete_and_wait_for_scrape(served_pipeline: Any, prometheus: str, prompts: list[str]) -> None:
    for prompt in prompts:
        served_pipeline.complete(prompt)
    time.sleep(1)  # let the last step's stats reach /metrics
    lookups = {child: sum(row.lookups.values()) for child, row in summarize(served_pipeline.metrics()).items()}
    scraped = "sum by (connector) (kvcompose_lookups_total)"
    wait(lambda: _by_connector(instant(prometheus, scraped)["result"]) == lookups, 60,
         lambda: str(instant(prometheus, scraped)))
    time.sleep(2 * SCRAPE_INTERVAL_S)  # a second sample of every series, after its last change


def _check_values(name: str, result: list[dict[str, Any]]) -> None:
    """What a healthy run with a repeated prompt must show, beyond 'there is data'."""
    values = {tuple(sorted(series["metric"].items())): float(series["value"][1]) for series in result}
    by_child = _by_connector(result)
    if name == "topology":
        rows = {(s["metric"]["position"], s["metric"]["connector"], s["metric"]["connector_class"]) for s in result}
        assert rows == {("0", "hot", "ExampleConnector"), ("1", "cold", "ExampleConnector")}
        assert {s["metric"]["pipeline"] for s in result} == {"hot-then-cold"}
    elif name in ("lookup_hit_ratio", "loaded_tokens") and "hot" in by_child:
        assert by_child["hot"] > 0, (name, values)
    elif name in ("load_error_blocks", "child_state"):  # nothing failed; every breaker closed
        assert set(by_child.values()) == {0.0}, values
    elif name == "call_rate":
        assert all(value > 0 for key, value in values.items() if ("op", "lookup") in key), values
    elif name.startswith("latency_"):
        lookups = [value for key, value in values.items() if ("op", "lookup") in key]
        assert lookups and all(math.isfinite(v) and v > 0 for v in lookups), (name, values)


def _by_connector(result: list[dict[str, Any]]) -> dict[str, float]:
    return {series["metric"].get("connector", ""): float(series["value"][1]) for series in result}
