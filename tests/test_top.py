"""`kvcompose top`: the per-tier figures, computed from real prometheus_client expositions."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    start_http_server,
)
from prometheus_client.exposition import generate_latest as classic_text
from prometheus_client.openmetrics.exposition import generate_latest as openmetrics_text

from kvcompose.top import (
    OPENMETRICS,
    ScrapeError,
    cells,
    frame,
    metrics_url,
    parse,
    tenant_cells,
)

from .server_support import free_port

VLLM = ["model_name", "engine"]
BUCKETS = (0.001, 0.01, 0.1)
TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"


@dataclass
class Server:
    """kvcompose's series as a two-engine server exposes them, written by prometheus_client itself."""

    registry: CollectorRegistry
    lifetime: Histogram
    copy: Histogram
    moved: Counter


def kvcompose_series(lifetime_name: str = "kvcompose_transfer_lifetime_seconds") -> Server:
    registry = CollectorRegistry()
    # The disk tier's series come first: rows follow the pipeline's positions, not the exposition's order.
    lookups = Counter("kvcompose_lookups", "", [*VLLM, "connector", "result"], registry=registry)
    state = Gauge("kvcompose_child_state", "", [*VLLM, "connector"], registry=registry)
    info = Gauge("kvcompose_pipeline_info", "", [*VLLM, "pipeline", "connector", "connector_class", "position"],
                 registry=registry)
    lifetime = Histogram(lifetime_name, "", [*VLLM, "connector", "direction"], buckets=BUCKETS, registry=registry)
    copy = Histogram("kvcompose_transfer_copy_seconds", "", [*VLLM, "connector", "direction", "source"],
                     buckets=BUCKETS, registry=registry)
    moved = Counter("kvcompose_transfer_bytes", "", [*VLLM, "connector", "direction"], registry=registry)
    in_flight = Gauge("kvcompose_transfers_in_flight", "", [*VLLM, "connector", "direction"], registry=registry)
    for engine in ("0", "1"):
        for position, tier in ((1, "disk"), (0, "offload")):
            info.labels("m", engine, "p", tier, "C", str(position)).set(1)
            state.labels("m", engine, tier).set(0)
            for direction in ("load", "save"):
                moved.labels("m", engine, tier, direction)
                in_flight.labels("m", engine, tier, direction).set(0)
    lookups.labels("m", "0", "offload", "hit").inc(3)
    lookups.labels("m", "0", "offload", "miss").inc(1)
    lookups.labels("m", "1", "offload", "hit").inc(1)
    lookups.labels("m", "1", "offload", "miss").inc(3)
    state.labels("m", "1", "offload").set(3)  # one engine's call into the child is stuck
    in_flight.labels("m", "0", "offload", "load").set(2)
    in_flight.labels("m", "1", "offload", "load").set(1)
    for _ in range(50):
        lifetime.labels("m", "0", "offload", "load").observe(0.002)
        lifetime.labels("m", "1", "offload", "load").observe(0.02)
        copy.labels("m", "0", "offload", "load", "child").observe(0.0005)
    moved.labels("m", "0", "offload", "load").inc(1000)
    return Server(registry, lifetime, copy, moved)


