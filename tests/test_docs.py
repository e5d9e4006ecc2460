"""The operator documentation (README.md, docs/, the examples' guides) against the code it describes.

Every metric the code registers, every span name it emits and every alert it
defines must be named in README.md or docs/, so a renamed or added series
cannot leave the docs behind. Every relative link must resolve, anchors
included. The README's cost table must quote the committed benchmark run.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
LATEST = ROOT / "benchmarks" / "results" / "latest.json"
PIPELINE = {"version": 1, "name": "docs", "children": [
    {"name": "hot", "connector": "ExampleConnector", "config": {"shared_storage_path": "/tmp/kvcompose-docs/hot"}},
    {"name": "cold", "connector": "ExampleConnector", "config": {"shared_storage_path": "/tmp/kvcompose-docs/cold"}},
]}
# How a transfer span's name is written in the docs: its direction and child as placeholders.
TRANSFER_PLACEHOLDERS = ("<direction>", "<child>")
FENCE = re.compile(r"^```.*?^```", re.MULTILINE | re.DOTALL)
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*$", re.MULTILINE)


def operator_pages() -> list[Path]:
    """README.md and every page under docs/ (runbooks included)."""
    return [README, *sorted(DOCS.rglob("*.md"))]


def linked_pages() -> list[Path]:
    """The pages whose links are checked: the operator pages and the examples' guides."""
    return [*operator_pages(), *sorted((ROOT / "examples").rglob("*.md"))]


@functools.cache
def documentation() -> str:
    return "\n".join(page.read_text() for page in operator_pages())


def named(name: str, text: str) -> bool:
    """``name`` stands in ``text`` as a whole name: not as part of a longer metric, span or alert name."""
    return re.search(rf"(?<![\w.]){re.escape(name)}(?![\w.])", text) is not None


def test_every_metric_the_code_registers_is_documented(vllm_config_with: Callable) -> None:
    """The series kvcompose's Prometheus metrics register, read from a registry the real metric classes fill
    (vLLM builds them through ``build_prom_metrics``, as its front-end does)."""
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

    from kvcompose.connectors import KVComposeConnector

    registry = CollectorRegistry()
    metric_types: dict[type, Any] = {kind: functools.partial(kind, registry=registry)
                                     for kind in (Counter, Gauge, Histogram)}
    config = vllm_config_with({"kv_connector": "KVComposeConnector", "kv_connector_module_path": "kvcompose.connectors",
                               "kv_role": "kv_both", "kv_connector_extra_config": {"pipeline": PIPELINE}})
    KVComposeConnector.build_prom_metrics(config, metric_types, ["model_name", "engine"], {0: ["m", "0"]})
    # A counter's family drops the ``_total`` its series carry; the docs name the series.
    registered = {family.name + ("_total" if family.type == "counter" else "")
                  for family in registry.collect() if family.name.startswith("kvcompose_")}
    assert {"kvcompose_call_duration_seconds", "kvcompose_engine_wait_seconds_total"} <= registered
    missing = sorted(name for name in registered if not named(name, documentation()))
    assert not missing, f"metrics the code registers that README.md and docs/ never name: {missing}"


def test_every_span_name_the_code_emits_is_documented(vllm_config_with: Callable) -> None:
    """The span names a real tracer registers: the request, step and breaker spans at start-up, a call span
    per traced operation, and a transfer span (its direction and child written as placeholders)."""
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from kvcompose.config import load_pipeline
    from kvcompose.connectors.children import child_specs
    from kvcompose.operations import OPERATIONS
    from kvcompose import names as attr
    from kvcompose.tracing.pipeline import PipelineTracer, SpanContextIds
    from kvcompose.tracing.sampling import sampling_for
    from kvcompose.tracing.shipping import InProcessShipper

    pipeline = load_pipeline(PIPELINE)
    config = vllm_config_with({"kv_connector": "KVComposeConnector", "kv_connector_module_path": "kvcompose.connectors",
                               "kv_role": "kv_both", "kv_connector_extra_config": {"pipeline": PIPELINE}})
    spec = child_specs(config, pipeline)[0]
    shipper = InProcessShipper(InMemorySpanExporter(), pipeline.tracing.service_name, "test")
    tracer = PipelineTracer(shipper, sampling_for(1.0), pipeline, "worker")
    try:
        for operation in OPERATIONS.values():
            if operation.traced:
                tracer.call_template(spec, operation)
        for direction in ("load", "save"):
            tracer.transfer(SpanContextIds(1, 1), spec, "request", direction, 0, 1, 1, 1, "ok", None, None)
    finally:
        tracer.close()
    emitted = set()
    for template in shipper.templates.all:
        values = (template.attributes.get(attr.TRANSFER_DIRECTION), template.attributes.get(attr.CONNECTOR_NAME))
        if values[0] is not None:  # a transfer span: name its direction and child as the docs do
            words = template.name.split(" ")
            emitted.add(" ".join(dict(zip(values, TRANSFER_PLACEHOLDERS, strict=True)).get(word, word)
                                 for word in words))
        else:
            emitted.add(template.name)
    assert {"kvcompose.request", "kvcompose.lookup", "kvcompose.transfer <direction> <child>"} <= emitted
    missing = sorted(name for name in emitted if not named(name, documentation()))
    assert not missing, f"span names the code emits that README.md and docs/ never name: {missing}"


