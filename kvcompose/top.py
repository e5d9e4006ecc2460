"""``kvcompose top URL``: a live view of one vLLM server's tiers, read from its /metrics/, no Prometheus needed.

Every ``--interval`` seconds (2 by default) it reads the server's ``/metrics/``
(with the slash: vLLM answers it with prometheus_client's own app, which
speaks OpenMetrics and so carries exemplars; ``/metrics`` never does) and
shows one row per tier, that is per pipeline child, in pipeline order,
summed over the server's engines:

- state: the child's circuit breaker (closed, open, half-open, stuck);
- hit: the share of lookups that found tokens in this tier, since the server started;
- load/s, save/s, load B/s, save B/s: transfers and bytes per second between the last two reads;
- copy and life p50/p99 per direction: the mover's copy time and the transfer's lifetime (issue to
  the engine learning of completion), read from the histogram buckets since the server started, the way
  Prometheus' histogram_quantile reads them;
- in flight: transfers started and not yet ended, loads/saves;
- slowest: the slowest transfer among the lifetime histogram's exemplars of the last 5 minutes, with
  its trace id.

Below it, where the pipeline counts tenants (``tenants.top_k``), one row per tenant label, busiest first:
prompt tokens, tokens the tiers loaded for it and prefill seconds that saved, per second between the
last two reads, and the share of its prompt tokens the tiers loaded since the server started.

``--once`` reads twice, ``--interval`` apart (1 s by default), prints one frame
and exits: status 1 when the server cannot be read or runs no kvcompose
pipeline. The live view needs ``rich`` (``pip install 'kvcompose[top]'``);
nothing here runs inside vLLM's process.
"""

from __future__ import annotations

import argparse
import math
import time
import urllib.error
import urllib.request
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from kvcompose.command_line import EXIT_FAILURE, Commands, refuse
from kvcompose.exposition import OPENMETRICS, Exposition, ExpositionError, quantile, read
from kvcompose.operations import DIRECTIONS

STATES = {0: "closed", 1: "open", 2: "half-open", 3: "stuck"}
RECENT_S = 300.0  # how old an exemplar may be to count as a recent transfer
LIVE_INTERVAL_S = 2.0
ONCE_INTERVAL_S = 1.0
# Servers running an earlier kvcompose name the lifetime histogram kvcompose_transfer_duration_seconds.
LIFETIME = ("kvcompose_transfer_lifetime_seconds", "kvcompose_transfer_duration_seconds")
COPY = "kvcompose_transfer_copy_seconds"
TENANT_PROMPT = "kvcompose_tenant_prompt_tokens_total"
TENANT_LOADED = "kvcompose_tenant_loaded_tokens_total"
TENANT_SAVED = "kvcompose_tenant_prefill_seconds_saved_total"
QUANTILES = (0.5, 0.99)


class ScrapeError(Exception):
    """The server could not be read, or holds no kvcompose series; the message is one line."""


def add_command(commands: Commands) -> None:
    top = commands.add_parser("top", help="watch one server's tiers live, from its /metrics/ (no Prometheus)",
                              description="A live per-tier view of one vLLM server running a kvcompose pipeline: "
                              "hit ratio, transfers and bytes per second, copy and lifetime p50/p99, in flight, "
                              "breaker state and the trace id of the slowest recent transfer; per tenant, prompt and loaded "
                              "tokens and prefill seconds saved per second.")
    top.add_argument("url", help="the vLLM server, e.g. http://127.0.0.1:8000 (its /metrics/ is read)")
    top.add_argument("--once", action="store_true", help="read twice, print one frame and exit (for scripts)")
    top.add_argument("--interval", type=float, metavar="SECONDS",
                     help=f"seconds between reads (default {LIVE_INTERVAL_S:g}; {ONCE_INTERVAL_S:g} with --once)")
    top.set_defaults(run=_top)


def metrics_url(url: str) -> str:
    """The OpenMetrics address of the server at ``url``: ``/metrics/`` unless another path is given."""
    parts = urlsplit(url if "://" in url else f"http://{url}")
    path = parts.path.rstrip("/")
    return urlunsplit((parts.scheme, parts.netloc, "/metrics/" if path in ("", "/metrics") else parts.path,
                       parts.query, ""))


