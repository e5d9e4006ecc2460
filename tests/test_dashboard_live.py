"""Every dashboard query against a real Prometheus scraping a real `vllm serve` with kvcompose.

The served pipeline (examples/observability/pipeline.yaml) has two healthy
ExampleConnector children, "hot" and "cold". After a workload every panel query must return
data, except those whose series this run cannot produce (listed below with
the reason). Those are still sent, and must parse and succeed. kvcompose's counts are
checked against vLLM's own external prefix-cache counters, and the Kubernetes PodMonitor's
path against a Prometheus that keeps exemplars.
"""

from __future__ import annotations

import itertools
import math
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvcompose.dashboard.queries import ENGINE_SERIES
from kvcompose.metrics.summary import summarize
from kvcompose.testing.tiny_model import prompt_words
from kvcompose.wire.economics import GPU
from kvcompose.wire.telemetry import DROP_REASONS

from .dashboard_support import (
    REPO,
    dashboards,
    fill,
    label_values_parts,
    metrics_read,
    query_and_scope,
    targets,
    variable_queries,
)
from .prometheus_support import SCRAPE_INTERVAL_S, api, instant, start_prometheus, wait

pytestmark = pytest.mark.engine

CHILDREN = ["hot", "cold"]
# Series a healthy run of two ExampleConnector children cannot produce:
# - a child's first exception, its breaker's first opening;
# - a call running long (over two looks of the watchdog);
# - write waste: only tiers of known size serve a reach of the curve (an OffloadingConnector's).
MAY_BE_EMPTY = {"kvcompose_call_errors_total", "kvcompose_circuit_breaker_opens_total",
                "kvcompose_calls_in_progress_seconds", "kvcompose_write_waste_ratio"}
NATIVE_PREFIXES = ("vllm:kv_offload_", "vllm:nixl_")  # no OffloadingConnector or NIXL child is served
# Only the GPU cache's capacity is known: ExampleConnector's store has no size.
GPU_ONLY = {"tier_capacity_bytes"}
# The served engine runs with prefix caching off: the GPU cache serves no prefix hits and its capacity reads 0
# blocks, which the curve has no point for, and no tier has a size. The marks on the curve are then none, and no
# tenant's curve has a point at the GPU cache's size.
NO_MARKS = {"capacity_marks", "tenant_hit_ratio_at_gpu"}
# Economics reports reach /metrics every few seconds (kvcompose.instrumentation.economics.REPORT_EVERY_S).
REPORTED_LATER = ("kvcompose_cache_size_hit_ratio", "kvcompose_prefill_seconds_per_token")
# The prefill cost is the slope of the steps' time over their prefill tokens (10 and 359 here): prompts of
# sizes far apart let it show through a busy host's stalls, where prompts of one size would not.
COST_PROMPT_WORDS = (8, 256)
ALL = ".*"  # what Grafana sends for a variable set to "All"
VARIABLES = {"model_name": ALL, "engine": ALL, "connector": ALL, "op": ALL}
# $__rate_interval is at least 4 scrape intervals (4 s here); 2 m keeps the whole workload in the window.
RATE_INTERVAL = "2m"
POD_MONITOR = REPO / "deploy" / "kubernetes" / "podmonitor.yaml"


def may_be_empty(expr: str) -> bool:
    return any(metric in MAY_BE_EMPTY or metric.startswith(NATIVE_PREFIXES) for metric in metrics_read(expr))


def test_every_panel_query_returns_data_after_a_workload(served_pipeline: Any, prometheus: str) -> None:
    # A series' first sample gives rate() nothing to compare with: create every series first (in case
    # this test runs first), then the workload the panels must show.
    _complete_and_wait_for_scrape(served_pipeline, prometheus, [prompt_words(seed=605, length=96)])
    _wait_for_economics_reports(served_pipeline, prometheus)
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
            if query.name in NO_MARKS:
                assert result == [], f"{name} {target.where}: {result}"
                continue
            connectors = {series["metric"].get("connector") for series in result}
            assert connectors == _connectors_expected(query.name, target.expr, scope.child), \
                f"{name} {target.where}: {result}"
            _check_values(query.name, result)
    assert checked > 50
    assert set(empty_allowed) == {
        "error_rate", "breaker_opens", "calls_in_progress", "write_waste",
        "offload_load_bytes", "offload_store_bytes", "offload_load_bandwidth",
        "offload_store_bandwidth", "offload_lookup_p99", "offload_cpu_usage", "offload_allocation_failures",
        "nixl_transfer_p50", "nixl_transfer_p99", "nixl_bytes", "nixl_failed_transfers", "nixl_expired_requests"}


