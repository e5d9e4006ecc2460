"""``kvcompose advise --prometheus URL --since 6h``: the figures over a window, from a Prometheus server.

Counters are read as ``increase`` over the window (summed over engines),
gauges as their average over it (over engines too), the tiers' capacities
and reaches as their last value. Per second means over the part of the
window the data covers (from its first kvcompose sample), so a server younger than the
window is not diluted by the hours before it started.
"""

from __future__ import annotations

import json
import math
import re
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

from kvcompose.economics.observations import InputError, Observations, ObservationsBuilder

_DURATION = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h|d|w|y)")
_UNIT_S = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800, "y": 31536000}
TIMEOUT_S = 30.0

# Each query, and the series name its results are read as: counters over the window, gauges averaged.
_COUNTERS = {
    "kvcompose_lookups_total": "connector, result",
    "kvcompose_loaded_tokens_total": "connector",
    "kvcompose_prefill_seconds_saved_total": "connector",
    "kvcompose_tokens_forgone_total": "connector",
    "kvcompose_engine_wait_seconds_total": "connector, direction",
    "kvcompose_transfer_bytes_total": "connector, direction",
    "kvcompose_transfer_copied_bytes_total": "connector, direction",
    "kvcompose_transfer_copy_seconds_sum": "connector, direction",
    "kvcompose_transfer_copy_seconds_count": "connector, direction",
    "kvcompose_transfer_copy_seconds_bucket": "connector, direction, le",
    "vllm:prompt_tokens_total": "",
    "kvcompose_tenant_prompt_tokens_total": "tenant",
    "kvcompose_tenant_loaded_tokens_total": "tenant, connector",
    "kvcompose_tenant_prefill_seconds_saved_total": "tenant, connector",
}
_GAUGES = {
    "kvcompose_cache_size_hit_ratio": ("avg", "avg_over_time", "size_blocks"),
    "kvcompose_write_waste_ratio": ("avg", "avg_over_time", "connector"),
    "kvcompose_prefill_seconds_per_token": ("avg", "avg_over_time", ""),
    "kvcompose_kv_block_bytes": ("avg", "last_over_time", ""),
    "kvcompose_tier_capacity_blocks": ("avg", "last_over_time", "connector"),
    "kvcompose_tier_reach_blocks": ("avg", "last_over_time", "connector, edge"),
    "kvcompose_pipeline_info": ("max", "last_over_time", "connector, position, connector_class"),
    "kvcompose_tenant_cache_size_hit_ratio": ("avg", "avg_over_time", "tenant, size_blocks"),
}


def parse_duration(text: str) -> float:
    """Seconds in a Prometheus duration such as ``6h``, ``90m`` or ``1h30m``."""
    parts = _DURATION.findall(text)
    if not text or "".join(number + unit for number, unit in parts) != text:
        raise InputError(f"--since {text}: not a duration such as 6h, 90m or 1h30m")
    seconds = sum(float(number) * _UNIT_S[unit] for number, unit in parts)
    if seconds <= 0:
        raise InputError(f"--since {text}: must be longer than nothing")
    return seconds


def read_prometheus(url: str, window_s: float, at: float) -> Observations:
    """kvcompose's figures over the ``window_s`` seconds before ``at`` (Unix seconds) from Prometheus at ``url``."""
    window = f"[{window_s:.0f}s]"
    first = _query(url, f"min(min_over_time(timestamp(kvcompose_pipeline_info)[{window_s:.0f}s:]))", at)
    if not first:
        raise InputError(f"{url}: no kvcompose series in the {window_s:.0f} s before {at:.0f}")
    span = min(window_s, at - float(first[0]["value"][1]))
    builder = ObservationsBuilder(url, span, f"over the last {span:.0f} s with data, of a {window_s:.0f} s window")
    queries = [(name, _aggregate("sum", by, f"increase({name}{window})")) for name, by in _COUNTERS.items()]
    queries += [(name, _aggregate(across, by, f"{over_time}({name}{window})"))
                for name, (across, over_time, by) in _GAUGES.items()]
    for name, promql in queries:
        for result in _query(url, promql, at):
            builder.add(name, result["metric"], float(result["value"][1]))
    return builder.build()


def _aggregate(operator: str, by: str, expression: str) -> str:
    return f"{operator} by ({by}) ({expression})" if by else f"{operator}({expression})"


def _query(url: str, promql: str, at: float) -> list[dict[str, Any]]:
    address = f"{url.rstrip('/')}/api/v1/query?{urllib.parse.urlencode({'query': promql, 'time': at})}"
    try:
        with urllib.request.urlopen(address, timeout=TIMEOUT_S) as response:
            body = json.load(response)
    except urllib.error.HTTPError as error:
        body = _error_body(error)
        raise InputError(f"{url}: Prometheus refused {promql!r}: {body.get('error', error.reason)}") from None
    except (urllib.error.URLError, OSError, ValueError) as error:
        raise InputError(f"{url}: cannot query Prometheus: {getattr(error, 'reason', error)}") from None
    if body.get("status") != "success" or body.get("data", {}).get("resultType") != "vector":
        raise InputError(f"{url}: not a Prometheus query API answer for {promql!r}")
    return [result for result in body["data"]["result"] if not math.isnan(float(result["value"][1]))]


def _error_body(error: urllib.error.HTTPError) -> dict[str, Any]:
    try:
        return json.load(error)
    except ValueError:
        return {}
