"""Every operation of vLLM's KVConnectorBase_V1 (0.30-0.33), and what kvcompose does with each.

One :class:`Operation` per connector method: the composite, error isolation,
metrics and tracing all read these declarations, and nothing else, to decide
how a child's call is made, isolated, timed and traced. Imports no vLLM.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final, Literal

from kvcompose import names as attr


class Failed(enum.Enum):
    """The answer of an isolated call the composite must repair (a load that will not happen, ...)."""

    FAILED = "FAILED"

    def __repr__(self) -> str:
        return self.value


FAILED: Final = Failed.FAILED

CIRCUIT_OPEN = "kvcompose.circuit_open"  # error.type of a call skipped while the circuit is open


class CircuitOpen(Exception):
    """Raised in place of a call skipped while the child's circuit is open; isolation answers it."""


# Spans and logs name a failure by its class's qualified name: make that the documented error.type.
CircuitOpen.__module__, CircuitOpen.__qualname__ = CIRCUIT_OPEN.split(".")

# The two ways KV moves between the engine and a child: declared once, read by transfers, metrics, tracing and
# the economics.
Direction = Literal["load", "save"]
DIRECTIONS: Final[tuple[Direction, ...]] = ("load", "save")
# How a transfer ended.
Outcome = Literal["ok", "failed", "aborted"]

# A loader's answer to a lookup: (tokens it has, whether it loads them asynchronously).
LookupAnswer = tuple[int, bool]
# A request's last lookup round: one answer per loader, in pipeline order (FAILED_LOOKUP where its lookup failed).
LookupRound = list[LookupAnswer]
# What a failed lookup answers: no tokens. Made at run time, so that no answer a child returns is this
# very object: ``answer is FAILED_LOOKUP`` tells a failure from a miss the child reported.
FAILED_LOOKUP: Final[tuple[int, bool]] = tuple([0, False])  # type: ignore[assignment]


class Side(enum.Enum):
    SCHEDULER = "scheduler"
    WORKER = "worker"
    BOTH = "both"


class Granularity(enum.Enum):
    """How often vLLM makes the call."""

    REQUEST = "request"  # scheduler side, about one request (its first argument)
    STEP = "step"  # once per engine step
    LAYER = "layer"  # once per layer per step
    STARTUP = "startup"  # once, while the engine starts: never isolated
    OCCASIONAL = "occasional"  # on demand (cache reset, sleep, shutdown)


Describe = Callable[[tuple[Any, ...], Any], tuple[Any, ...]]


@dataclass(frozen=True)
class Operation:
    """A connector method, as kvcompose treats it."""

    name: str
    side: Side
    granularity: Granularity
    # The ``op`` label of its latency histogram and the suffix of its span name; None: not timed.
    # Per-layer operations are timed only with ``metrics.per_layer``.
    label: str | None = None
    traced: bool = False  # a span per call, in its request's trace or its step's (layer: at layer granularity)
    # Finds, loads or saves KV: its failures drive the circuit breaker, and the composite's own loops
    # isolate it (see kvcompose.connectors.isolation).
    data_path: bool = False
    fallback: Callable[[], Any] | None = None  # what an isolated failure answers; None: never isolated
    iterated: bool = False  # its result may be a generator, iterated (and isolated) after the call
    attributes: tuple[str, ...] = ()  # span attributes its arguments and result give
    describe: Describe | None = None  # (args, result) -> values of ``attributes`` (a None value is left out)
    keywords: bool = False  # vLLM's signature takes ``**kwargs``
    forwarded: bool = True  # the composite calls it on its children
    # Which children the composite calls: every one, or those with ``load`` / ``save`` set (MultiConnector
    # calls every child; a kvcompose child may be told not to load or save).
    children: Literal["all", "loaders", "savers"] = "all"
    hma_only: bool = False  # only connectors that support the hybrid KV cache manager have it
    # KVConnectorBase_V1's own implementation answers a constant (None, (), False) and changes nothing: a child
    # whose class inherits it is not called, the composite answering as if it had been. (The composite's loop
    # over the operation must not pair its calls with the children by position.)
    skip_inherited: bool = False
    # The forward pass waits for this call to return: its time is engine wait, of this direction.
    blocking: Direction | None = None
    # At request granularity a traced request's call makes a span only if it fails or is slow, unless this is set.
    always_traced: bool = False
    # Whether a returned answer settles the call, so that its earlier failures are forgotten; None: every answer
    # does. A lookup answering None tokens ("ask again later") has not settled anything yet.
    settles: Callable[[Any], bool] | None = None

    @property
    def span_name(self) -> str:
        return attr.span_name(self.label or self.name)