@dataclass(frozen=True)
class Scrape(Exposition):
    """One read of a server's exposition, and when it was read."""

    at: float  # time.monotonic()


def parse(text: str, content_type: str, at: float) -> Scrape:
    """kvcompose's samples in an exposition served as ``content_type``: OpenMetrics (with exemplars) or the
    classic text format."""
    return Scrape(read(text, openmetrics=content_type.startswith(OPENMETRICS)).samples, at)


def scrape(url: str, timeout_s: float = 5.0) -> Scrape:
    request = urllib.request.Request(url, headers={"Accept": f"{OPENMETRICS}; version=1.0.0, text/plain;q=0.5"})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            text, content_type = response.read().decode(), response.headers.get("Content-Type", "")
    except urllib.error.HTTPError as error:
        raise ScrapeError(f"{url}: HTTP {error.code} {error.reason}") from None
    except (urllib.error.URLError, OSError) as error:
        reason = getattr(error, "reason", error)
        raise ScrapeError(f"{url}: cannot read: {reason}") from None
    try:
        return parse(text, content_type, time.monotonic())
    except ExpositionError as error:
        raise ScrapeError(f"{url}: {error}") from None


@dataclass
class TierRow:
    """One tier's figures in a frame; None where there is nothing to show yet."""

    name: str
    state: str | None = None
    hit_ratio: float | None = None
    per_second: dict[str, float | None] = field(default_factory=dict)  # transfers, by direction
    bytes_per_second: dict[str, float | None] = field(default_factory=dict)
    copy: dict[str, tuple[float | None, ...]] = field(default_factory=dict)  # p50, p99 by direction
    lifetime: dict[str, tuple[float | None, ...]] = field(default_factory=dict)
    in_flight: dict[str, int] = field(default_factory=dict)
    slowest: tuple[float, str] | None = None  # seconds, trace id


@dataclass(frozen=True)
class TenantRow:
    """One tenant label's figures in a frame: rates between the two reads; None where there is nothing yet."""

    name: str
    prompt_per_second: float | None
    loaded_per_second: float | None  # summed over the tiers
    saved_per_second: float | None  # prefill seconds per second
    loaded_share: float | None  # of its prompt tokens, loaded by a tier, since the server started


@dataclass(frozen=True)
class Frame:
    pipeline: str | None
    seconds: float  # between the two reads the rates cover
    rows: list[TierRow]
    tenants: list[TenantRow] = field(default_factory=list)


def frame(before: Scrape, now: Scrape, wall_clock: float | None = None) -> Frame:
    """The per-tier figures of the newest read ``now``, with rates since ``before``."""
    tiers = _tiers(now)
    if not tiers:
        raise ScrapeError("no kvcompose series: the server runs no kvcompose pipeline, or its metrics are off")
    lifetime = next((name for name in LIFETIME if f"{name}_count" in now.samples), LIFETIME[0])
    seconds = now.at - before.at
    wall_clock = time.time() if wall_clock is None else wall_clock
    rows = []
    for tier in tiers:
        row = TierRow(tier)
        states = now.series("kvcompose_child_state", connector=tier)
        if states:
            worst = int(max(sample.value for sample in states))
            row.state = STATES.get(worst, str(worst))
        hits, lookups = now.total("kvcompose_lookups_total", connector=tier, result="hit"), \
            now.total("kvcompose_lookups_total", connector=tier)
        row.hit_ratio = hits / lookups if lookups else None
        for direction in DIRECTIONS:
            labels = {"connector": tier, "direction": direction}
            row.per_second[direction] = _rate(before, now, f"{lifetime}_count", labels, seconds)
            row.bytes_per_second[direction] = _rate(before, now, "kvcompose_transfer_bytes_total", labels, seconds)
            row.copy[direction] = _quantiles(now.series(f"{COPY}_bucket", **labels))
            row.lifetime[direction] = _quantiles(now.series(f"{lifetime}_bucket", **labels))
            in_flight = now.series("kvcompose_transfers_in_flight", **labels)
            if in_flight:
                row.in_flight[direction] = int(sum(sample.value for sample in in_flight))
        row.slowest = _slowest(now.series(f"{lifetime}_bucket", connector=tier), wall_clock - RECENT_S)
        rows.append(row)
    info = now.series("kvcompose_pipeline_info")
    return Frame(info[0].labels.get("pipeline") if info else None, seconds, rows, _tenant_rows(before, now, seconds))