def test_kvcompose_counts_agree_with_vllms_external_prefix_cache_counters(served_pipeline: Any, prometheus: str) -> None:
    """What the hit-ratio panel's description and KVComposeLoadHitRatioDrop's runbook say, on a real server
    (prefix caching off): for a prompt sent twice, vLLM counts tokens (every prompt token queried, the loaded
    ones hit), kvcompose counts requests per child (one lookup each per request), and the tokens kvcompose
    counts as loaded, summed over the children, are vLLM's external hits."""
    counts = {
        "loaded": "sum(kvcompose_loaded_tokens_total)",
        "vllm_hits": "sum(vllm:external_prefix_cache_hits_total)",
        "vllm_queries": "sum(vllm:external_prefix_cache_queries_total)",
        **{f"{child}_{result}": f'sum(kvcompose_lookups_total{{connector="{child}", result="{result}"}})'
           for child in CHILDREN for result in ("hit", "miss")},
    }
    _complete_and_wait_for_scrape(served_pipeline, prometheus, [])  # whatever ran before, settled
    before = {name: _scalar(prometheus, promql) for name, promql in counts.items()}
    prompt = prompt_words(seed=607, length=96)
    answers = _complete_and_wait_for_scrape(served_pipeline, prometheus, [prompt, prompt])  # a store, then a load
    added = {name: _scalar(prometheus, promql) - before[name] for name, promql in counts.items()}

    assert added["vllm_queries"] == sum(answer["usage"]["prompt_tokens"] for answer in answers), added
    assert 0 < added["vllm_hits"] < answers[1]["usage"]["prompt_tokens"], added  # whole blocks of the repeat
    assert added["loaded"] == added["vllm_hits"], added
    for child in CHILDREN:  # both children saved the first request; each was asked once per request
        assert (added[f"{child}_hit"], added[f"{child}_miss"]) == (1, 1), added


def test_the_pod_monitors_path_gives_prometheus_the_transfer_exemplars(served_pipeline: Any, tmp_path: Path) -> None:
    """deploy/kubernetes/podmonitor.yaml's path, scraped by a real Prometheus with exemplar storage on (as
    the PodMonitor's comment asks of the Prometheus object): the lifetime histogram's exemplars arrive, each
    with the trace id of a traced transfer."""
    (endpoint,) = yaml.safe_load(POD_MONITOR.read_text())["spec"]["podMetricsEndpoints"]
    server = start_prometheus(served_pipeline.url, tmp_path, metrics_path=endpoint["path"],
                              features=("exemplar-storage",))
    try:
        prompt = prompt_words(seed=608, length=96)
        for _ in range(2):  # a save, then a load
            served_pipeline.complete(prompt)
        query = "kvcompose_transfer_lifetime_seconds_bucket"

        def trace_ids() -> set[str]:
            now = time.time()
            found = api(server.url, "query_exemplars", {"query": query, "start": now - 600, "end": now})
            return {exemplar["labels"].get("trace_id", "") for series in found for exemplar in series["exemplars"]}

        wait(lambda: trace_ids(), 60, server.log.read_text)
        assert all(len(trace_id) == 32 and int(trace_id, 16) for trace_id in trace_ids()), trace_ids()
    finally:
        server.stop()


def _connectors_expected(name: str, expr: str, child: str | None) -> set[str | None]:
    """The `connector` values a query's answer carries: none for the engine's own series, the GPU cache for
    the capacities, else the children it covers."""
    if name in GPU_ONLY:
        return {GPU}
    if metrics_read(expr) <= ENGINE_SERIES:
        return {None}
    return {child} if child else set(CHILDREN)