def test_figures_sum_the_engines_and_rates_cover_the_time_between_reads() -> None:
    server = kvcompose_series()
    before = parse(openmetrics_text(server.registry).decode(), OPENMETRICS, at=10.0)
    for _ in range(4):
        server.lifetime.labels("m", "1", "offload", "load").observe(0.02)
    server.lifetime.labels("m", "0", "offload", "save").observe(0.05, exemplar={"trace_id": TRACE})
    server.moved.labels("m", "1", "offload", "load").inc(4000)
    now = parse(openmetrics_text(server.registry).decode(), OPENMETRICS, at=12.0)

    shown = frame(before, now)
    assert (shown.pipeline, shown.seconds, [row.name for row in shown.rows]) == ("p", 2.0, ["offload", "disk"])
    offload, disk = shown.rows
    assert offload.state == "stuck" and disk.state == "closed"
    assert offload.hit_ratio == 0.5  # (3 + 1) hits of 8 lookups
    assert offload.per_second == {"load": 2.0, "save": 0.5}  # 4 and 1 transfers in 2 s
    assert offload.bytes_per_second == {"load": 2000.0, "save": 0.0}
    assert offload.in_flight == {"load": 3, "save": 0}
    # 50 loads of 2 ms and 54 of 20 ms in buckets (1, 10, 100] ms: histogram_quantile interpolates in the bucket.
    assert offload.lifetime["load"] == (pytest.approx(0.01 + 0.09 * (0.5 * 104 - 50) / 54),
                                        pytest.approx(0.01 + 0.09 * (0.99 * 104 - 50) / 54))
    assert offload.copy["load"] == (pytest.approx(0.0005), pytest.approx(0.00099))
    assert offload.slowest == (0.05, TRACE)
    assert disk.hit_ratio is None and disk.lifetime["load"] == (None, None) and disk.slowest is None
    row = cells(offload)
    assert row[:5] == ["offload", "stuck", "50%", "2", "0.5"]
    assert row[-4:-1] == ["2kB", "0B", "3/0"]
    assert row[-1] == f"50ms {TRACE}"


def _tenant_series(registry: CollectorRegistry) -> tuple[Counter, Counter, Counter]:
    """Two engines' tenant counters: acme (loaded by offload) and none, as the real series are labelled."""
    prompt = Counter("kvcompose_tenant_prompt_tokens", "", [*VLLM, "tenant"], registry=registry)
    loaded = Counter("kvcompose_tenant_loaded_tokens", "", [*VLLM, "tenant", "connector"], registry=registry)
    saved = Counter("kvcompose_tenant_prefill_seconds_saved", "", [*VLLM, "tenant", "connector"], registry=registry)
    for engine in ("0", "1"):
        for tenant in ("acme", "none"):
            prompt.labels("m", engine, tenant).inc(1000)
            for tier in ("offload", "disk"):
                loaded.labels("m", engine, tenant, tier)
                saved.labels("m", engine, tenant, tier)
    loaded.labels("m", "0", "acme", "offload").inc(500)
    return prompt, loaded, saved


def test_tenant_rows_sum_engines_and_tiers_busiest_first() -> None:
    server = kvcompose_series()
    prompt, loaded, saved = _tenant_series(server.registry)
    before = parse(openmetrics_text(server.registry).decode(), OPENMETRICS, at=10.0)
    prompt.labels("m", "0", "none").inc(600)
    prompt.labels("m", "1", "acme").inc(200)
    prompt.labels("m", "1", "acme").inc(200)
    loaded.labels("m", "1", "acme", "disk").inc(100)
    loaded.labels("m", "0", "acme", "offload").inc(100)
    saved.labels("m", "1", "acme", "disk").inc(0.25)
    now = parse(openmetrics_text(server.registry).decode(), OPENMETRICS, at=12.0)

    acme, none = frame(before, now).tenants[1], frame(before, now).tenants[0]
    assert (none.name, none.prompt_per_second, none.loaded_per_second, none.loaded_share) == ("none", 300, 0, 0)
    assert (acme.name, acme.prompt_per_second, acme.loaded_per_second, acme.saved_per_second) == (
        "acme", 200, 100, 0.125)
    assert acme.loaded_share == 700 / 2400
    assert tenant_cells(acme) == ["acme", "200", "100", "0.125", "29%"]
    assert frame(before, parse(classic_text(kvcompose_series().registry).decode(), "text/plain", 12.0)).tenants == []


def test_exemplars_older_than_five_minutes_are_not_recent() -> None:
    server = kvcompose_series()
    server.lifetime.labels("m", "0", "offload", "load").observe(0.05, exemplar={"trace_id": TRACE})
    now = parse(openmetrics_text(server.registry).decode(), OPENMETRICS, at=1.0)
    assert frame(now, now).rows[0].slowest == (0.05, TRACE)
    assert frame(now, now, wall_clock=time.time() + 301).rows[0].slowest is None