def _nothing() -> None:
    return None


def _failed() -> Failed:
    return FAILED


def _lookup(args: tuple[Any, ...], result: Any) -> tuple[Any, ...]:
    tokens, load_async = result
    return args[1], bool(load_async), tokens  # tokens None: the child is still looking; the tracer adds deferrals


def _lookup_settles(result: Any) -> bool:
    return result[0] is not None


def _after_alloc(args: tuple[Any, ...], result: Any) -> tuple[Any, ...]:
    return (args[2],)


def _finished(args: tuple[Any, ...], result: Any) -> tuple[Any, ...]:
    return len(args[1]), bool(result[0])


def _finished_all_groups(args: tuple[Any, ...], result: Any) -> tuple[Any, ...]:
    return sum(len(group) for group in args[1]), bool(result[0])


def _transfer_results(args: tuple[Any, ...], result: Any) -> tuple[Any, ...]:
    return len(result.finished_sending), len(result.finished_recving)


def _load_errors(args: tuple[Any, ...], result: Any) -> tuple[Any, ...]:
    return (len(result),)


def _layer(args: tuple[Any, ...], result: Any) -> tuple[Any, ...]:
    return (args[0],)


_S, _W, _BOTH = Side.SCHEDULER, Side.WORKER, Side.BOTH
_REQUEST, _STEP, _LAYER = Granularity.REQUEST, Granularity.STEP, Granularity.LAYER
_STARTUP, _OCCASIONAL = Granularity.STARTUP, Granularity.OCCASIONAL
_FINISHED = (attr.BLOCKS, attr.SAVE_ASYNC)

