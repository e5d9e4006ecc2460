"""``kvcompose fleet``: the aggregator of a fleet's shared tiers, a small service.

It pulls each engine's fleet endpoint (kvcompose.economics.fleet_endpoint)
the way Prometheus scrapes: from a static list of targets (``--target``), or
from a Prometheus server's targets API (``--prometheus URL --job JOB``: the
active targets of the job that scrapes the engines' fleet endpoints). Every
``--interval`` it merges what came in time order and computes each shared
tier's hit ratio by size (kvcompose.economics.fleet_merge), and it serves on
its own ``/metrics`` (``--listen``):

- ``kvcompose_fleet_cache_size_hit_ratio{tier, size_blocks}``: the LRU hit
  ratio of a cache of that size on the fleet's interleaved stream to the tier;
- ``kvcompose_fleet_tier_capacity_blocks{tier}`` where known (``--capacity``
  or an engine's config), ``kvcompose_fleet_engines{tier}``,
  ``kvcompose_fleet_references_total{tier}`` and
  ``kvcompose_fleet_sampled_references_total{tier}``;
- ``kvcompose_fleet_keys_agree{tier}``: 0 when the engines naming the tier
  sample at different rates or their keys cannot agree (then it has no curve,
  and the log says which engines differ);
- ``kvcompose_fleet_tier_child_info{tier, connector}``: the child each engine
  names the tier by, so that ``kvcompose advise --fleet`` finds its value in
  the engines' own series;
- ``kvcompose_fleet_targets{state}``, ``kvcompose_fleet_pull_failures_total{reason}``,
  ``kvcompose_fleet_requests_lost_total`` (dropped by engines or never
  pulled) and ``kvcompose_fleet_late_requests_total``.

Out of the way: each pull runs on a pool's thread with a timeout, at most one
per target at a time; a slow or unreachable engine is counted and delays no
other pull and no merge. ``--once`` pulls every target once, merges all, prints
the figures as JSON and exits (status 2 for bad options, one line per problem).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor, wait
from typing import Any

from kvcompose.command_line import Commands, refuse
from kvcompose.economics.fleet_merge import DEFAULT_LATENESS_S, DEFAULT_MAX_SIZE_BLOCKS, FleetMerger
from kvcompose.logs import get_logger
from kvcompose.wire.fleet import MAX_BODY_BYTES, SAMPLES_PATH, FleetPayloadError, parse_batch

DEFAULT_INTERVAL_S = 15.0
DEFAULT_TIMEOUT_S = 5.0
DEFAULT_LISTEN = "0.0.0.0:8791"
DISCOVER_EVERY_S = 60.0
PULL_THREADS = 32
_log = get_logger("fleet")


class PullFailed(Exception):
    """A pull that brought nothing: ``reason`` is unreachable, timeout, http_error or bad_answer."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


def pull(target: str, after: int, timeout_s: float) -> bytes:
    """The body of ``target``'s answer to a pull of the samples past ``after``."""
    address = f"{target.rstrip('/')}{SAMPLES_PATH}?after={after}"
    try:
        with urllib.request.urlopen(address, timeout=timeout_s) as response:
            body = response.read(MAX_BODY_BYTES + 1)
    except urllib.error.HTTPError as error:
        raise PullFailed("http_error", f"HTTP {error.code}") from None
    except TimeoutError:
        raise PullFailed("timeout", f"no answer within {timeout_s:g} s") from None
    except (urllib.error.URLError, OSError) as error:
        reason = getattr(error, "reason", error)
        kind = "timeout" if isinstance(reason, TimeoutError) else "unreachable"
        raise PullFailed(kind, str(reason)[:120]) from None
    if len(body) > MAX_BODY_BYTES:
        raise PullFailed("bad_answer", f"over {MAX_BODY_BYTES} bytes")
    return body


def prometheus_targets(url: str, job: str, timeout_s: float) -> list[str]:
    """The base URLs of the active targets of ``job`` in a Prometheus server's targets API."""
    address = f"{url.rstrip('/')}/api/v1/targets?state=active"
    try:
        with urllib.request.urlopen(address, timeout=timeout_s) as response:
            body = json.load(response)
        targets = body["data"]["activeTargets"]
        found = []
        for target in targets:
            if target.get("labels", {}).get("job") == job:
                scrape = urllib.parse.urlsplit(target["scrapeUrl"])
                found.append(f"{scrape.scheme}://{scrape.netloc}")
    except (urllib.error.URLError, OSError, ValueError, KeyError, TypeError, AttributeError) as error:
        raise PullFailed("unreachable", f"{url}: not a Prometheus targets API answer: {str(error)[:120]}") from None
    return sorted(set(found))


