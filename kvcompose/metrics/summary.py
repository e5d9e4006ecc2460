"""A per-child summary of kvcompose's series in a Prometheus exposition."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from kvcompose.exposition import quantile, read


@dataclass
class ChildSummary:
    lookups: dict[str, float] = field(default_factory=lambda: defaultdict(float))  # result -> count
    matched_tokens: float = 0.0
    loaded_tokens: float = 0.0
    load_error_blocks: float = 0.0
    errors: dict[str, float] = field(default_factory=lambda: defaultdict(float))  # op -> failed calls
    breaker_opens: float = 0.0
    # op -> cumulative bucket counts by upper bound ("+Inf" last)
    latency_buckets: dict[str, dict[float, float]] = field(default_factory=lambda: defaultdict(dict))

    def latency(self, op: str, q: float) -> float | None:
        return quantile(q, self.latency_buckets[op].items())

    def calls(self, op: str) -> int:
        return int(max(self.latency_buckets[op].values(), default=0))


SUMMARIZED = frozenset({
    "kvcompose_lookups_total", "kvcompose_matched_tokens_total", "kvcompose_loaded_tokens_total",
    "kvcompose_load_error_blocks_total", "kvcompose_call_errors_total", "kvcompose_circuit_breaker_opens_total",
    "kvcompose_call_duration_seconds_bucket"})


def summarize(exposition: str) -> dict[str, ChildSummary]:
    """Sum kvcompose's series over engines and models, per child (``connector``)."""
    children: dict[str, ChildSummary] = defaultdict(ChildSummary)
    for name, samples in read(exposition).samples.items():
        for sample in samples:
            child = sample.labels.get("connector")
            if child is None or name not in SUMMARIZED:  # connector="gpu" is a capacity, not a child
                continue
            row = children[child]
            if sample.name == "kvcompose_lookups_total":
                row.lookups[sample.labels["result"]] += sample.value
            elif sample.name == "kvcompose_matched_tokens_total":
                row.matched_tokens += sample.value
            elif sample.name == "kvcompose_loaded_tokens_total":
                row.loaded_tokens += sample.value
            elif sample.name == "kvcompose_load_error_blocks_total":
                row.load_error_blocks += sample.value
            elif sample.name == "kvcompose_call_errors_total":
                row.errors[sample.labels["op"]] += sample.value
            elif sample.name == "kvcompose_circuit_breaker_opens_total":
                row.breaker_opens += sample.value
            elif sample.name == "kvcompose_call_duration_seconds_bucket":
                buckets = row.latency_buckets[sample.labels["op"]]
                bound = float(sample.labels["le"])
                buckets[bound] = buckets.get(bound, 0.0) + sample.value
    return dict(children)
