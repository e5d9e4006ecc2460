"""Calls into children that run long, as the front-end shows them: live, while the engine's thread is stuck.

vLLM sends a connector's stats only after an engine step, so a call that hangs
also stops the stats that would report it. The engine's watchdog
(:mod:`kvcompose.connectors.watchdog`) sees such a call from a thread of
its own and publishes it on the engine's live board (:mod:`kvcompose.live`);
the front-end reads the board about every second and sets:

- ``kvcompose_calls_in_progress_seconds{connector, op}``: how long the oldest
  call of that child and operation has been running (seen at two looks of the
  watchdog or more, so at least a quarter of a second); 0 once it returns;
- ``kvcompose_child_state{connector}`` = 3 (stuck) while a call into the child
  has run past the pipeline's ``watchdog_s``; otherwise the worst circuit
  breaker state the engine's processes reported with their stats.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from functools import partial
from typing import Any

from prometheus_client import Gauge

from kvcompose.live import LiveView
from kvcompose.wire.telemetry import LIVE_RUNNING_CALLS

STUCK = 3  # kvcompose_child_state while a call into the child is stuck
ROLES = ("scheduler", "worker")


class RunningCallSeries:
    """The front-end's ``kvcompose_calls_in_progress_seconds`` and the stuck state of ``kvcompose_child_state``."""

    def __init__(
        self, metric_types: dict[type, type], labelnames: list[str], per_engine_labelvalues: dict[int, list[object]],
        children: Sequence[str], child_state: Any,
    ) -> None:
        """``labelnames``: vLLM's and the child's (``connector``); ``child_state``: the breaker state gauge."""
        self._labels = per_engine_labelvalues
        self._children = tuple(children)
        self._child_state = child_state
        self.in_progress = metric_types[Gauge](
            "kvcompose_calls_in_progress_seconds",
            "How long the oldest call into each child, by operation, has been running, while one runs long "
            "(read live from the engine's watchdog about every second); 0 when none does.",
            labelnames=[*labelnames, "op"],
            multiprocess_mode="max",
        )
        self._lock = threading.Lock()
        self._breakers: dict[tuple[int, str], int] = {}  # (engine, child) -> state the stats reported
        self._running: dict[tuple[int, str], dict[tuple[str, str], tuple[float, bool]]] = {}  # (engine, role) -> ...
        self._shown: set[tuple[int, str, str]] = set()  # (engine, child, op) shown above 0

    def subscribe(self, view: LiveView) -> None:
        for role in ROLES:
            view.subscribe(f"{LIVE_RUNNING_CALLS}.{role}", partial(self._reported, role))

    def breaker_reported(self, engine_idx: int, child: str, state: int) -> None:
        """The child's breaker state, from the engine's stats."""
        with self._lock:
            self._breakers[(engine_idx, child)] = state
            self._show(engine_idx)

    def _reported(self, role: str, engine_idx: int, values: list[Any]) -> None:
        """A role's running calls, one list per process of the engine that publishes them."""
        running: dict[tuple[str, str], tuple[float, bool]] = {}
        for process in values:
            for child, op, seconds, stuck in process:
                known = running.get((child, op), (0.0, False))
                running[(child, op)] = (max(known[0], seconds), known[1] or stuck)
        with self._lock:
            self._running[(engine_idx, role)] = running
            self._show(engine_idx)

    def _show(self, engine_idx: int) -> None:
        """Set the engine's gauges from what is known now (holding the lock)."""
        labels = self._labels[engine_idx]
        oldest: dict[tuple[str, str], float] = {}
        stuck: set[str] = set()
        for role in ROLES:
            for (child, op), (seconds, is_stuck) in self._running.get((engine_idx, role), {}).items():
                oldest[(child, op)] = max(oldest.get((child, op), 0.0), seconds)
                if is_stuck:
                    stuck.add(child)
        for engine, child, op in [key for key in self._shown if key[0] == engine_idx and key[1:] not in oldest]:
            self.in_progress.labels(*labels, child, op).set(0)
            self._shown.discard((engine, child, op))
        for (child, op), seconds in oldest.items():
            self.in_progress.labels(*labels, child, op).set(seconds)
            self._shown.add((engine_idx, child, op))
        for child in self._children:
            state = STUCK if child in stuck else self._breakers.get((engine_idx, child), 0)
            self._child_state.labels(*labels, child).set(state)