_DECLARED: tuple[Operation, ...] = (
    # ---- scheduler side ----
    Operation("get_num_new_matched_tokens", _S, _REQUEST, "lookup", traced=True, always_traced=True,
              data_path=True, fallback=lambda: FAILED_LOOKUP, children="loaders",
              attributes=(attr.COMPUTED_TOKENS, attr.LOAD_ASYNC, attr.MATCHED_TOKENS, attr.LOOKUP_DEFERRALS),
              describe=_lookup, settles=_lookup_settles),
    Operation("get_external_cache_hit_sources", _S, _REQUEST, traced=True, fallback=dict),
    Operation("get_loaded_kv_cache_group_ids", _S, _REQUEST, traced=True),
    Operation("update_state_after_alloc", _S, _REQUEST, "update_state_after_alloc", traced=True, data_path=True,
              fallback=_failed, attributes=(attr.EXTERNAL_TOKENS,), describe=_after_alloc),
    Operation("on_new_request", _S, _REQUEST, traced=True, fallback=_nothing),
    Operation("build_connector_meta", _S, _STEP, "build_connector_meta", fallback=_failed),
    Operation("update_connector_output", _S, _STEP, fallback=_nothing),
    Operation("request_finished", _S, _REQUEST, "request_finished", traced=True, data_path=True,
              fallback=lambda: (False, None), attributes=_FINISHED, describe=_finished),
    Operation("request_finished_all_groups", _S, _REQUEST, "request_finished", traced=True, data_path=True,
              fallback=lambda: (False, None), attributes=_FINISHED, describe=_finished_all_groups, hma_only=True),
    Operation("register_finished_partial_tail", _S, _REQUEST, traced=True),
    Operation("take_events", _S, _STEP, fallback=tuple, iterated=True, skip_inherited=True),
    Operation("has_pending_block_frees", _S, _STEP, fallback=lambda: False, skip_inherited=True),
    Operation("has_pending_push_work", _S, _STEP, fallback=lambda: False, skip_inherited=True),
    Operation("bind_kv_cache_manager", _S, _STARTUP),
    Operation("bind_gpu_block_pool", _S, _STARTUP),
    Operation("set_xfer_handshake_metadata", _S, _STARTUP),
    Operation("set_xfer_handshake_metadata_pp_aware", _S, _STARTUP),
    Operation("reset_cache", _S, _OCCASIONAL, fallback=lambda: False),
    Operation("get_kv_connector_stats", _BOTH, _STEP, fallback=_nothing, skip_inherited=True),
    # ---- worker side ----
    Operation("register_kv_caches", _W, _STARTUP),
    Operation("set_host_xfer_buffer_ops", _W, _STARTUP),
    Operation("get_mem_pool_context", _W, _STARTUP),
    Operation("bind_connector_metadata", _W, _STEP, fallback=_failed),
    Operation("clear_connector_metadata", _W, _STEP, fallback=_nothing),
    Operation("handle_preemptions", _W, _STEP, fallback=_nothing),
    Operation("start_load_kv", _W, _STEP, "start_load_kv", traced=True, data_path=True, fallback=_failed,
              keywords=True, children="loaders", blocking="load"),
    Operation("wait_for_layer_load", _W, _LAYER, "wait_for_layer_load", traced=True, data_path=True,
              fallback=_nothing, attributes=(attr.LAYER,), describe=_layer, children="loaders", blocking="load"),
    Operation("save_kv_layer", _W, _LAYER, "save_kv_layer", traced=True, data_path=True, fallback=_nothing,
              attributes=(attr.LAYER,), describe=_layer, keywords=True, children="savers", blocking="save"),
    Operation("wait_for_save", _W, _STEP, "wait_for_save", traced=True, data_path=True, fallback=_nothing,
              children="savers", blocking="save"),
    Operation("finish_forward", _W, _STEP, fallback=_nothing, skip_inherited=True),
    Operation("reset_capture_state", _W, _STEP, skip_inherited=True),
    # The composite asks get_transfer_results; get_finished is its older form.
    Operation("get_finished", _W, _STEP, forwarded=False),
    Operation("get_transfer_results", _W, _STEP, "get_transfer_results", traced=True, data_path=True,
              fallback=_failed, attributes=(attr.FINISHED_SENDING, attr.FINISHED_RECVING),
              describe=_transfer_results),
    Operation("get_block_ids_with_load_errors", _W, _STEP, "get_block_ids_with_load_errors", traced=True,
              data_path=True, fallback=_failed, attributes=(attr.BLOCKS,), describe=_load_errors),
    Operation("get_finished_count", _W, _STARTUP),
    Operation("get_handshake_metadata", _W, _STARTUP),
    Operation("build_connector_worker_meta", _W, _STEP, fallback=_nothing),
    # Like MultiConnector, the composite does not aggregate the children's differently typed events.
    Operation("get_kv_connector_kv_cache_events", _W, _STEP, forwarded=False),
    # ---- both ----
    Operation("shutdown", _BOTH, _OCCASIONAL),
    # ---- sleep mode (vLLM 0.33+), worker side ----
    Operation("unregister_kv_caches", _W, _OCCASIONAL),
    Operation("restore_kv_caches", _W, _OCCASIONAL),
)

OPERATIONS: Final[dict[str, Operation]] = {operation.name: operation for operation in _DECLARED}

# Every instance method a connector answers, scheduler and worker side.
CONNECTOR_OPERATIONS: Final = tuple(OPERATIONS)
# Every child method the composite calls.
CHILD_OPERATIONS: Final = tuple(operation.name for operation in _DECLARED if operation.forwarded)
HMA_OPERATIONS: Final = frozenset(operation.name for operation in _DECLARED if operation.hma_only)
# The ``op`` labels of the latency histograms, in a fixed order (it is part of the stats' wire format).
TIMED_LABELS: Final = tuple(dict.fromkeys(operation.label for operation in _DECLARED if operation.label))