def _wait_for_economics_reports(served_pipeline: Any, prometheus: str) -> None:
    """The curve and the prefill cost reach /metrics with the stats of a step some seconds after the first
    traffic, the cost once the steps show one (kvcompose.instrumentation.economics.PrefillCost): keep a little
    traffic of two prompt sizes going until Prometheus has scraped both."""
    lengths = itertools.cycle(COST_PROMPT_WORDS)

    def scraped() -> bool:
        if all(instant(prometheus, f"count({name})")["result"] for name in REPORTED_LATER):
            return True
        served_pipeline.complete(prompt_words(seed=int(time.time()), length=next(lengths)), max_tokens=2)
        time.sleep(1)
        return False

    wait(scraped, 90, lambda: str({name: instant(prometheus, name) for name in REPORTED_LATER}))
    time.sleep(2 * SCRAPE_INTERVAL_S)  # a second sample, for rate()


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


def _complete_and_wait_for_scrape(served_pipeline: Any, prometheus: str, prompts: list[str]) -> list[dict[str, Any]]:
    """Complete the prompts one after the other; return the answers once Prometheus has scraped their counts."""
    answers = [served_pipeline.complete(prompt) for prompt in prompts]
    time.sleep(1)  # let the last step's stats reach /metrics
    lookups = {child: sum(row.lookups.values()) for child, row in summarize(served_pipeline.metrics()).items()}
    scraped = "sum by (connector) (kvcompose_lookups_total)"
    wait(lambda: _by_connector(instant(prometheus, scraped)["result"]) == lookups, 60,
         lambda: str(instant(prometheus, scraped)))
    time.sleep(2 * SCRAPE_INTERVAL_S)  # a second sample of every series, after its last change
    return answers


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
    elif name == "spans_dropped":  # every reason exported, none lost: the collector is healthy
        assert {s["metric"]["reason"]: float(s["value"][1]) for s in result} == dict.fromkeys(DROP_REASONS, 0.0)
    elif name in ("engine_wait", "copy_throughput") or name.startswith(("copy_", "lifetime_")):
        # hot loaded the repeated prompt; both children saved synchronously (ExampleConnector)
        lanes = {(s["metric"]["connector"], s["metric"]["direction"]): float(s["value"][1]) for s in result}
        for lane in (("hot", "load"), ("hot", "save"), ("cold", "save")):
            if lane[0] in by_child:
                assert math.isfinite(lanes[lane]) and lanes[lane] > 0, (name, lane, lanes)
    elif name == "prefill_saved" and "hot" in by_child:
        assert by_child["hot"] > 0, values
    elif name == "tenant_prompt_tokens":  # the workload names no tenant
        assert {s["metric"]["tenant"]: float(s["value"][1]) > 0 for s in result} == {
            "none": True, "other": False, "invalid": False}, values
    elif name == "prefill_cost":
        assert all(0 < value < 1 for value in values.values()), values
    elif name == "tier_capacity_bytes":  # prefix caching off: the GPU cache holds no prefix for the curve
        assert values == {(("connector", GPU),): 0.0}, values
    elif name == "hit_ratio_by_size":
        assert all(0 <= value <= 1 for value in values.values()), values
        assert all(int(s["metric"]["size_blocks"]) > 0 for s in result), result
    elif name == "tier_capacity_bytes":  # the GPU cache's blocks times a block's bytes
        assert by_child[GPU] > 0, values
    elif name == "call_rate":
        assert all(value > 0 for key, value in values.items() if ("op", "lookup") in key), values
    elif name.startswith("latency_"):
        lookups = [value for key, value in values.items() if ("op", "lookup") in key]
        assert lookups and all(math.isfinite(v) and v > 0 for v in lookups), (name, values)


def _by_connector(result: list[dict[str, Any]]) -> dict[str, float]:
    return {series["metric"].get("connector", ""): float(series["value"][1]) for series in result}


def _scalar(prometheus: str, promql: str) -> float:
    (sample,) = instant(prometheus, promql)["result"]
    return float(sample["value"][1])