def _tenant_rows(before: Scrape, now: Scrape, seconds: float) -> list[TenantRow]:
    rows = []
    for tenant in {sample.labels["tenant"] for sample in now.series(TENANT_PROMPT)}:
        prompt, loaded = now.total(TENANT_PROMPT, tenant=tenant), now.total(TENANT_LOADED, tenant=tenant)
        rows.append(TenantRow(
            tenant, _rate(before, now, TENANT_PROMPT, {"tenant": tenant}, seconds),
            _rate(before, now, TENANT_LOADED, {"tenant": tenant}, seconds),
            _rate(before, now, TENANT_SAVED, {"tenant": tenant}, seconds),
            loaded / prompt if prompt else None))
    return sorted(rows, key=lambda row: (-(row.prompt_per_second or 0.0), row.name))


def _tiers(scrape: Scrape) -> list[str]:
    """The children in pipeline order, then any other child the series name."""
    positions: dict[str, int] = {}
    for sample in scrape.series("kvcompose_pipeline_info"):
        position = sample.labels.get("position", "")
        positions.setdefault(sample.labels["connector"], int(position) if position.isdigit() else math.inf)
    for name in ("kvcompose_lookups_total", "kvcompose_child_state", "kvcompose_transfer_bytes_total"):
        for sample in scrape.series(name):
            positions.setdefault(sample.labels["connector"], math.inf)
    return sorted(positions, key=lambda tier: (positions[tier], tier))


def _rate(before: Scrape, now: Scrape, name: str, labels: dict[str, str], seconds: float) -> float | None:
    if not now.series(name, **labels) or seconds <= 0:
        return None
    current, previous = now.total(name, **labels), before.total(name, **labels)
    return (current - previous if current >= previous else current) / seconds  # a restart resets counters


def _quantiles(bucket_samples: list[Any]) -> tuple[float | None, ...]:
    counts: dict[float, float] = defaultdict(float)  # summed over engines (and the copy time's sources)
    for sample in bucket_samples:
        counts[float(sample.labels["le"])] += sample.value
    return tuple(quantile(q, counts.items()) for q in QUANTILES)


def _slowest(bucket_samples: list[Any], since: float) -> tuple[float, str] | None:
    recent = [(sample.exemplar.value, sample.exemplar.labels.get("trace_id", "")) for sample in bucket_samples
              if sample.exemplar is not None
              and (sample.exemplar.timestamp is None or float(sample.exemplar.timestamp) >= since)]
    return max(recent, default=None)


# Presentation.

def _seconds(value: float | None) -> str:
    if value is None:
        return "-"
    if value < 1e-3:
        return f"{value * 1e6:.0f}us"
    return f"{value * 1e3:.3g}ms" if value < 1 else f"{value:.3g}s"


def _pair(values: tuple[float | None, ...] | None) -> str:
    return "-" if not values or values[0] is None else "/".join(_seconds(value) for value in values)


def _per_second(value: float | None) -> str:
    return "-" if value is None else f"{value:.3g}"


def _bytes(value: float | None) -> str:
    if value is None:
        return "-"
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if value >= size:
            return f"{value / size:.3g}{unit}"
    return f"{value:.3g}B"


COLUMNS = ("tier", "state", "hit", "load/s", "save/s", "load copy p50/p99", "load life p50/p99",
           "save copy p50/p99", "save life p50/p99", "load B/s", "save B/s", "in flight l/s", "slowest (trace)")


TENANT_COLUMNS = ("tenant", "prompt tok/s", "loaded tok/s", "saved s/s", "loaded share")


