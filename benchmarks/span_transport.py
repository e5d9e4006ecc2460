"""Engine-process CPU of handing spans to the exporter: ``python -m benchmarks.span_transport [--baseline REV]``.

Stand-in engine processes ("subjects") append the span records of traced
requests (6 spans each: the request, two lookups, two saves, a transfer) to an
outbox at 60 and 600 spans/s, as a tracer does; the outboxes' thread ships
them through a real ``ProcessShipper`` to an exporter process, which exports
to the collector stand-in (``benchmarks/otlp_sink.py``). Each subject reports
its own CPU time per window (``time.process_time``: every thread), and apart
the part of it outside its main thread (the outboxes' thread and the
exporter's supervisor: the hand-over; the main thread makes the records, the
same work in every subject). The exporter processes' CPU is read by this
process (psutil: 10 ms ticks, summed over all windows).

Two identical twins of each source tree run side by side, at once: the
spread between twins is the noise a difference must beat. With
``--baseline REV`` the other tree is this repository's ``kvcompose`` at REV
(``git archive``), so that two designs of the hand-over compare in one run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any

REPOSITORY = Path(__file__).resolve().parents[1]
RATES = (60, 600)  # spans/s: 10 and 100 traced requests a second
SPANS_PER_REQUEST = 6
WARM_UP_S = 5.0  # the exporter's imports, and its first exports


def _child(name: str, index: int) -> dict[str, object]:
    return {"kvcompose.connector.name": name, "kvcompose.connector.index": index,
            "kvcompose.connector.class": "ExampleConnector", "kvcompose.role": "scheduler"}


class TracedRequests:
    """The span records of traced requests, as the engine records them (``shipper``: where their templates
    are registered)."""

    def __init__(self, shipper: Any) -> None:
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
        from kvcompose.tracing.records import IDS

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


def subject() -> None:
    """A stand-in engine process (``sys.argv``: endpoint, spans/s, windows, window seconds): prints ``warm``,
    then one JSON line per window."""
    from kvcompose.config import TracingSection
    from kvcompose.tracing.shipping import ProcessShipper

    endpoint, rate, windows, window_s = sys.argv[1], float(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
    shipper = ProcessShipper(TracingSection(enabled=True, endpoint=endpoint), "0")
    requests, outbox = TracedRequests(shipper), shipper.outbox()
    every_s = SPANS_PER_REQUEST / rate

    def traffic(seconds: float) -> None:
        due = time.monotonic()
        end = due + seconds
        while due < end:
            outbox.extend(requests.next())
            due += every_s
            time.sleep(max(0.0, due - time.monotonic()))

    traffic(WARM_UP_S)
    print("warm", flush=True)
    for _ in range(windows):
        process, main, first = time.process_time(), time.thread_time(), requests.count
        traffic(window_s)
        process, main = time.process_time() - process, time.thread_time() - main
        print(json.dumps({"cpu_s": process, "handover_s": process - main,
                          "spans": SPANS_PER_REQUEST * (requests.count - first)}), flush=True)
    shipper.release(outbox)


@contextmanager
def _source_tree(revision: str) -> Iterator[Path]:
    """This repository's ``kvcompose`` at ``revision``, in a directory of its own."""
    with tempfile.TemporaryDirectory(prefix="kvcompose-baseline-") as directory:
        archive = subprocess.run(["git", "archive", revision, "kvcompose"], cwd=REPOSITORY, check=True,
                                 capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", directory], input=archive, check=True)
        yield Path(directory)


def _run_rate(trees: dict[str, Path], endpoint: str, rate: int, windows: int, window_s: float) -> list[dict[str, Any]]:
    """Every tree's twins at once, at ``rate`` spans/s."""
    import psutil

    from tests.span_engine import exporter_pids

    env = {**os.environ, "PYTHONPATH": str(REPOSITORY)}  # benchmarks from here; kvcompose from the tree (cwd)
    runs = {}
    for label, tree in trees.items():
        for twin in "AB":
            runs[(label, twin)] = subprocess.Popen(
                [sys.executable, "-c", "from benchmarks.span_transport import subject; subject()", endpoint,
                 str(rate), str(windows), str(window_s)], cwd=tree, env=env, stdout=subprocess.PIPE, text=True)
    for process in runs.values():
        assert process.stdout is not None and process.stdout.readline() == "warm\n"
    exporters = {key: psutil.Process(exporter_pids(process.pid)[0]) for key, process in runs.items()}
    exporter_cpu = {key: sum(exporter.cpu_times()[:2]) for key, exporter in exporters.items()}
    lines = {key: [json.loads(process.stdout.readline()) for _ in range(windows)]  # type: ignore[union-attr]
             for key, process in runs.items()}
    rows = []
    for key, process in runs.items():
        exporter_s = sum(exporters[key].cpu_times()[:2]) - exporter_cpu[key]
        process.wait(30)
        spans = sum(window["spans"] for window in lines[key])
        per_span = [window["cpu_s"] / window["spans"] * 1e6 for window in lines[key]]
        handover = [window["handover_s"] / window["spans"] * 1e6 for window in lines[key]]
        rows.append({"tree": key[0], "twin": key[1], "spans_per_s": rate, "us_per_span": statistics.median(per_span),
                     "handover_us_per_span": statistics.median(handover),
                     "core_share": statistics.median(window["cpu_s"] for window in lines[key]) / window_s,
                     "exporter_us_per_span": exporter_s / spans * 1e6})
    return rows


def measure(baseline: str | None = None, windows: int = 5, window_s: float = 8.0) -> list[dict[str, Any]]:
    from benchmarks.request_life import Collector

    with Collector() as sink, (_source_tree(baseline) if baseline else nullcontext()) as baseline_tree:
        trees = {"this tree": REPOSITORY, **({f"at {baseline}": baseline_tree} if baseline_tree else {})}
        return [row for rate in RATES for row in _run_rate(trees, sink.endpoint, rate, windows, window_s)]


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| source | twin | spans/s | engine CPU us/span | of which hand-over threads | us per traced request | "
             "engine % of a core | exporter us/span |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    lines += [f"| {row['tree']} | {row['twin']} | {row['spans_per_s']} | {row['us_per_span']:.2f} | "
              f"{row['handover_us_per_span']:.2f} | {row['us_per_span'] * SPANS_PER_REQUEST:.1f} | "
              f"{100 * row['core_share']:.3f} | {row['exporter_us_per_span']:.1f} |" for row in rows]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", help="a git revision whose kvcompose runs side by side with this tree's")
    parser.add_argument("--windows", type=int, default=5)
    parser.add_argument("--window-s", type=float, default=8.0)
    arguments = parser.parse_args()
    began = time.monotonic()
    print(table(measure(arguments.baseline, arguments.windows, arguments.window_s)))
    print(f"\n({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {time.monotonic() - began:.0f} s, "
          f"{os.cpu_count()} cores; medians of {arguments.windows} windows of {arguments.window_s:.0f} s)")


if __name__ == "__main__":
    main()
