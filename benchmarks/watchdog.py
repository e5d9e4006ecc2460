"""What the watchdog costs: its looks at the process's stacks, on a thread of its own.

The calls into children pay nothing for it (no clock read, no marker): the
watchdog's thread looks at every thread's stack every ``POLL_S``. What it costs
is that look, on its own thread, measured here with ``time.thread_time`` for
a worker-side composite of two children, in two states of the engine's thread:

- between calls into children (where an engine spends its time), its stack
  as deep as a vLLM engine core's in a forward pass;
- inside a call into a child (held in the child by a gate), which the look
  finds and follows.

The cost is the look's CPU time and, at the watchdog's rate, the share of a
core it takes.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from benchmarks.connectors import kvcompose_connector

ENGINE_STACK_DEPTH = 40  # frames: about an engine core's, from its busy loop into the model's forward
LOOKS = 2000
GATE = "benchmark-watchdog"


def _pipeline() -> dict[str, Any]:
    script = {"gates": {"wait_for_save": GATE}}
    return {
        "version": 1, "name": "bench", "metrics": {"enabled": True}, "logging": {"level": "ERROR"},
        "children": [{"name": f"c{index}", "connector": "RecordingConnector",
                      "module_path": "kvcompose.testing.recording",
                      "config": {"log": f"watchdog-bench-{index}", "script": script if index == 0 else {}}}
                     for index in range(2)],
    }


def _deep(depth: int, then: Any) -> None:
    """``then()``, called ``depth`` frames down."""
    if depth:
        _deep(depth - 1, then)
    else:
        then()


def _cpu_per_look_us(watchdog: Any) -> float:
    start = time.thread_time()
    for _ in range(LOOKS):
        watchdog.look(now=0.0)  # one instant: nothing runs "long", so nothing is logged
    return (time.thread_time() - start) / LOOKS * 1e6


def measure() -> dict[str, Any]:
    from kvcompose.connectors.watchdog import POLL_S, watchdog
    from kvcompose.testing.recording import GATES, Gate

    composite = kvcompose_connector(_pipeline(), "worker")
    dog = watchdog()
    result: dict[str, Any] = {"poll_s": POLL_S, "children": 2}

    idle, stop = threading.Event(), threading.Event()
    engine = threading.Thread(target=_deep, args=(ENGINE_STACK_DEPTH, lambda: (idle.set(), stop.wait())))
    engine.start()
    idle.wait()
    result["between_calls_us"] = _cpu_per_look_us(dog)
    stop.set()
    engine.join()

    GATES[GATE] = gate = Gate()
    engine = threading.Thread(target=_deep, args=(ENGINE_STACK_DEPTH, composite.wait_for_save))
    engine.start()
    gate.entered.wait()
    result["in_a_child_call_us"] = _cpu_per_look_us(dog)
    gate.open()
    engine.join()
    composite.shutdown()

    worst = max(result["between_calls_us"], result["in_a_child_call_us"])
    result["percent_of_a_core"] = worst / 1e6 / POLL_S * 100
    return result


def table(result: dict[str, Any]) -> str:
    return ("| engine thread | watchdog CPU per look (us) |\n| --- | --- |\n"
            f"| between calls into children | {result['between_calls_us']:.1f} |\n"
            f"| inside a call into a child | {result['in_a_child_call_us']:.1f} |\n\n"
            f"One look every {result['poll_s']} s: at most {result['percent_of_a_core']:.3f}% of a core, on the "
            "watchdog's own thread. The calls into children do nothing for it.")