class FleetService:
    """Pulls, merges and serves; see the module docstring."""

    def __init__(self, merger: FleetMerger, targets: Callable[[], list[str]], timeout_s: float = DEFAULT_TIMEOUT_S,
                 threads: int = PULL_THREADS) -> None:
        self.merger = merger
        self.timeout_s = timeout_s
        self.pull_failures: dict[str, int] = {}
        self._discover = targets
        self._targets: list[str] = []
        self._discovered_at = -math.inf
        self._lock = threading.Lock()  # the merger and the counters
        self._in_flight: set[str] = set()
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="kvcompose-fleet-pull")
        self._warned: dict[str, str] = {}
        self._disagreements: dict[str, str] = {}

    def round(self, now: float | None = None) -> list[Any]:
        """Start a pull of every target that has none in flight, and merge what is old enough; returns the
        pulls started (futures)."""
        started = self._start_pulls()
        self.merge(now)
        return started

    def _start_pulls(self) -> list[Any]:
        self._refresh_targets()
        started = []
        for target in self._targets:
            with self._lock:
                if target in self._in_flight:
                    continue
                self._in_flight.add(target)
                cursor, instance = self.merger.cursor(target), self.merger.engine(target).instance
            started.append(self._pool.submit(self._pull, target, cursor, instance))
        return started

    def merge(self, now: float | None = None) -> None:
        with self._lock:
            self.merger.merge(now)
            for tier in self.merger.known_tiers():
                message = self.merger.disagreement(tier)
                if message is not None and self._disagreements.get(tier) != message:
                    _log.error("fleet_keys_disagree", tier=tier, message=message)
                if message is None:
                    self._disagreements.pop(tier, None)
                else:
                    self._disagreements[tier] = message

    def _refresh_targets(self) -> None:
        if time.monotonic() - self._discovered_at < DISCOVER_EVERY_S:
            return
        try:
            self._targets = self._discover()
            self._discovered_at = time.monotonic()
        except PullFailed as error:
            self._count_failure(str(error), "discovery", error.reason)

    def _pull(self, target: str, cursor: int, instance: str | None) -> None:
        try:
            try:
                batch = parse_batch(pull(target, cursor, self.timeout_s))
                if cursor and batch.instance != instance:  # the engine restarted: its sequence began again
                    batch = parse_batch(pull(target, 0, self.timeout_s))
                with self._lock:
                    self.merger.add(target, batch)
                    self._warned.pop(target, None)
            except FleetPayloadError as error:
                raise PullFailed("bad_answer", str(error)) from None
        except PullFailed as error:
            self._count_failure(target, target, error.reason, str(error))
        finally:
            with self._lock:
                self._in_flight.discard(target)

    def _count_failure(self, key: str, target: str, reason: str, detail: str = "") -> None:
        with self._lock:
            self.pull_failures[reason] = self.pull_failures.get(reason, 0) + 1
            if target != "discovery":
                self.merger.failed(target, reason)
            if self._warned.get(key) != reason:  # once per target until it answers again
                self._warned[key] = reason
                _log.warning("fleet_pull_failed", target=target, reason=reason, detail=detail or key)

    def run_once(self) -> dict[str, Any]:
        """Pull every target once (each within the timeout), merge everything, and return the figures. Nothing
        is merged before every pull landed: with ``lateness_s`` 0 a merge between two pulls would put the second
        engine's requests after the first's, whatever their times."""
        wait(self._start_pulls(), timeout=self.timeout_s * 2 + 1)
        self.merge(math.inf)
        return self.summary()

    def serve_forever(self, interval_s: float, stop: threading.Event) -> None:
        while not stop.is_set():
            self.round()
            stop.wait(interval_s)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    # -- figures ---------------------------------------------------------------------------------------------

    def summary(self) -> dict[str, Any]:
        """The tiers' figures and the targets' state, as ``--once`` prints them."""
        with self._lock:
            merger = self.merger
            tiers = {}
            for tier in merger.known_tiers():
                state = merger.tiers.get(tier)
                tiers[tier] = {
                    "curve": [[size, ratio] for size, ratio in merger.curve(tier)],
                    "capacity_blocks": merger.capacity(tier),
                    "engines": len(merger.engines_of(tier)),
                    "children": sorted({engine.tiers[tier] for engine in merger.engines_of(tier)}),
                    "references": state.references if state else 0,
                    "sampled_references": state.sampled_references if state else 0,
                    "disagreement": merger.disagreement(tier),
                }
            targets = {engine.target: {"up": engine.up, "engine": engine.engine, "failures": dict(engine.failures),
                                       "lost_requests": engine.lost + engine.dropped}
                       for engine in merger.engines.values()}
            return {"tiers": tiers, "targets": targets, "pull_failures": dict(self.pull_failures),
                    "late_requests": merger.late_requests}

    def collect(self) -> Iterable[Any]:
        """prometheus_client's collector protocol: the series of the module docstring."""
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        figures = self.summary()
        ratio = GaugeMetricFamily("kvcompose_fleet_cache_size_hit_ratio", "Share of the fleet's block references "
                                  "to the tier an LRU cache of size_blocks blocks would serve (SHARDS over the "
                                  "engines' merged samples, decaying with a one-hour half-life).",
                                  labels=["tier", "size_blocks"])
        capacity = GaugeMetricFamily("kvcompose_fleet_tier_capacity_blocks", "Blocks the shared tier holds.",
                                     labels=["tier"])
        engines = GaugeMetricFamily("kvcompose_fleet_engines", "Engines seen naming the shared tier.",
                                    labels=["tier"])
        agree = GaugeMetricFamily("kvcompose_fleet_keys_agree", "1 when the engines naming the tier sample at one "
                                  "rate and their block keys agree; 0: no curve (the log says why).",
                                  labels=["tier"])
        child = GaugeMetricFamily("kvcompose_fleet_tier_child_info", "The child (connector label) engines name the "
                                  "shared tier by.", labels=["tier", "connector"])
        references = CounterMetricFamily("kvcompose_fleet_references", "Block references of the engines naming "
                                         "the tier, merged.", labels=["tier"])
        sampled = CounterMetricFamily("kvcompose_fleet_sampled_references", "Sampled block references merged into "
                                      "the tier's curve.", labels=["tier"])
        for tier, figure in figures["tiers"].items():
            for size, value in figure["curve"]:
                ratio.add_metric([tier, str(size)], value)
            if figure["capacity_blocks"] is not None:
                capacity.add_metric([tier], figure["capacity_blocks"])
            engines.add_metric([tier], figure["engines"])
            agree.add_metric([tier], 0 if figure["disagreement"] else 1)
            for name in figure["children"]:
                child.add_metric([tier, name], 1)
            references.add_metric([tier], figure["references"])
            sampled.add_metric([tier], figure["sampled_references"])
        targets = GaugeMetricFamily("kvcompose_fleet_targets", "Targets whose last pull succeeded (up) or failed.",
                                    labels=["state"])
        up = sum(1 for target in figures["targets"].values() if target["up"])
        targets.add_metric(["up"], up)
        targets.add_metric(["down"], len(figures["targets"]) - up)
        failures = CounterMetricFamily("kvcompose_fleet_pull_failures", "Pulls that brought nothing, by reason.",
                                       labels=["reason"])
        for reason, count in figures["pull_failures"].items():
            failures.add_metric([reason], count)
        lost = CounterMetricFamily("kvcompose_fleet_requests_lost", "Sampled requests the merge never got: dropped "
                                   "by an engine's full buffer or missed between pulls.")
        lost.add_metric([], sum(target["lost_requests"] for target in figures["targets"].values()))
        late = CounterMetricFamily("kvcompose_fleet_late_requests", "Sampled requests that came after their time "
                                   "was merged (past the lateness) and went in as they came.")
        late.add_metric([], figures["late_requests"])
        return [ratio, capacity, engines, agree, child, references, sampled, targets, failures, lost, late]