def test_every_alert_the_code_defines_is_documented() -> None:
    from kvcompose.alerts import ALERTS

    missing = sorted(alert.name for alert in ALERTS if not named(alert.name, documentation()))
    assert ALERTS and not missing, f"alerts that README.md and docs/ never name: {missing}"


def _links(page: Path) -> Iterator[str]:
    yield from LINK.findall(FENCE.sub("", page.read_text()))


def _anchors(page: Path) -> set[str]:
    """The anchors GitHub makes of a page's headings: lowercase, punctuation dropped, spaces to hyphens, and a
    repeated heading numbered."""
    anchors: set[str] = set()
    for heading in HEADING.findall(FENCE.sub("", page.read_text())):
        slug = re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
        anchor, repeat = slug, 0
        while anchor in anchors:
            repeat += 1
            anchor = f"{slug}-{repeat}"
        anchors.add(anchor)
    return anchors


@pytest.mark.parametrize("page", linked_pages(), ids=lambda page: str(page.relative_to(ROOT)))
def test_every_relative_link_resolves(page: Path) -> None:
    broken = []
    for link in _links(page):
        if re.match(r"^[a-z][a-z0-9+.-]*:", link):  # http:, https:, mailto: ...
            continue
        path, _, anchor = link.partition("#")
        target = (page.parent / path).resolve() if path else page
        if not target.exists():
            broken.append(f"{link}: no {target.relative_to(ROOT) if target.is_relative_to(ROOT) else target}")
        elif anchor and target.suffix == ".md" and anchor not in _anchors(target):
            broken.append(f"{link}: no heading #{anchor} in {target.relative_to(ROOT)}")
    assert not broken, f"{page.relative_to(ROOT)}: {broken}"


def test_the_link_check_sees_a_broken_link_and_anchor(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text("# A title: `here`\n\n[ok](#a-title-here) [gone](missing.md) [bad](#nowhere)\n"
                    "```\n[in code](ignored.md)\n```\n")
    assert list(_links(page)) == ["#a-title-here", "missing.md", "#nowhere"]
    assert _anchors(page) == {"a-title-here"}


def test_no_page_tells_dated_runs_or_commits() -> None:
    """Dated runs and commit hashes belong in commit messages and benchmarks/results/, not in the docs."""
    dated = re.compile(r"\b20\d\d-\d\d-\d\d\b|\b\d\d:\d\d UTC\b|\b(?=[0-9a-f]*\d)(?=[0-9a-f]*[a-f])[0-9a-f]{7,12}\b")
    found = {str(page.relative_to(ROOT)): dated.findall(FENCE.sub("", page.read_text())) for page in operator_pages()}
    assert not {page: hits for page, hits in found.items() if hits}


def readme_cost_figures(results: dict[str, Any]) -> list[tuple[str, ...]]:
    """The figures each row of README's "What it costs" states, in order, from a benchmark run's results."""
    batches = results["batch_scaling"]["batches"]

    def by_batch(name: str, figure: str) -> str:
        return " / ".join(f"{batches[batch]['ratios'][name][figure]:.3f}x" for batch in batches)

    step = next(row for row in results["hot_path"] if row["what"] == "worker step" and row["children"] == 2
                and row["layers"] == 2)
    traced = next(row for row in results["request_cost"] if row["children"] == 2)
    transfer = results["transfer_cost"]["us_per_transfer"]
    return [
        (by_batch("kvc_shipped", "cpu_us_per_token"), by_batch("multi_twin", "cpu_us_per_token")),
        (by_batch("kvc_request10", "cpu_us_per_token"),),
        (f"{step['extra_us']['kvc_off']:+.1f} µs", f"{step['us']['multi']:.1f} µs",
         f"{step['extra_us']['multi_twin']:+.1f} µs"),
        (f"+{traced['extra_us']['kvc_traced']:.1f} µs",),
        (by_batch("kvc_step", "ttft_ms"), by_batch("kvc_step", "tokens_per_s"), by_batch("multi_twin", "ttft_ms")),
        (f"{transfer['tracing_off']:.2f} µs", f"({transfer['tracing_on']:.2f} µs"),
    ]


def test_the_readme_cost_table_quotes_the_committed_benchmark_run() -> None:
    """The rows of "What it costs" state the figures of benchmarks/results/latest.json: refreshing the results
    without the README (or the other way round) fails here."""
    results = json.loads(LATEST.read_text())
    text = README.read_text()
    section = text[text.index("## What it costs"):]
    table = section[:section.index("\n## ")]
    rows = [line for line in table.splitlines() if line.startswith("| ") and not line.startswith("| ---")][1:]
    expected = readme_cost_figures(results)
    assert len(rows) == len(expected), rows
    stale = [(row, figure) for row, figures in zip(rows, expected, strict=True) for figure in figures
             if figure not in row]
    assert not stale, f"README cost figures differ from {LATEST.relative_to(ROOT)}: {stale}"
