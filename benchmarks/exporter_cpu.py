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
from benchmarks.span_transport import SPANS_PER_REQUEST, TracedRequests
from benchmarks.stopwatch import exporter_cpu_s
from kvcompose.config import TracingSection
from kvcompose.tracing.shipping import ProcessShipper

TRACED_PER_S = 10
WARM_UP_S = 5.0
SETTLE_S = 3.0  # the exporter batches for up to 2 s


def measure(seconds: float) -> dict[str, float]:
    with Collector() as sink:
        shipper = ProcessShipper(TracingSection(enabled=True, endpoint=sink.endpoint), "0")
        requests = TracedRequests(shipper)

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
        spans = SPANS_PER_REQUEST * (requests.count - first)
        shipper.close()
    return {"spans": spans, "seconds": seconds, "cpu_share": cpu_s / seconds, "us_per_span": cpu_s / spans * 1e6,
            "exports": sink.exports}


def main() -> None:
    figures = measure(float(sys.argv[1]) if len(sys.argv) > 1 else 60.0)
    print(f"{figures['spans']} spans in {figures['seconds']:.0f} s: exporter CPU {100 * figures['cpu_share']:.3f}% "
          f"of a core, {figures['us_per_span']:.1f} us per span ({figures['exports']} exports)")


if __name__ == "__main__":
    main()