def test_the_classic_text_format_gives_the_same_figures_without_exemplars() -> None:
    server = kvcompose_series()
    server.lifetime.labels("m", "0", "offload", "load").observe(0.05, exemplar={"trace_id": TRACE})
    open_metrics = parse(openmetrics_text(server.registry).decode(), OPENMETRICS, at=1.0)
    classic = parse(classic_text(server.registry).decode(), "text/plain; version=0.0.4", at=1.0)
    (offload, disk), (classic_offload, classic_disk) = frame(open_metrics, open_metrics).rows, \
        frame(classic, classic).rows
    assert classic_offload.slowest is None
    classic_offload.slowest = offload.slowest
    assert (classic_offload, classic_disk) == (offload, disk)


def test_an_earlier_kvcompose_lifetime_histogram_is_read_under_its_old_name() -> None:
    server = kvcompose_series(lifetime_name="kvcompose_transfer_duration_seconds")
    now = parse(openmetrics_text(server.registry).decode(), OPENMETRICS, at=1.0)
    assert frame(now, now).rows[0].lifetime["load"][0] == pytest.approx(0.01)


def test_a_server_without_kvcompose_series_is_an_error() -> None:
    registry = CollectorRegistry()
    Counter("vllm:prompt_tokens", "", registry=registry).inc()
    now = parse(openmetrics_text(registry).decode(), OPENMETRICS, at=1.0)
    with pytest.raises(ScrapeError, match="no kvcompose series"):
        frame(now, now)


@pytest.mark.parametrize(("url", "expected"), [
    ("http://h:8000", "http://h:8000/metrics/"),
    ("h:8000", "http://h:8000/metrics/"),
    ("http://h:8000/metrics", "http://h:8000/metrics/"),  # /metrics carries no exemplars; /metrics/ does
    ("https://h/proxy/vllm-metrics", "https://h/proxy/vllm-metrics"),
])
def test_the_url_names_the_openmetrics_endpoint(url: str, expected: str) -> None:
    assert metrics_url(url) == expected


@pytest.fixture
def exposition_server() -> Iterator[tuple[str, Server]]:
    """prometheus_client's own HTTP server: it answers in OpenMetrics when asked, as vLLM's /metrics/ does."""
    series = kvcompose_series()
    _tenant_series(series.registry)
    series.lifetime.labels("m", "0", "offload", "load").observe(0.05, exemplar={"trace_id": TRACE})
    port = free_port()
    server, thread = start_http_server(port, addr="127.0.0.1", registry=series.registry)
    yield f"http://127.0.0.1:{port}", series
    server.shutdown()
    thread.join()


def top(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvcompose", "top", *args], capture_output=True, text=True,
                          timeout=60)


def test_once_prints_one_row_per_tier_with_the_slowest_trace(exposition_server: tuple[str, Server]) -> None:
    url, _ = exposition_server
    result = top("--once", "--interval", "0.2", url)
    assert (result.returncode, result.stderr) == (0, "")
    rows = {line.split()[0]: line.split() for line in result.stdout.splitlines()
            if line.split() and line.split()[0] in ("offload", "disk")}
    assert list(rows) == ["offload", "disk"]
    assert rows["offload"][:3] == ["offload", "stuck", "50%"]
    assert rows["offload"][-1] == TRACE and rows["disk"][-1] == "-"
    assert re.search(r"rates over the last 0\.[2-9] s", result.stdout), result.stdout
    tenants = {line.split()[0]: line.split()[1:] for line in result.stdout.splitlines()
               if line.split() and line.split()[0] in ("acme", "none")}
    assert tenants == {"acme": ["0", "0", "0", "25%"], "none": ["0", "0", "0", "0%"]}  # 500 of 2000 loaded


def test_once_against_no_server_exits_1_with_one_line() -> None:
    port = free_port()
    result = top("--once", f"http://127.0.0.1:{port}")
    assert (result.returncode, result.stdout) == (1, "")
    assert result.stderr.startswith(f"kvcompose top: http://127.0.0.1:{port}/metrics/: cannot read: ")
    assert len(result.stderr.splitlines()) == 1
