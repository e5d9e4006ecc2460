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

from prometheus_client.openmetrics.parser import text_string_to_metric_families as openmetrics_families
from prometheus_client.parser import text_string_to_metric_families as text_families

from kvcompose.economics.observations import PROMPT_TOKENS, InputError, Observations, ObservationsBuilder

START_TIME = "process_start_time_seconds"
_TYPED = ("kvcompose_", START_TIME)
# vLLM's prompt token samples are read untyped: in OpenMetrics their family keeps its colon and they do not.
_READ = (*_TYPED, *PROMPT_TOKENS)
_COMMENTS = tuple(f"# {kind} {prefix}" for kind in ("HELP", "TYPE", "UNIT") for prefix in _TYPED)


def read_exposition(text: str, source: str, saved_at: float) -> Observations:
    """The kvcompose figures in ``text`` (the classic text format or OpenMetrics), saved at ``saved_at``."""
    samples = _samples(text, source)
    if not any(name.startswith("kvcompose_") for name, _, _ in samples):
        raise InputError(f"{source}: no kvcompose series: not a /metrics of a server running a kvcompose pipeline")
    starts = [value for name, _, value in samples if name == START_TIME]
    if starts and saved_at < min(starts):
        raise InputError(f"{source}: saved (at {saved_at:.0f}) before its server started ({min(starts):.0f}); "
                         "give the time it was saved with --at")
    span = saved_at - min(starts) if starts else None
    meaning = ("totals since the server started" + (f", {span:.0f} s before the file was saved" if span else "")
               + (" (no process_start_time_seconds: no per-second figures)" if span is None else ""))
    builder = ObservationsBuilder(source, span, meaning)
    for name, labels, value in samples:
        builder.add(name, labels, value)
    return builder.build()


def _samples(text: str, source: str) -> list[tuple[str, dict[str, str], float]]:
    """The samples of the families advise reads. Only those lines are parsed: the OpenMetrics parser refuses
    a whole exposition for one family it finds fault with, in vLLM's own series among others."""
    openmetrics = any(line.strip() == "# EOF" for line in text.splitlines()[-3:])
    lines = [line for line in text.splitlines() if line.startswith(_READ) or line.startswith(_COMMENTS)]
    try:
        if openmetrics:
            families = list(openmetrics_families("\n".join([*lines, "# EOF"]) + "\n"))
        else:
            families = list(text_families("\n".join(lines) + "\n"))
    except ValueError as error:
        raise InputError(f"{source}: not a Prometheus exposition: {str(error)[:120]}") from None
    return [(sample.name, dict(sample.labels), float(sample.value)) for family in families for sample in family.samples]
