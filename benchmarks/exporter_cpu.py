"""The span exporter process's CPU at a realistic sampling rate: ``python -m benchmarks.exporter_cpu [SECONDS]``.

10% of 100 requests/s traced, 6 spans per traced request (the request, two lookups, two saves, one transfer):
60 spans/s, shipped ten times a second as the outboxes' thread does, through a real ProcessShipper to the
collector stand-in (``benchmarks/otlp_sink.py``) in a process of its own. The figure is the exporter process's
CPU time while it runs (``/proc/PID/task/*/schedstat``), after a warm-up that covers its imports.
"""

from __future__ import annotations

import sys
import time

from benchmarks.request_life import Collector
from benchmarks.stopwatch import exporter_cpu_s
from kvcompose.config import TracingSection
from kvcompose.tracing.records import IDS
from kvcompose.tracing.shipping import ProcessShipper

TRACED_PER_S = 10
WARM_UP_S = 5.0
SETTLE_S = 3.0  # the exporter batches for up to 2 s


def _child(name: str, index: int) -> dict[str, object]:
    return {"kvcompose.connector.name": name, "kvcompose.connector.index": index,
            "kvcompose.connector.class": "ExampleConnector", "kvcompose.role": "scheduler"}


class _Requests:
    """The span records of traced requests, as the engine records them."""

    def __init__(self, shipper: ProcessShipper) -> None:
        templates = shipper.templates
        self._request = templates.register("kvcompose.request", {"kvcompose.pipeline": "tiers"},
                                           ("kvcompose.load.connector",))
        self._lookups = [templates.register("kvcompose.lookup", _child(name, index), ("kvcompose.tokens.matched",))
                         for index, name in enumerate(("hot", "cold"))]
        self._saves = [templates.register("kvcompose.save", _child(name, index))
                       for index, name in enumerate(("hot", "cold"))]
        self._transfer = templates.register("kvcompose.transfer", _child("hot", 0), (
            "kvcompose.transfer.direction", "kvcompose.transfer.blocks", "kvcompose.transfer.bytes",
            "kvcompose.transfer.outcome"))
        self.count = 0

    def next(self) -> list[tuple]:
        trace, root, now = IDS.trace_id(), IDS.span_id(), time.time_ns()
        request_id = f"cmpl-{self.count:08d}-0"
        self.count += 1
        return [(self._request, trace, root, 0, now - 9_000_000, now, request_id, ("hot",), None, (), ()),
                *[(lookup, trace, IDS.span_id(), root, now - 8_000_000, now - 7_990_000, request_id, (128,), None,
                   (), ()) for lookup in self._lookups],
                *[(save, trace, IDS.span_id(), root, now - 5_000_000, now - 4_900_000, request_id, None, None, (),
                   ()) for save in self._saves],
                (self._transfer, trace, IDS.span_id(), root, now - 5_000_000, now - 3_000_000, request_id,
                 ("save", 3, 393216, "ok"), None, (), ())]


def measure(seconds: float) -> dict[str, float]:
    with Collector() as sink:
        shipper = ProcessShipper(TracingSection(enabled=True, endpoint=sink.endpoint), "0")
        requests = _Requests(shipper)

        def traffic(duration: float) -> None:
            began = time.monotonic()
            while time.monotonic() - began < duration:
                shipper.ship(requests.next())
                time.sleep(1 / TRACED_PER_S)

        traffic(WARM_UP_S)
        time.sleep(SETTLE_S)
        before, first = exporter_cpu_s(), requests.count
        traffic(seconds)
        time.sleep(SETTLE_S)
        cpu_s = exporter_cpu_s() - before
        spans = 6 * (requests.count - first)
        shipper.close()
    return {"spans": spans, "seconds": seconds, "cpu_share": cpu_s / seconds, "us_per_span": cpu_s / spans * 1e6,
            "exports": sink.exports}


def main() -> None:
    figures = measure(float(sys.argv[1]) if len(sys.argv) > 1 else 60.0)
    print(f"{figures['spans']} spans in {figures['seconds']:.0f} s: exporter CPU {100 * figures['cpu_share']:.3f}% "
          f"of a core, {figures['us_per_span']:.1f} us per span ({figures['exports']} exports)")


if __name__ == "__main__":
    main()
