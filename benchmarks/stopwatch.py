"""Connector classes for the benchmark that keep a stopwatch on every call vLLM makes into them.

The end-to-end benchmark names ``kv_connector_module_path: benchmarks.stopwatch``
for MultiConnector and KVComposeConnector, and for their ExampleConnector
children, so vLLM (and kvcompose) load the same-named subclasses below (the
configured name stays, and with it vLLM's special handling of
"MultiConnector"), and each configuration also reports, in the same rounds as
its throughput, how long its engine spent inside the connector (scheduler and
worker side: ``ENGINE``), how much of that the children spent in their own
calls (``CHILDREN``), and how long the front-end spent putting the
connector's stats into Prometheus (``FRONT_END``). On a shared machine
throughput swings by 10% or more between rounds; the time spent in the
connector is far steadier, and it is what kvcompose adds. Steadier still is
the framework's part of it (the connector's time less its children's): the
children do the same work under either framework, yet two engines' children
(files on ``/dev/shm``, each process's luck with its caches) read tens of us
per prompt apart.

A call made from inside another timed call (``get_finished`` asks
``get_transfer_results``) counts once, in the outer one.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1 import example_connector as vllm_example_connector
from vllm.distributed.kv_transfer.kv_connector.v1 import multi_connector as vllm_multi_connector
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

from kvcompose import connectors as kvcompose_connectors
from kvcompose.operations import CONNECTOR_OPERATIONS
from kvcompose.tracing.outbox import THREAD_NAME as OUTBOX_THREAD


class Stopwatch:
    """Seconds spent in timed calls in this process since the last reset, in all and by call."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.by_call: dict[str, float] = {}
        self.running = False

    def reset(self) -> None:
        self.seconds = 0.0
        self.by_call = {}

    def time(self, call: Callable[..., Any], name: str | None = None) -> Callable[..., Any]:
        """``call`` on this stopwatch, its time counted under ``name`` (by default the call's own name)."""
        name = name or call.__name__

        def timed(*args: Any, **kwargs: Any) -> Any:
            if self.running:
                return call(*args, **kwargs)
            self.running = True
            start = time.perf_counter()
            try:
                return call(*args, **kwargs)
            finally:
                seconds = time.perf_counter() - start
                self.seconds += seconds
                self.by_call[name] = self.by_call.get(name, 0.0) + seconds
                self.running = False

        timed.stopwatch = self  # type: ignore[attr-defined]
        return timed


ENGINE = Stopwatch()
CHILDREN = Stopwatch()
FRONT_END = Stopwatch()


def _exporter_processes() -> list[Any]:
    """The span exporter processes this process started, directly or through its engine's processes (they are
    not their descendants: see kvcompose.tracing.export_process)."""
    import psutil  # a dependency of vLLM

    from tests.span_engine import exporter_pids

    found = []
    for engine in [psutil.Process(), *psutil.Process().children(recursive=True)]:
        for pid in exporter_pids(engine.pid):
            with contextlib.suppress(psutil.Error):
                found.append(psutil.Process(pid))
    return found


def exporter_cpu_s() -> float:
    """CPU seconds used so far by the span exporter processes (none without tracing); those that
    exited are no longer counted."""
    import psutil

    total = 0.0
    for exporter in _exporter_processes():
        with contextlib.suppress(psutil.Error, OSError):
            total += _cpu_s(exporter)
    return total


def _cpu_s(process: Any) -> float:
    """The process's CPU seconds: each thread's time on a CPU in ns where the kernel keeps it
    (``/proc/PID/task/TID/schedstat``); the 10 ms clock ticks of ``/proc/PID/stat`` (psutil) hid the
    exporter's few ms per round."""
    tasks = Path(f"/proc/{process.pid}/task")
    try:
        return sum(_thread_cpu_s(task) for task in tasks.iterdir())
    except (OSError, ValueError, IndexError):
        times = process.cpu_times()
        return times.user + times.system


def _thread_cpu_s(task: Path) -> float:
    return int((task / "schedstat").read_text().split()[0]) / 1e9


def outbox_thread_cpu_s() -> float:
    """CPU seconds used so far by this process's span outbox thread (it ships the spans: CPU of the engine's
    process, off the engine's thread); 0 where tracing never started one."""
    for thread in threading.enumerate():
        if thread.name == OUTBOX_THREAD and thread.native_id is not None:
            with contextlib.suppress(OSError, ValueError, IndexError):
                return _thread_cpu_s(Path(f"/proc/self/task/{thread.native_id}"))
    return 0.0


def timed_connector_class(base: type[KVConnectorBase_V1], stopwatch: Stopwatch = ENGINE) -> type[KVConnectorBase_V1]:
    """A same-named subclass of ``base`` whose every connector operation runs on ``stopwatch``, and its Prometheus
    update on ``FRONT_END``.

    Not KVConnectorBase_V1's own methods, which a class inherits: kvcompose leaves a child's inherited constant
    answer uncalled (``Operation.skip_inherited``) where MultiConnector calls it, and that call is the
    framework's cost, not the child's."""
    timed_operations = frozenset(
        operation for operation in CONNECTOR_OPERATIONS
        if operation != "shutdown" and getattr(base, operation, None) not in (None, getattr(KVConnectorBase_V1,
                                                                                           operation, None)))

    def build_prom_metrics(cls: type, *args: Any, **kwargs: Any) -> Any:
        metrics = base.build_prom_metrics.__func__(cls, *args, **kwargs)  # type: ignore[attr-defined]
        if metrics is not None:
            metrics.observe = FRONT_END.time(metrics.observe)
        return metrics

    namespace: dict[str, Any] = {operation: stopwatch.time(getattr(base, operation))
                                 for operation in timed_operations}
    namespace["build_prom_metrics"] = classmethod(build_prom_metrics)
    return type(base.__name__, (base,), namespace)


MultiConnector = timed_connector_class(vllm_multi_connector.MultiConnector)
KVComposeConnector = timed_connector_class(kvcompose_connectors.KVComposeConnector)
ExampleConnector = timed_connector_class(vllm_example_connector.ExampleConnector, CHILDREN)
