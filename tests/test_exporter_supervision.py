"""The exporter process is watched: a death is seen at once, logged once, counted and repaired; and it outlives
its engine, so that what the engine shipped reaches the collector even when vLLM kills the engine's whole tree."""

from __future__ import annotations

import io
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvcompose.config import TracingSection
from kvcompose.logs import ROOT_LOGGER, get_logger
from kvcompose.testing.otlp_receiver import SpanReceiver
from kvcompose.tracing.export_process import ENGINE_END_WAIT_S
from kvcompose.tracing.records import IDS
from kvcompose.tracing.shipping import FIRST_RESTART_S, ProcessShipper

from .served_tracing import kvcompose_files_of
from .span_engine import exporter_pids, records
from .span_support import wait_until

REPOSITORY = Path(__file__).resolve().parents[1]
FLUSH_S = 2.0


@pytest.fixture
def kvcompose_log() -> Iterator[io.StringIO]:
    """What kvcompose logs in this process meanwhile."""
    get_logger("test")  # installs kvcompose's own handler
    (handler,) = [h for h in logging.getLogger(ROOT_LOGGER).handlers if type(h) is logging.StreamHandler]
    sink = io.StringIO()
    previous = handler.setStream(sink)
    yield sink
    handler.setStream(previous)


def _exporter_pid(shipper: ProcessShipper) -> int:
    exporter = shipper._exporter
    assert exporter is not None
    wait_until(lambda: exporter.pid is not None)
    assert exporter.pid is not None
    return exporter.pid


def _ended(pid: int) -> bool:
    """The process has exited (an orphan stays a zombie where the container's first process reaps nothing)."""
    import psutil

    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_a_killed_exporter_is_logged_once_restarted_and_every_span_is_delivered_or_counted(
    kvcompose_log: io.StringIO,
) -> None:
    receiver = SpanReceiver()
    shipper = ProcessShipper(TracingSection(enabled=True, endpoint=receiver.endpoint), "0")
    sent = 0
    try:
        shipper.ship(records(shipper, 200, IDS.trace_id()))
        sent += 200
        wait_until(lambda: shipper.queued() == 0, timeout_s=10)  # exported, and counted as such
        shipper.ship(records(shipper, 100, IDS.trace_id()))  # read at once (the exporter sleeps), then queued
        sent += 100                                         # for a batch: it dies with them
        exporter = shipper._exporter
        assert exporter is not None
        wait_until(lambda: not exporter.unread())
        first = _exporter_pid(shipper)
        os.kill(first, signal.SIGKILL)
        for _ in range(10):  # while it is dead, and while its replacement waits and starts
            shipper.ship(records(shipper, 20, IDS.trace_id()))
            sent += 20
            time.sleep(0.05)
        second = _exporter_pid(shipper)
        assert second != first
        report = shipper.telemetry()
        assert report is not None and report.exporter_restarts == 1
        lost = report.dropped.get("exporter_down", 0)
        assert set(report.dropped) <= {"exporter_down"}
        shipper.close()
        wait_until(lambda: len(receiver.spans()) >= sent - lost, timeout_s=10)
        received = receiver.spans()
    finally:
        shipper.close()
        receiver.stop()

    # Every span either reached the collector (by the new exporter: the templates were sent to it again, so
    # every span has its name) or was counted, once.
    assert lost == 100 and len(received) == sent - lost == 400
    assert {span.name for span in received} == {"kvcompose.lookup"}
    assert len({span.span_id for span in received}) == len(received)
    lines = [line for line in kvcompose_log.getvalue().splitlines() if "span_exporter_died" in line]
    assert len(lines) == 1 and f"pid={first}" in lines[0] and f"spans_lost={lost}" in lines[0], lines


