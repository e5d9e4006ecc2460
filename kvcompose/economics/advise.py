"""``kvcompose advise``: what each tier is worth, and what it would be worth at another size.

Reads a saved /metrics (``--metrics FILE``, no Prometheus needed) or a
Prometheus server (``--prometheus URL --since 6h``) and prints, per tier: hit
ratio, tokens served per second, prefill seconds saved per second net of the
engine wait the tier caused, copy p99 and throughput, the size where the
hit-ratio curve reaches 90% of its ceiling, the marginal hit ratio per extra
GiB, write waste and the tokens the load policy left behind, with advice
that states the figures behind it (kvcompose.economics.advice). With
``--by-tenant``, per tenant label too: prompt tokens, tokens served and
seconds saved by each tier, and the tenant's hit ratio at each tier's size.
Several engines' saved /metrics (``--metrics`` repeated) are summed.
``--fleet`` adds the shared tiers, by ``kvcompose fleet``'s curves and their
value summed over the engines (kvcompose.economics.fleet_advice).

Exit status: 0; 1 when a tier is net negative (it saved less prefill time
than the engine waited on it), so the command can gate a rollout, and for
nothing else (without a known prefill cost per token no tier is judged); 2
when the input cannot be advised on (a bad option, a file that is not a
kvcompose /metrics, a Prometheus that does not answer), one line per
problem. Nothing here imports vLLM or numpy.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import asdict
from datetime import datetime
from pathlib import Path
from typing import Any

from kvcompose.command_line import Commands, refuse
from kvcompose.economics.advice import Advice, TierAdvice, advise, gib_text
from kvcompose.economics.fleet_advice import advise_shared, read_fleet, read_fleet_source, shared_lines
from kvcompose.economics.observations import InputError, Observations

EXIT_NET_NEGATIVE = 1
DEFAULT_SINCE = "6h"


def add_command(commands: Commands) -> None:
    advise = commands.add_parser(
        "advise", help="per-tier value and sizing advice from a saved /metrics or Prometheus; exit 1 if a tier "
        "is net negative", description="Per tier: hit ratio, tokens served per second, prefill seconds saved per "
        "second net of the engine wait the tier caused, copy p99 and throughput, the size where the hit-ratio "
        "curve reaches 90% of its ceiling, the marginal hit ratio per extra GiB, write waste and the tokens the "
        "load policy left behind, with advice stating the figures behind it. Exit status 1 when a tier is net "
        "negative (for nothing else; no tier is judged while the engine's prefill cost per token is not known), 2 "
        "when the input cannot be advised on.")
    source = advise.add_mutually_exclusive_group(required=True)
    source.add_argument("--metrics", type=Path, metavar="FILE", action="append",
                        help="a saved /metrics exposition; per second means since the server started (repeat for "
                        "each engine: counters are summed over them)")
    source.add_argument("--prometheus", metavar="URL", help="a Prometheus server scraping the vLLM servers")
    advise.add_argument("--since", metavar="DURATION",
                        help=f"with --prometheus: the window to read, e.g. 6h, 90m, 2d (default {DEFAULT_SINCE})")
    advise.add_argument("--at", metavar="TIME",
                        help="with --prometheus, the end of the window (default now); with --metrics, when the "
                        "file was saved (default its modification time): Unix seconds or ISO 8601")
    advise.add_argument("--fleet", metavar="FILE|URL",
                        help="also advise on the shared tiers by kvcompose fleet's /metrics (a saved file or its URL): "
                        "each one's fleet-wide curve, and its value summed over the engines")
    advise.add_argument("--json", action="store_true", help="print the figures and advice as JSON")
    advise.add_argument("--by-tenant", action="store_true",
                        help="also per tenant (pipelines with tenants.top_k): prompt tokens, tokens served and "
                        "seconds saved by each tier, and the tenant's hit ratio at each tier's size")
    advise.set_defaults(run=_advise)


def _advise(args: argparse.Namespace) -> None:
    try:
        observations = _read(args)
        fleet = read_fleet(read_fleet_source(args.fleet), args.fleet) if args.fleet is not None else None
    except InputError as error:
        refuse(str(error))
    advice = advise(observations)
    shared = advise_shared(fleet, observations, advice.cost_known) if fleet is not None else []
    if args.json:
        figures = as_json(advice, args.by_tenant)
        if fleet is not None:
            figures["shared_tiers"] = _finite([asdict(tier) for tier in shared])
            figures["net_negative"] = figures["net_negative"] + [tier.tier for tier in shared if tier.net_negative]
        sys.stdout.write(json.dumps(figures, indent=2) + "\n")
    else:
        shared_text = "".join(line + "\n" for line in shared_lines(shared, args.fleet))
        sys.stdout.write(as_text(advice, args.by_tenant) + shared_text)
    if advice.net_negative or any(tier.net_negative for tier in shared):
        raise SystemExit(EXIT_NET_NEGATIVE)


def _read(args: argparse.Namespace) -> Observations:
    # The readers import prometheus_client's parsers: only this command pays for them.
    from kvcompose.economics.exposition import read_expositions
    from kvcompose.economics.promql import parse_duration, read_prometheus

    problems = []
    at = window_s = None
    if args.at is not None:
        try:
            at = _parse_time(args.at)
        except ValueError:
            problems.append(f"--at {args.at}: not a time: give Unix seconds or ISO 8601 (2026-11-26T18:00:00+00:00)")
    if args.metrics is not None and args.since is not None:
        problems.append("--since applies to --prometheus: a saved /metrics holds totals since its server started")
    if args.prometheus is not None:
        try:
            window_s = parse_duration(args.since or DEFAULT_SINCE)
        except InputError as error:
            problems.append(str(error))
    saved = []
    for path in args.metrics or ():
        try:
            saved.append((path.read_text(), str(path), path.stat().st_mtime if at is None else at))
        except (OSError, UnicodeDecodeError) as error:
            problems.append(f"{path}: cannot read: {getattr(error, 'strerror', None) or error}")
    if problems:
        refuse("\n".join(problems))
    if args.metrics is not None:
        return read_expositions(saved)
    return read_prometheus(args.prometheus, window_s, time.time() if at is None else at)


def _parse_time(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        moment = datetime.fromisoformat(text)
        if moment.tzinfo is None:
            raise ValueError(text) from None  # a time without its zone is ambiguous
        return moment.timestamp()


# -- output -----------------------------------------------------------------------------------------------------

def as_json(advice: Advice, by_tenant: bool = False) -> dict[str, Any]:
    curve = advice.curve
    tenants = {"tenants": [asdict(tenant) for tenant in advice.tenants]} if by_tenant else {}
    return _finite({
        "source": advice.source, "span_s": advice.span_s, "span": advice.span_meaning,
        "gpu_blocks": advice.gpu_blocks, "block_bytes": advice.block_bytes,
        "prefill_s_per_token": advice.prefill_s_per_token, "prefill_cost_known": advice.cost_known,
        "prompt_tokens_per_s": advice.prompt_tokens_per_s,
        "curve": None if curve is None else {"size_blocks": list(curve.sizes), "hit_ratio": list(curve.ratios),
                                             "ceiling": curve.ceiling, "knee_blocks": advice.knee_blocks},
        "tiers": [asdict(tier) for tier in advice.tiers],
        "net_negative": advice.net_negative,
        **tenants,
    })


def _finite(value: Any) -> Any:
    """JSON without NaN or infinities: None where a figure is not a number."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: _finite(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(item) for item in value]
    return value