def tenant_cells(row: TenantRow) -> list[str]:
    """``row`` as the text of each of :data:`TENANT_COLUMNS`."""
    return [row.name, _per_second(row.prompt_per_second), _per_second(row.loaded_per_second),
            _per_second(row.saved_per_second), "-" if row.loaded_share is None else f"{row.loaded_share:.0%}"]


def cells(row: TierRow) -> list[str]:
    """``row`` as the text of each of :data:`COLUMNS`."""
    in_flight = "/".join(str(row.in_flight[d]) for d in DIRECTIONS) if row.in_flight else "-"
    slowest = f"{_seconds(row.slowest[0])} {row.slowest[1]}" if row.slowest else "-"
    return [row.name, row.state or "-", "-" if row.hit_ratio is None else f"{row.hit_ratio:.0%}",
            _per_second(row.per_second.get("load")), _per_second(row.per_second.get("save")),
            _pair(row.copy.get("load")), _pair(row.lifetime.get("load")),
            _pair(row.copy.get("save")), _pair(row.lifetime.get("save")),
            _bytes(row.bytes_per_second.get("load")), _bytes(row.bytes_per_second.get("save")), in_flight, slowest]


def _render(url: str, shown: Frame | None, problem: str | None) -> Any:
    from rich import box
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    title = f"kvcompose top  {url}"
    if shown is None:
        return Group(Text(title, style="bold"), Text(problem or "reading...", style="red" if problem else ""))
    title += f"  pipeline {shown.pipeline}" if shown.pipeline else ""
    table = Table(box=box.SIMPLE_HEAD, pad_edge=False)
    for column in COLUMNS:
        table.add_column(column, justify="left" if column in ("tier", "state", "slowest (trace)") else "right",
                         no_wrap=True)
    for row in shown.rows:
        table.add_row(*cells(row), style="bold red" if row.state in ("open", "stuck") else None)
    note = (f"rates over the last {shown.seconds:.1f} s; hit and p50/p99 since the server started; "
            f"slowest: exemplars of the last {RECENT_S / 60:.0f} min")
    parts: list[Any] = [Text(title, style="bold"), table]
    if shown.tenants:
        tenants = Table(box=box.SIMPLE_HEAD, pad_edge=False)
        for column in TENANT_COLUMNS:
            tenants.add_column(column, justify="left" if column == "tenant" else "right", no_wrap=True)
        for tenant in shown.tenants:
            tenants.add_row(*tenant_cells(tenant))
        parts.append(tenants)
    parts.append(Text(note, style="dim"))
    if problem:
        parts.append(Text(problem, style="red"))
    return Group(*parts)


def _top(args: argparse.Namespace) -> None:
    try:
        from rich.console import Console
        from rich.live import Live
    except ImportError:
        refuse("kvcompose top needs the rich package: pip install 'kvcompose[top]'", EXIT_FAILURE)
    url = metrics_url(args.url)
    interval = args.interval if args.interval is not None else ONCE_INTERVAL_S if args.once else LIVE_INTERVAL_S
    if not (interval > 0 and math.isfinite(interval)):
        refuse(f"--interval {args.interval}: expected a positive number of seconds")
    if args.once:
        try:
            before = scrape(url)
            time.sleep(interval)
            shown = frame(before, scrape(url))
        except ScrapeError as error:
            refuse(f"kvcompose top: {error}", EXIT_FAILURE)
        console = Console()
        if not console.is_terminal:
            console.width = 240  # a pipe gets whole rows, not rows wrapped at 80 columns
        console.print(_render(url, shown, None))
        return
    _watch(url, interval, Live(_render(url, None, None), console=Console(), auto_refresh=False))


def _watch(url: str, interval: float, live: Any) -> None:
    """Redraw every ``interval`` until interrupted; a failed read shows below the last good frame."""
    before: Scrape | None = None
    shown: Frame | None = None
    with live:
        try:
            while True:
                problem = None
                try:
                    now = scrape(url)
                    shown = frame(before or now, now)
                    before = now
                except ScrapeError as error:
                    problem = str(error)
                live.update(_render(url, shown, problem), refresh=True)
                time.sleep(interval)
        except KeyboardInterrupt:
            pass
