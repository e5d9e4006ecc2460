"""Per-process recording of every child call: latency, errors and counters.

The composite asks :func:`metered` to wrap each child operation once at
start-up; the wrapper times the call, counts errors by type and, for the
operations listed in ``_RESULT_COUNTERS``, counts what the call meant
(a lookup hit or miss, tokens matched or loaded, blocks that failed to load).
``take`` hands the counts since the last call to vLLM's stats pipeline.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from time import perf_counter
from typing import Any

from kvcompose.metrics.histogram import BucketHistogram

COUNTERS = ("lookup_hits", "lookup_misses", "matched_tokens", "loaded_tokens", "load_error_blocks")

# Called once per layer per step: timed only with ``metrics.per_layer`` (about
# 1 us per call and child on a 2-core CPU, several times MultiConnector's own cost).
PER_LAYER_OPERATIONS: dict[str, str] = {
    "wait_for_layer_load": "wait_for_layer_load",
    "save_kv_layer": "save_kv_layer",
}

# Operations recorded, as they are named in Prometheus' ``op`` label.
OPERATION_LABELS: dict[str, str] = {
    "get_num_new_matched_tokens": "lookup",
    "update_state_after_alloc": "update_state_after_alloc",
    "build_connector_meta": "build_connector_meta",
    "request_finished": "request_finished",
    "request_finished_all_groups": "request_finished",
    "start_load_kv": "start_load_kv",
    "wait_for_save": "wait_for_save",
    "get_transfer_results": "get_transfer_results",
    "get_block_ids_with_load_errors": "get_block_ids_with_load_errors",
}


class ChildRecorder:
    """Counts for one child since the last :meth:`take`."""

    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = tuple(bounds)
        self.latency: dict[str, BucketHistogram] = {}
        self.errors: dict[str, dict[str, int]] = {}
        self.counters = dict.fromkeys(COUNTERS, 0)

    def histogram(self, op: str) -> BucketHistogram:
        if (histogram := self.latency.get(op)) is None:
            histogram = self.latency[op] = BucketHistogram(self.bounds)
        return histogram

    def count_error(self, op: str, error_type: str) -> None:
        by_type = self.errors.setdefault(op, {})
        by_type[error_type] = by_type.get(error_type, 0) + 1

    def take(self) -> dict[str, Any] | None:
        """The payload since the last take (None if nothing happened), then reset."""
        ops = {op: payload for op, h in self.latency.items() if (payload := h.take()) is not None}
        if not ops and not self.errors and not any(self.counters.values()):
            return None
        payload = {"ops": ops, "errors": self.errors, "counters": self.counters}
        self.errors = {}
        self.counters = dict.fromkeys(COUNTERS, 0)
        return payload


def _count_lookup(recorder: ChildRecorder, args: tuple[Any, ...], result: Any) -> None:
    tokens = result[0]
    if tokens is None:
        return
    if tokens > 0:
        recorder.counters["lookup_hits"] += 1
        recorder.counters["matched_tokens"] += tokens
    else:
        recorder.counters["lookup_misses"] += 1


def _count_loaded(recorder: ChildRecorder, args: tuple[Any, ...], result: Any) -> None:
    recorder.counters["loaded_tokens"] += args[2]


def _count_load_errors(recorder: ChildRecorder, args: tuple[Any, ...], result: Any) -> None:
    recorder.counters["load_error_blocks"] += len(result)


_RESULT_COUNTERS: dict[str, Callable[[ChildRecorder, tuple[Any, ...], Any], None]] = {
    "get_num_new_matched_tokens": _count_lookup,
    "update_state_after_alloc": _count_loaded,
    "get_block_ids_with_load_errors": _count_load_errors,
}


def metered(
    recorder: ChildRecorder, operation: str, call: Callable[..., Any], per_layer: bool = False
) -> Callable[..., Any]:
    """Wrap ``call`` to record its latency, errors and result counters.

    Operations outside ``OPERATION_LABELS`` (binding, shutdown, ...) and, unless
    ``per_layer``, the per-layer ones are returned unwrapped.
    """
    op = OPERATION_LABELS.get(operation) or (PER_LAYER_OPERATIONS.get(operation) if per_layer else None)
    if op is None:
        return call
    histogram = recorder.histogram(op)
    count_result = _RESULT_COUNTERS.get(operation)

    def observed(*args: Any, **kwargs: Any) -> Any:
        start = perf_counter()
        try:
            result = call(*args, **kwargs)
        except Exception as error:
            histogram.observe(perf_counter() - start)
            recorder.count_error(op, type(error).__name__)
            raise
        histogram.observe(perf_counter() - start)
        if count_result is not None:
            count_result(recorder, args, result)
        return result

    observed.__wrapped__ = call  # type: ignore[attr-defined]
    return observed


class PipelineRecorder:
    """One :class:`ChildRecorder` per child; does nothing when metrics are off."""

    def __init__(
        self, enabled: bool, bounds: Sequence[float], child_names: Sequence[str], per_layer: bool = False
    ) -> None:
        self.enabled = enabled
        self.per_layer = per_layer
        self.children = {name: ChildRecorder(bounds) for name in child_names} if enabled else {}

    def wrap(self, child_name: str, operation: str, call: Callable[..., Any]) -> Callable[..., Any]:
        return metered(self.children[child_name], operation, call, self.per_layer) if self.enabled else call

    def count_load_errors(self, child_name: str, blocks: int) -> None:
        """Blocks of a load kvcompose gave back to vLLM after the child failed."""
        if self.enabled:
            self.children[child_name].counters["load_error_blocks"] += blocks

    def take(self) -> dict[str, dict[str, Any]]:
        """Per-child payloads since the last take; children with nothing to say are left out."""
        return {name: payload for name, recorder in self.children.items() if (payload := recorder.take()) is not None}