def as_text(advice: Advice, by_tenant: bool = False) -> str:
    lines = [f"kvcompose advise: {advice.source}, {advice.span_meaning}", _caches_line(advice)]
    curve = advice.curve
    if curve is None:
        lines.append("hit-ratio curve: none in the input (economics off, or no request yet)")
    elif advice.knee_blocks is None:
        lines.append("hit-ratio curve: no hits at any size (no reuse)")
    else:
        lines.append(f"hit-ratio curve: ceiling {curve.ceiling:.3f} by {curve.sizes[-1]:,} blocks; "
                     f"90% of it at {advice.knee_blocks:,.0f} blocks{gib_text(advice, advice.knee_blocks)}")
    for tier in advice.tiers:
        lines += ["", *_tier_lines(advice, tier)]
    if by_tenant:
        lines += ["", *_tenant_lines(advice)]
    if advice.net_negative:
        lines += ["", f"net negative: {', '.join(advice.net_negative)}"]
    elif not advice.cost_known:
        lines += ["", "no tier judged: the engine's prefill cost per token is not known, so no load was priced"]
    else:
        lines += ["", "no tier is net negative"]
    return "\n".join(lines) + "\n"


def _caches_line(advice: Advice) -> str:
    gpu = ("GPU cache serves no prefix hits (prefix caching off)" if advice.gpu_blocks == 0
           else f"GPU cache {_number(advice.gpu_blocks)} blocks{gib_text(advice, advice.gpu_blocks)}")
    cost = (f"prefill {advice.prefill_s_per_token:.3g} s per token" if advice.cost_known
            else "prefill cost per token not known yet")
    parts = [gpu, f"KV block {_number(advice.block_bytes)} bytes", cost,
             f"{_number(advice.prompt_tokens_per_s)} prompt tokens/s"]
    return "; ".join(parts)


