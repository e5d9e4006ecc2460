"""``kvcompose advise --metrics FILE``: the figures in one saved /metrics exposition.

A single exposition holds totals, not rates. Per second here means since the
server's process started: the totals over the time from
``process_start_time_seconds`` (which prometheus_client exports for the
process serving /metrics, vLLM's API server) to when the file was saved (its
modification time, or ``--at``). kvcompose's counters live in that process,
so they started with it. Where the exposition has no start time (vLLM with
several API server processes serves a multiprocess registry without one),
advise gives totals and ratios only; whether a tier is net negative is a
ratio of totals and needs no time.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvcompose.economics.observations import PROMPT_TOKENS, InputError, Observations, ObservationsBuilder
from kvcompose.exposition import ExpositionError, read

START_TIME = "process_start_time_seconds"


def read_exposition(text: str, source: str, saved_at: float) -> Observations:
    """The kvcompose figures in ``text`` (the classic text format or OpenMetrics), saved at ``saved_at``."""
    return read_expositions([(text, source, saved_at)])


def read_expositions(saved: Sequence[tuple[str, str, float]]) -> Observations:
    """The kvcompose figures of several engines' saved /metrics, each ``(text, source, saved_at)``: counters
    summed over them, gauges averaged, per second over the longest span among them (each server's counters
    cover its own span, so per-second figures of servers started at different times are approximate)."""
    collected, spans = [], []
    for text, source, saved_at in saved:
        try:
            # vLLM's prompt token samples are read untyped: in OpenMetrics their family keeps its colon and they
            # do not.
            samples = read(text, ("kvcompose_", START_TIME), untyped=PROMPT_TOKENS).samples
        except ExpositionError as error:
            raise InputError(f"{source}: {error}") from None
        if not any(name.startswith("kvcompose_") for name in samples):
            raise InputError(f"{source}: no kvcompose series: not a /metrics of a server running a kvcompose "
                             "pipeline")
        starts = [sample.value for sample in samples.get(START_TIME, ())]
        if starts and saved_at < min(starts):
            raise InputError(f"{source}: saved (at {saved_at:.0f}) before its server started ({min(starts):.0f}); "
                             "give the time it was saved with --at")
        spans.append(saved_at - min(starts) if starts else None)
        collected.append(samples)
    span = None if None in spans else max(spans, default=None)
    meaning = ("totals since the server started" + (f", {span:.0f} s before the file was saved" if span else "")
               + (" (no process_start_time_seconds: no per-second figures)" if span is None else ""))
    if len(saved) > 1:
        meaning = f"{len(saved)} servers' {meaning.replace('the server', 'each server')}"
    builder = ObservationsBuilder(", ".join(source for _, source, _ in saved), span, meaning)
    for samples in collected:
        for name, named in samples.items():
            for sample in named:
                builder.add(name, sample.labels, sample.value)
    return builder.build()
