"""Cells into Prometheus histograms: in bulk where the series is prometheus_client's own, observed otherwise."""

from __future__ import annotations

from typing import Any

import pytest
from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.openmetrics.exposition import generate_latest as generate_openmetrics
from prometheus_client.parser import text_string_to_metric_families

from kvcompose.metrics.histograms import TRACE_ID_LABEL, adds_in_bulk, cell_adder, replay_cell

BOUNDS = (0.001, 0.01, 0.1)
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
# (bucket, calls, summed seconds) of a few cells, the last one over every bound.
CELLS = [(0, 3, 0.0021), (1, 40, 0.2), (2, 1, 0.05), (3, 2, 9.0)]


def _series(registry: CollectorRegistry) -> Any:
    histogram = Histogram("kvcompose_test_seconds", "test", ["connector"], buckets=BOUNDS, registry=registry)
    return histogram.labels("hot")


def test_prometheus_clients_histogram_is_added_to_in_bulk() -> None:
    """If a prometheus_client release hides the bucket values, this fails: cells would cost an observation
    per call again (correct, but the cost issue 16 removed)."""
    assert adds_in_bulk(_series(CollectorRegistry()), BOUNDS)


def test_a_cell_added_in_bulk_exports_what_its_calls_observed_one_by_one_would() -> None:
    bulk, replayed = CollectorRegistry(), CollectorRegistry()
    add, series = cell_adder(_series(bulk), BOUNDS), _series(replayed)
    for bucket, count, seconds in CELLS:
        add(bucket, count, seconds, None)
        replay_cell(series, BOUNDS, bucket, count, seconds)
    assert _samples(bulk) == pytest.approx(_samples(replayed))
    assert _samples(bulk)[("kvcompose_test_seconds_count", ())] == 46


def _samples(registry: CollectorRegistry) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample's value but the series' creation times."""
    return {(sample.name, tuple(sorted((k, v) for k, v in sample.labels.items() if k != "connector"))): sample.value
            for family in text_string_to_metric_families(generate_latest(registry).decode())
            for sample in family.samples if not sample.name.endswith("_created")}


def test_the_bulk_bucket_carries_its_exemplar() -> None:
    registry = CollectorRegistry()
    cell_adder(_series(registry), BOUNDS)(1, 5, 0.02, (TRACE_ID, 0.004))
    exposition = generate_openmetrics(registry).decode()
    assert f'le="0.01"}} 5.0 # {{{TRACE_ID_LABEL}="{TRACE_ID}"}} 0.004' in exposition


class _Observed:
    """A histogram series that is not prometheus_client's (Ray's wrappers): only ``observe``."""

    def __init__(self) -> None:
        self.values: list[float] = []

    def observe(self, value: float, exemplar: dict[str, str] | None = None) -> None:
        self.values.append(value)


def test_any_other_series_is_fed_one_observation_per_call_inside_the_bucket() -> None:
    series = _Observed()
    assert not adds_in_bulk(series, BOUNDS)
    cell_adder(series, BOUNDS)(1, 4, 0.02, None)
    assert series.values == pytest.approx([0.005] * 4)


def test_a_histogram_with_other_bounds_is_observed_rather_than_misfiled() -> None:
    other = Histogram("kvcompose_other_seconds", "test", buckets=(1.0, 2.0), registry=CollectorRegistry())
    assert not adds_in_bulk(other, BOUNDS)