def _tier_lines(advice: Advice, tier: TierAdvice) -> list[str]:
    waits = tier.engine_wait_s_per_s
    lines = [f"{tier.name} ({tier.connector_class or 'class unknown'})",
             f"  hit ratio       {_number(tier.hit_ratio, '.3f')} of {tier.lookups:,.0f} lookups",
             f"  tokens served   {_number(tier.tokens_per_s)} /s",
             f"  prefill saved   {_number(tier.prefill_saved_s_per_s, '.3g')} s/s; engine wait load "
             f"{_number(waits['load'], '.3g')} + save {_number(waits['save'], '.3g')} s/s; "
             f"net {_number(tier.net_s_per_s, '+.3g')} s/s" + ("  NET NEGATIVE" if tier.net_negative else "")]
    for direction, copy in tier.copy.items():
        lines.append(f"  {direction:<15} copy p99 {_number(copy.p99_s, '.3g')} s; moved "
                     f"{_number(copy.moved_bytes_per_s, ',.0f')} B/s; copies run at "
                     f"{_number(copy.copy_bytes_per_s, ',.0f')} B/s")
    if tier.reach is None:
        reach = ", no reach exported (it does not load, or it or an earlier loader has no known size)"
    elif tier.reach.empty:
        reach = ", serves no reuse distance (an earlier loader is at least as large)"
    else:
        reach = f", serves reuse distances [{tier.reach.start:,}, {tier.reach.end:,})"
        if advice.gpu_blocks is not None and tier.reach.start > advice.gpu_blocks:  # behind an earlier loader
            reach += " at most (under first_match see tokens forgone)"
    share = f": {tier.curve_share:.3f} of prompt blocks by the curve" if tier.curve_share is not None else ""
    lines += [(f"  capacity        {_number(tier.capacity_blocks)} blocks{gib_text(advice, tier.capacity_blocks)}"
               f"{reach}{share}"),
              f"  marginal        {_number(tier.marginal_hit_ratio_per_gib, '.4f')} hit ratio per extra GiB",
              f"  write waste     {_number(tier.write_waste, '.3f')}",
              f"  tokens forgone  {_number(tier.tokens_forgone_per_s)} /s (by the load policy)"]
    lines += [f"  - {recommendation.text}" for recommendation in tier.recommendations]
    return lines


def _tenant_lines(advice: Advice) -> list[str]:
    if not advice.tenants:
        return ["tenants: none in the input (tenants.top_k 0, or no request yet)"]
    lines = ["tenants (by prompt tokens; 'other': every tenant outside the top K)"]
    for tenant in advice.tenants:
        share = f" ({tenant.prompt_share:.0%})" if tenant.prompt_share is not None else ""
        lines.append(f"{tenant.name}: {_number(tenant.prompt_tokens)} prompt tokens{share}, "
                     f"{_number(tenant.prompt_tokens_per_s)} /s; hit ratio at the GPU cache's size "
                     f"{_number(tenant.hit_ratio_at_gpu, '.3f')}")
        for name, tier in tenant.tiers.items():
            saved = (f"saved {_number(tier.prefill_saved_s, '.3g')} s ({_number(tier.prefill_saved_s_per_s, '.3g')}"
                     " s/s)" if tier.prefill_saved_s is not None else "saved: not priced (no prefill cost)")
            lines.append(f"  {name:<14} served {_number(tier.tokens)} tokens ({_number(tier.tokens_per_s)} /s), "
                         f"{saved}; hit ratio at its reach's end {_number(tier.hit_ratio_at_reach_end, '.3f')}, "
                         f"it adds {_number(tier.curve_share, '.3f')}")
    return lines


def _number(value: float | None, spec: str = ",.0f") -> str:
    return format(value, spec) if value is not None and math.isfinite(value) else "-"
