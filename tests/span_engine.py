"""A stand-in engine process for exporter tests: ``python -m tests.span_engine ENDPOINT SPANS [FLUSH_S]``.

It ships SPANS span records through a real :class:`ProcessShipper` (so its
exporter process is its own, as an engine's is), prints ``shipped`` once the
outboxes' thread has handed them to the exporter and the exporter has read them,
and then waits to be killed;
a line on its stdin makes it close the shipper (a clean shutdown) and exit.
"""

from __future__ import annotations

import sys
import time

from kvcompose.config import TracingSection
from kvcompose.tracing.records import IDS, SpanRecord
from kvcompose.tracing.handover import EXPORTER_MODULE
from kvcompose.tracing.shipping import ProcessShipper

TEMPLATE = ("kvcompose.lookup", {"kvcompose.connector.name": "hot"}, ("kvcompose.tokens.matched",))


def records(shipper: ProcessShipper, count: int, trace_id: int) -> list[tuple]:
    template = shipper.templates.register(*TEMPLATE)
    now = time.time_ns()
    return [tuple(SpanRecord(template, trace_id, IDS.span_id(), 0, now, now + 1000, "r1", (index,)))
            for index in range(count)]


def main(endpoint: str, spans: int, flush_s: float) -> None:
    shipper = ProcessShipper(TracingSection(enabled=True, endpoint=endpoint, shutdown_flush_s=flush_s), "0")
    outbox = shipper.outbox()
    outbox.extend(records(shipper, spans, IDS.trace_id()))
    # Shipped, and read: the exporter has started, as a serving engine's long has.
    while not shipper._exporter or shipper._exporter.shipped < spans or shipper._exporter.unread():
        time.sleep(0.01)
    print("shipped", flush=True)
    sys.stdin.readline()
    shipper.release(outbox)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), float(sys.argv[3]) if len(sys.argv) > 3 else 2.0)


def exporter_pids(engine_pid: int) -> list[int]:
    """The exporter processes an engine process started (they are not its descendants: see
    kvcompose.tracing.export_process). Run as ``python -m``: the short-lived launcher that forks each one names
    the module too, as an argument of its ``-c`` code, and is not an exporter."""
    import psutil

    found = []
    for process in psutil.process_iter(["cmdline"]):
        command = process.info["cmdline"] or []
        if EXPORTER_MODULE in command and (at := command.index(EXPORTER_MODULE)) > 0 and command[at - 1] == "-m" \
                and command[at + 1] == str(engine_pid):
            found.append(process.pid)
    return found


def server_exporter_pids(server_pid: int) -> list[int]:
    """The exporter processes of a server's engine processes."""
    import psutil

    return [pid for process in psutil.Process(server_pid).children(recursive=True) for pid in exporter_pids(process.pid)]
