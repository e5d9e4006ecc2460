"""kvcompose.exposition: reading prometheus_client's own expositions, in both formats, and histogram quantiles."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.exposition import generate_latest as classic_text
from prometheus_client.openmetrics.exposition import generate_latest as openmetrics_text

from kvcompose.exposition import ExpositionError, quantile, read

TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"


def _registry() -> CollectorRegistry:
    """Two engines' lookups and one traced transfer, beside a vLLM counter."""
    registry = CollectorRegistry()
    lookups = Counter("kvcompose_lookups", "", ["engine", "connector", "result"], registry=registry)
    lookups.labels("0", "offload", "hit").inc(3)
    lookups.labels("1", "offload", "hit").inc(4)
    lookups.labels("0", "offload", "miss").inc(5)
    lifetime = Histogram("kvcompose_transfer_lifetime_seconds", "", ["connector"], buckets=(0.01, 0.1),
                         registry=registry)
    lifetime.labels("offload").observe(0.05, exemplar={"trace_id": TRACE})
    Counter("vllm:prompt_tokens", "", ["engine"], registry=registry).labels("0").inc(7)
    return registry


@pytest.mark.parametrize("write", [classic_text, openmetrics_text])
def test_both_formats_read_the_same_totals(write: object) -> None:
    exposition = read(write(_registry()).decode())  # type: ignore[operator]
    assert exposition.total("kvcompose_lookups_total", connector="offload", result="hit") == 7
    assert exposition.total("kvcompose_lookups_total", connector="offload") == 12
    assert [sample.labels["engine"] for sample in exposition.series("kvcompose_lookups_total", result="hit")] \
        == ["0", "1"]
    assert exposition.total("kvcompose_lookups_total", connector="disk") == 0


def test_only_the_families_asked_for_are_read() -> None:
    text = classic_text(_registry()).decode()
    assert not [name for name in read(text).samples if not name.startswith("kvcompose_")]
    assert read(text, ("vllm:",)).total("vllm:prompt_tokens_total") == 7


def test_openmetrics_is_told_by_its_eof_and_keeps_exemplars() -> None:
    [bucket] = read(openmetrics_text(_registry()).decode()).series("kvcompose_transfer_lifetime_seconds_bucket",
                                                                   le="0.1")
    assert bucket.exemplar is not None
    assert (bucket.exemplar.value, bucket.exemplar.labels["trace_id"]) == (0.05, TRACE)


def test_a_family_the_parser_refuses_is_not_read_unless_asked_for() -> None:
    text = openmetrics_text(_registry()).decode().replace("# EOF", "vllm:broken{ 1\n# EOF")
    assert read(text).total("kvcompose_lookups_total") == 12
    with pytest.raises(ExpositionError, match="^not a Prometheus exposition: "):
        read(text, ("kvcompose_", "vllm:"))


def test_untyped_samples_are_read_without_their_family() -> None:
    """In OpenMetrics, vLLM's prompt token family keeps its colon (vllm:prompt_tokens) and its samples do not."""
    text = openmetrics_text(_registry()).decode()
    assert read(text, untyped=("vllm_prompt_tokens_total",)).total("vllm_prompt_tokens_total", engine="0") == 7


def test_the_content_type_can_say_the_format() -> None:
    """A server's content type says OpenMetrics where the text has no # EOF to tell it."""
    text = openmetrics_text(_registry()).decode().replace("# EOF", "")
    [classic] = read(text).series("kvcompose_transfer_lifetime_seconds_bucket", le="0.1")
    [bucket] = read(text, openmetrics=True).series("kvcompose_transfer_lifetime_seconds_bucket", le="0.1")
    assert classic.exemplar is None  # the classic format has none
    assert bucket.exemplar is not None and bucket.exemplar.labels["trace_id"] == TRACE


@pytest.mark.parametrize(("q", "buckets", "expected"), [
    (0.5, [(0.001, 0), (0.01, 50), (0.1, 100), (float("inf"), 100)], 0.01),
    (0.99, [(0.001, 0), (0.01, 50), (0.1, 100), (float("inf"), 100)], 0.01 + 0.09 * 49 / 50),
    (0.5, [(0.001, 10), (float("inf"), 10)], 0.0005),
    (0.5, [(0.001, 0), (0.01, 10), (0.1, 10), (float("inf"), 10)], 0.0055),  # linear inside the bucket
    (0.99, [(0.001, 0), (0.01, 0), (float("inf"), 4)], 0.01),  # above every bound: the highest finite one
    (0.5, [(0.001, 0), (float("inf"), 0)], None),
    (0.5, [], None),
])
def test_quantile_reads_buckets_as_histogram_quantile_does(q: float, buckets: list[tuple[float, float]],
                                                           expected: float | None) -> None:
    assert quantile(q, buckets) == (None if expected is None else pytest.approx(expected))