# -- the command -------------------------------------------------------------------------------------------------

def add_command(commands: Commands) -> None:
    fleet = commands.add_parser(
        "fleet", help="aggregate the engines' samples of shared tiers into fleet-wide hit-ratio curves on /metrics",
        description="Pull each engine's fleet endpoint, merge the samples in time order and serve each shared "
        "tier's hit ratio by size (kvcompose_fleet_cache_size_hit_ratio{tier,size_blocks}) on /metrics.")
    source = fleet.add_mutually_exclusive_group(required=True)
    source.add_argument("--target", action="append", metavar="URL",
                        help="an engine's fleet endpoint, e.g. http://10.0.0.7:8790 (repeat for each engine)")
    source.add_argument("--prometheus", metavar="URL", help="a Prometheus server whose targets API lists them")
    fleet.add_argument("--job", help="with --prometheus: the scrape job of the engines' fleet endpoints")
    fleet.add_argument("--listen", default=DEFAULT_LISTEN, metavar="HOST:PORT",
                       help=f"where to serve /metrics (default {DEFAULT_LISTEN})")
    fleet.add_argument("--interval", type=float, default=DEFAULT_INTERVAL_S, metavar="SECONDS",
                       help=f"seconds between pulls (default {DEFAULT_INTERVAL_S:g})")
    fleet.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S, metavar="SECONDS",
                       help=f"a pull's time limit (default {DEFAULT_TIMEOUT_S:g})")
    fleet.add_argument("--lateness", type=float, default=DEFAULT_LATENESS_S, metavar="SECONDS",
                       help=f"how long samples wait for slower engines' before merging (default "
                       f"{DEFAULT_LATENESS_S:g})")
    fleet.add_argument("--capacity", action="append", default=[], metavar="TIER=BLOCKS",
                       help="a shared tier's capacity in blocks (repeat per tier)")
    fleet.add_argument("--max-size-blocks", type=int, default=DEFAULT_MAX_SIZE_BLOCKS, metavar="BLOCKS",
                       help=f"the largest size the curves are read at (default {DEFAULT_MAX_SIZE_BLOCKS})")
    fleet.add_argument("--once", action="store_true", help="pull once, merge, print the figures as JSON and exit")
    fleet.set_defaults(run=_fleet)


