"""Cells into Prometheus histograms: each cell's calls observed inside their bucket, through ``observe`` only."""

from __future__ import annotations

from typing import Any

import pytest
from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.openmetrics.exposition import generate_latest as generate_openmetrics

from kvcompose.exposition import read
from kvcompose.metrics.histograms import TRACE_ID_LABEL, cell_adder

BOUNDS = (0.001, 0.01, 0.1)
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
# (bucket, calls, summed seconds) of a few cells, the last one over every bound.
CELLS = [(0, 3, 0.0021), (1, 40, 0.2), (2, 1, 0.05), (3, 2, 9.0)]


def _series(registry: CollectorRegistry) -> Any:
    histogram = Histogram("kvcompose_test_seconds", "test", ["connector"], buckets=BOUNDS, registry=registry)
    return histogram.labels("hot")


def _samples(registry: CollectorRegistry) -> dict[str, float]:
    """Every sample's value by name and bound, but the series' creation times."""
    return {name + sample.labels.get("le", ""): sample.value
            for name, samples in read(generate_latest(registry).decode()).samples.items()
            for sample in samples if not name.endswith("_created")}


def test_cells_export_their_calls_bucket_by_bucket_and_their_exact_sum() -> None:
    registry = CollectorRegistry()
    add = cell_adder(_series(registry), BOUNDS)
    for bucket, count, seconds in CELLS:
        add(bucket, count, seconds, None)
    samples = _samples(registry)
    # Cumulative buckets: 3 calls <= 1 ms, 43 <= 10 ms, 44 <= 100 ms, 46 in all.
    assert [samples[f"kvcompose_test_seconds_bucket{bound}"] for bound in ("0.001", "0.01", "0.1", "+Inf")] \
        == [3, 43, 44, 46]
    assert samples["kvcompose_test_seconds_count"] == 46
    assert samples["kvcompose_test_seconds_sum"] == pytest.approx(sum(seconds for _, _, seconds in CELLS))


def test_the_cells_bucket_carries_its_exemplar() -> None:
    registry = CollectorRegistry()
    cell_adder(_series(registry), BOUNDS)(1, 5, 0.02, (TRACE_ID, 0.004))
    exposition = generate_openmetrics(registry).decode()
    assert f'le="0.01"}} 5.0 # {{{TRACE_ID_LABEL}="{TRACE_ID}"}} 0.004' in exposition
    assert _samples(registry)["kvcompose_test_seconds_sum"] == pytest.approx(0.02)


class _Observed:
    """A histogram series that is not prometheus_client's (Ray's wrappers): only ``observe``."""

    def __init__(self) -> None:
        self.values: list[float] = []

    def observe(self, value: float, exemplar: dict[str, str] | None = None) -> None:
        self.values.append(value)


def test_any_series_with_observe_is_fed_one_observation_per_call_inside_the_bucket() -> None:
    series = _Observed()
    cell_adder(series, BOUNDS)(1, 4, 0.02, None)
    assert series.values == pytest.approx([0.005] * 4)


def test_a_mean_that_rounding_pushes_over_its_bound_stays_in_its_bucket() -> None:
    series = _Observed()
    cell_adder(series, BOUNDS)(1, 3, 0.03 + 1e-12, None)  # the mean lies a hair over 10 ms
    assert all(BOUNDS[0] < value <= BOUNDS[1] for value in series.values)