def test_an_exporter_that_cannot_start_is_retried_with_growing_delays_and_logged_once(
    kvcompose_log: io.StringIO, monkeypatch: pytest.MonkeyPatch,
) -> None:
    receiver = SpanReceiver()
    monkeypatch.setenv("PYTHONHOME", "/nonexistent")  # the exporter's interpreter dies at start
    shipper = ProcessShipper(TracingSection(enabled=True, endpoint=receiver.endpoint), "0")
    restarts = 0
    try:
        shipper.ship(records(shipper, 5, IDS.trace_id()))
        began = time.monotonic()

        def restarted_three_times() -> bool:
            nonlocal restarts
            if (report := shipper.telemetry()) is not None:
                restarts += report.exporter_restarts
            return restarts >= 3

        wait_until(restarted_three_times, timeout_s=30, poll_s=0.05)
        elapsed = time.monotonic() - began
        monkeypatch.delenv("PYTHONHOME")  # the next attempt starts
        wait_until(lambda: len(receiver.spans()) == 5, timeout_s=30)
    finally:
        shipper.close()
        receiver.stop()
    # 0.5 + 1 + 2 s of back-off before the third restart (and each failed start's own time)
    assert elapsed >= 3.5 * FIRST_RESTART_S / 0.5
    lines = [line for line in kvcompose_log.getvalue().splitlines() if "span_exporter_died" in line]
    assert len(lines) == 1, lines


def test_the_exporter_outlives_an_engine_killed_with_its_process_tree() -> None:
    """vLLM's SIGTERM handling under `vllm serve` SIGKILLs every descendant of the engine, then the engine
    (vllm.utils.system_utils.kill_process_tree): what the engine shipped still reaches the collector, within the
    flush time, and no file of its is left in /dev/shm."""
    from vllm.utils.system_utils import kill_process_tree

    receiver = SpanReceiver()
    engine = subprocess.Popen([sys.executable, "-m", "tests.span_engine", receiver.endpoint, "300", str(FLUSH_S)],
                              cwd=REPOSITORY, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert engine.stdout is not None and engine.stdout.readline() == b"shipped\n"
        (exporter,) = exporter_pids(engine.pid)
        kill_process_tree(engine.pid)
        engine.wait()
        # The exporter stops sending at the end of its flush time: every span that arrives arrived within it.
        wait_until(lambda: len(receiver.spans()) == 300, timeout_s=FLUSH_S + 30)
        wait_until(lambda: not exporter_pids(engine.pid), timeout_s=FLUSH_S + 5)
    finally:
        engine.kill()
        receiver.stop()
    assert kvcompose_files_of([engine.pid, exporter]) == set()
    assert _ended(exporter)


def test_close_returns_at_once_and_the_exporter_counts_what_an_unanswering_collector_did_not_take(
    kvcompose_log: io.StringIO,
) -> None:
    """vLLM gives an engine process seconds to shut down: close() does not wait for the exporter, which exports
    for at most its flush time on its own and accounts for every span it could not send."""
    with socket.socket() as collector:  # accepts connections and never answers
        collector.bind(("127.0.0.1", 0))
        collector.listen(64)
        endpoint = f"http://127.0.0.1:{collector.getsockname()[1]}"
        shipper = ProcessShipper(TracingSection(enabled=True, endpoint=endpoint, shutdown_flush_s=1.0), "0")
        shipper.ship(records(shipper, 50, IDS.trace_id()))
        exporter = _exporter_pid(shipper)
        began = time.monotonic()
        shipper.close()
        assert not _ended(exporter)  # close() left it exporting on its own (for 1 s, then it waits for us)
        dropped: dict[str, int] = {}

        def settled() -> bool:
            if (report := shipper.telemetry()) is not None:
                for reason, spans in report.dropped.items():
                    dropped[reason] = dropped.get(reason, 0) + spans
            return bool(dropped)

        wait_until(settled, timeout_s=30)  # counted once its flush time is over
        assert dropped == {"shutdown": 50} and shipper.queued() == 0
        assert time.monotonic() - began >= 1.0  # it tried for its whole flush time
        wait_until(lambda: _ended(exporter), timeout_s=ENGINE_END_WAIT_S + 5)  # it waits for its engine's end
        assert shipper.telemetry() is None  # its counts were reported once, not again when it ended
    lines = [line for line in kvcompose_log.getvalue().splitlines() if "spans_lost_at_shutdown" in line]
    assert lines == [], "the exporter logs what it lost itself (its own stderr), the engine does not repeat it"
