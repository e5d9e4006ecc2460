"""The router prediction series the front-end makes of the scheduler's reports (kvcompose.wire.routing)."""

from __future__ import annotations

from typing import Any

from prometheus_client import Counter

from kvcompose.wire.routing import RoutingReport

# Each counter: its name, its help, and the RoutingReport field it adds.
ROUTING_COUNTERS: tuple[tuple[str, str, str], ...] = (
    ("kvcompose_router_predictions_total",
     "Finished requests that carried a valid router prediction of their cached prompt tokens.", "predictions"),
    ("kvcompose_router_predicted_tokens_total",
     "The prompt tokens routers predicted the engine held, over the requests with a valid prediction.",
     "predicted_tokens"),
    ("kvcompose_router_reused_tokens_total",
     "The prompt tokens those requests reused: served by the GPU prefix cache plus loaded by a child (failed loads "
     "excluded).", "reused_tokens"),
    ("kvcompose_router_overpredicted_tokens_total",
     "The sum over those requests of max(predicted - reused, 0): tokens the router expected and the engine did not "
     "have.", "overpredicted_tokens"),
    ("kvcompose_router_underpredicted_tokens_total",
     "The sum over those requests of max(reused - predicted, 0): tokens the engine had beyond the router's "
     "prediction.", "underpredicted_tokens"),
    ("kvcompose_router_predictions_invalid_total",
     "Requests whose prediction was not an integer from 0 to the prompt's length (ignored otherwise).", "invalid"),
)


class RoutingSeries:
    """The front-end's router prediction counters, per engine."""

    def __init__(self, metric_types: dict[type, type], labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]) -> None:
        self._labels = per_engine_labelvalues
        self._counters: list[tuple[Any, str]] = [
            (metric_types[Counter](name, documentation, labelnames=labelnames), field)
            for name, documentation, field in ROUTING_COUNTERS]
        for labels in per_engine_labelvalues.values():  # each starts at 0, so its first increase shows
            for counter, _ in self._counters:
                counter.labels(*labels)

    def observe(self, report: RoutingReport, engine_idx: int) -> None:
        labels = self._labels[engine_idx]
        for counter, field in self._counters:
            if amount := getattr(report, field):
                counter.labels(*labels).inc(amount)