def _fleet(args: argparse.Namespace) -> None:
    problems = []
    capacities: dict[str, int] = {}
    for item in args.capacity:
        tier, _, blocks = item.partition("=")
        if not tier or not blocks.isdigit() or int(blocks) < 1:
            problems.append(f"--capacity {item}: not TIER=BLOCKS with a positive whole number of blocks")
        else:
            capacities[tier] = int(blocks)
    host, _, port = args.listen.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        problems.append(f"--listen {args.listen}: not HOST:PORT")
    for name in ("interval", "timeout"):
        if not (getattr(args, name) > 0 and math.isfinite(getattr(args, name))):
            problems.append(f"--{name} {getattr(args, name)}: must be a positive number of seconds")
    if not (args.lateness >= 0 and math.isfinite(args.lateness)):
        problems.append(f"--lateness {args.lateness}: must be zero or more seconds")
    if args.max_size_blocks < 256:
        problems.append(f"--max-size-blocks {args.max_size_blocks}: must be at least 256")
    if args.prometheus is not None and not args.job:
        problems.append("--prometheus needs --job: the scrape job of the engines' fleet endpoints")
    for target in args.target or ():
        if urllib.parse.urlsplit(target).scheme not in ("http", "https"):
            problems.append(f"--target {target}: not an http(s) URL")
    if problems:
        refuse("\n".join(problems))
    merger = FleetMerger(args.max_size_blocks, args.lateness, capacities=capacities)
    static = list(dict.fromkeys(args.target or ()))
    service = FleetService(merger, (lambda: static) if static else (
        lambda: prometheus_targets(args.prometheus, args.job, args.timeout)), args.timeout)
    if args.once:
        sys.stdout.write(json.dumps(service.run_once(), indent=2) + "\n")
        service.close()
        return
    _serve(service, host, int(port), args.interval)


def _serve(service: FleetService, host: str, port: int, interval_s: float) -> None:
    from prometheus_client import CollectorRegistry, start_http_server

    registry = CollectorRegistry()
    registry.register(service)  # type: ignore[arg-type]
    try:
        start_http_server(port, addr=host, registry=registry)
    except OSError as error:
        refuse(f"--listen {host}:{port}: cannot listen: {error.strerror or error}")
    _log.info("fleet_listening", host=host, port=port)
    stop = threading.Event()
    try:
        service.serve_forever(interval_s, stop)
    except KeyboardInterrupt:
        stop.set()
    finally:
        service.close()
