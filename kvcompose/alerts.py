"""Prometheus alerting rules for kvcompose and the vLLM connectors it composes.

Each alert is data: PromQL built from named parameters (thresholds, ``for``,
``severity``) and the text an operator reads when it pages. Thresholds change
through parameters, never by editing PromQL: ``kvcompose alerts --set
KVComposeTransferSlow.load_p99_seconds=0.25`` renders the same rules with
another number, so the promtool tests of the defaults keep describing what
runs. Nothing here imports vLLM.

Aggregations keep every label but the ones they fold (``sum without``), so
an alert carries ``connector`` and the scrape target's labels (``instance``,
``namespace``, ``pod``) and says which server and child to look at.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from kvcompose.metrics.running_calls import STUCK
from kvcompose.operations import DIRECTIONS

RUNBOOK_URL_BASE = "https://github.com/kvcompose/kvcompose/blob/main/docs/runbooks"
SEVERITIES = ("critical", "warning", "info")
KVCOMPOSE_GROUP = "kvcompose"
CHILDREN_GROUP = "kvcompose-children"  # vLLM connectors' own series, labelled with the child's name
_DURATION = re.compile(r"^(\d+(ms|s|m|h|d|w|y))+$")
_RATE = '{{ $value | printf "%.3g" }}'  # humanize would write 0.5 as 500m
_WHERE = "of {{ $labels.model_name }} (engine {{ $labels.engine }}) on {{ $labels.instance }}"

Value = float | str


class AlertSettingError(ValueError):
    """A ``--set`` that names no parameter, or gives it a value it cannot take."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(f"{key}: {message}")


def _number(text: str) -> float:
    try:
        value = float(text)
        if math.isfinite(value) and value >= 0:
            return value
    except ValueError:
        pass
    raise ValueError("expected a number >= 0")


def _duration(text: str) -> str:
    if not _DURATION.match(text):
        raise ValueError("expected a Prometheus duration such as 30s, 5m or 1h")
    return text


def _severity(text: str) -> str:
    if text not in SEVERITIES:
        raise ValueError(f"expected one of {', '.join(SEVERITIES)}")
    return text


@dataclass(frozen=True)
class Parameter:
    name: str
    default: Value
    help: str
    parse: Callable[[str], Value] = _number


@dataclass(frozen=True)
class Rule:
    """One alerting rule's PromQL and the text shown when it fires."""

    expr: str
    summary: str
    description: str


@dataclass(frozen=True)
class Alert:
    name: str
    group: str
    severity: str
    for_: str
    thresholds: tuple[Parameter, ...]
    rule: Callable[[Mapping[str, Value]], Rule]

    @property
    def parameters(self) -> tuple[Parameter, ...]:
        return (
            *self.thresholds,
            Parameter("for", self.for_, "how long the condition must hold before the alert fires", _duration),
            Parameter("severity", self.severity, "the alert's severity label", _severity),
        )


def number(value: Value) -> str:
    """A threshold as PromQL and people read it: 0.5, 2, 1e-05."""
    return f"{value:g}" if isinstance(value, float) else str(value)


def percent(value: Value) -> str:
    return f"{float(value) * 100:g}%"


def _circuit_open(p: Mapping[str, Value]) -> Rule:
    return Rule(
        # Half-open (2) counts too: a probe that fails reopens the circuit, and a `for` timer
        # reset by every probe would never let a long outage page. Stuck is KVComposeChildStuck's.
        f"kvcompose_child_state > 0\nand kvcompose_child_state < {STUCK}",
        "kvcompose child {{ $labels.connector }} is cut off by its circuit breaker",
        f"Child {{{{ $labels.connector }}}} {_WHERE} has been skipped by its circuit breaker for over {p['for']} "
        "(state {{ $value }}: 1 open, 2 half-open and probing). Its lookups count as misses and it loads and "
        "saves nothing, so requests recompute what it held and it stores nothing new.",
    )


def _child_errors(p: Mapping[str, Value]) -> Rule:
    return Rule(
        "sum without (op, error_type) (rate(kvcompose_call_errors_total[5m]))\n"
        "  / sum without (op) (rate(kvcompose_call_duration_seconds_count[5m]))\n"
        f"> {number(p['error_ratio'])}",
        "kvcompose child {{ $labels.connector }} fails {{ $value | humanizePercentage }} of its calls",
        f"{{{{ $value | humanizePercentage }}}} of kvcompose's calls into child {{{{ $labels.connector }}}} {_WHERE} "
        f"raised over the last 5m (threshold {percent(p['error_ratio'])}, for {p['for']}). Under on_error: isolate "
        "each failure is absorbed (a lookup becomes a miss, a failed load is recomputed, the other children still "
        "save); enough failures in a row open the child's circuit breaker.",
    )


_COPY_SECONDS = "kvcompose_transfer_copy_seconds"
_TRANSFER_IMPACT = {
    "load": "Requests that load from this child wait for it before their first token.",
    "save": "Slow synchronous saves stretch every engine step; slow asynchronous saves keep finished "
            "requests' KV blocks allocated, which shrinks the KV cache left for running requests.",
}


def _by_direction(text: Mapping[str, str]) -> str:
    """A template picking the text of the alert's ``direction``."""
    return '{{ if eq $labels.direction "load" }}%s{{ else }}%s{{ end }}' % (text["load"], text["save"])


def _transfer_slow(p: Mapping[str, Value]) -> Rule:
    # Copy time, not lifetime: the copy is the tier's own speed; a lifetime also holds the engine steps until
    # vLLM polls the transfer done, so it grows with the step time whatever the tier does (docs/runbooks).
    # One rule for both directions (each with its threshold): two rules of one name and labels are duplicates.
    slow = "\n  or\n".join(
        f'    histogram_quantile(0.99, rate({_COPY_SECONDS}_bucket{{direction="{direction}"}}[10m]))'
        f" > {number(p[f'{direction}_p99_seconds'])}" for direction in DIRECTIONS)
    thresholds = _by_direction({d: number(p[f"{d}_p99_seconds"]) for d in DIRECTIONS})
    return Rule(
        f"(\n{slow}\n)\nand rate({_COPY_SECONDS}_count[10m]) > {number(p['min_rate'])}",
        "kvcompose {{ $labels.direction }} copies by {{ $labels.connector }} take {{ $value | humanizeDuration }} "
        "at p99",
        f"The 99th percentile of the copy time of {{{{ $labels.direction }}}} transfers by child "
        f"{{{{ $labels.connector }}}} {_WHERE} was {{{{ $value | humanizeDuration }}}} over the last 10m (measured by "
        f"{{{{ $labels.source }}}}), above {thresholds} s, for {p['for']} (counted once the child makes over "
        f"{number(p['min_rate'])} transfers/s that way). {_by_direction(_TRANSFER_IMPACT)}",
    )


def _hit_ratio(window: str) -> str:
    return (f'sum without (result) (rate(kvcompose_lookups_total{{result="hit"}}[{window}]))\n'
            f"    / sum without (result) (rate(kvcompose_lookups_total[{window}]))")


def _hit_ratio_drop(p: Mapping[str, Value]) -> Rule:
    return Rule(
        f"(\n    {_hit_ratio('1h')}\n)\n/\n(\n    {_hit_ratio('1d')}\n)\n"
        f"< {number(p['drop_factor'])}\n"
        f"and sum without (result) (rate(kvcompose_lookups_total[1h])) > {number(p['min_lookup_rate'])}",
        "Lookup hit ratio of {{ $labels.connector }} fell to {{ $value | humanizePercentage }} of its daily baseline",
        f"Over the last hour child {{{{ $labels.connector }}}} {_WHERE} answered hit to "
        "{{ $value | humanizePercentage }} of the share of lookups it hit over the last day "
        f"(alert below {percent(p['drop_factor'])} with over {number(p['min_lookup_rate'])} lookups/s, "
        f"for {p['for']}). Prompts it used to serve are recomputed: time to first token and GPU load rise.",
    )


def _router_overpredicting(p: Mapping[str, Value]) -> Rule:
    return Rule(
        "rate(kvcompose_router_overpredicted_tokens_total[15m])\n"
        "  / rate(kvcompose_router_predicted_tokens_total[15m])\n"
        f"> {number(p['overpredicted_share'])}\n"
        f"and rate(kvcompose_router_predictions_total[15m]) > {number(p['min_prediction_rate'])}",
        "Routers over-predict the cached tokens of {{ $labels.model_name }} by {{ $value | humanizePercentage }}",
        f"{{{{ $value | humanizePercentage }}}} of the prompt tokens routers predicted {_WHERE} held over the last "
        f"15m were not there (alert above {percent(p['overpredicted_share'])} with over "
        f"{number(p['min_prediction_rate'])} predictions/s, for {p['for']}). The router's prefix index is stale or "
        "its tier weights are too high: requests it sent here for their cache recompute those tokens.",
    )


# What each reason of kvcompose_spans_dropped_total means (kvcompose/wire/telemetry.py).
_DROP_CAUSES = {
    "queue_full": "its export queue is full, so the OTLP collector is unreachable or slower than the span rate",
    "export_failed": "the OTLP collector refused them",
    "exporter_down": "a span exporter process died with them (kvcompose restarts it)",
    "shutdown": "they were still queued when the engine shut down and tracing.shutdown_flush_s ran out",
}


def _by_reason() -> str:
    """A template picking the cause of the alert's ``reason``."""
    branches = "".join(f'{{{{ {"if" if index == 0 else "else if"} eq $labels.reason "{reason}" }}}}{cause}'
                        for index, (reason, cause) in enumerate(_DROP_CAUSES.items()))
    return f"{branches}{{{{ else }}}}reason {{{{ $labels.reason }}}}{{{{ end }}}}"


def _spans_dropped(p: Mapping[str, Value]) -> Rule:
    return Rule(
        f"rate(kvcompose_spans_dropped_total[10m]) > {number(p['dropped_rate'])}",
        f"kvcompose drops {_RATE} spans/s ({{{{ $labels.reason }}}})",
        "kvcompose {{ $labels.model_name }} (engine {{ $labels.engine }}) on {{ $labels.instance }} dropped "
        f"{_RATE} spans/s for reason {{{{ $labels.reason }}}} over the last 10m (threshold "
        f"{number(p['dropped_rate'])}/s, for {p['for']}): {_by_reason()}. Serving is unaffected; traces miss spans.",
    )


def _exporter_restarting(p: Mapping[str, Value]) -> Rule:
    return Rule(
        f"increase(kvcompose_exporter_restarts_total[30m]) > {number(p['restarts'])}",
        "kvcompose's span exporter keeps dying: {{ $value | humanize }} restarts in 30m",
        "The span exporter processes of kvcompose {{ $labels.model_name }} (engine {{ $labels.engine }}) on "
        "{{ $labels.instance }} were started again {{ $value | humanize }} times over the last 30m (threshold "
        f"{number(p['restarts'])}, for {p['for']}). Each death loses the spans it held (reason exporter_down) and "
        "each restart waits longer (up to 30 s), so traces have gaps. Serving is unaffected.",
    )


def _child_stuck(p: Mapping[str, Value]) -> Rule:
    return Rule(
        f"kvcompose_child_state == {STUCK}",
        "kvcompose child {{ $labels.connector }} is stuck in a call: the engine waits",
        f"A call into child {{{{ $labels.connector }}}} {_WHERE} has run past the pipeline's watchdog_s for over "
        f"{p['for']} (kvcompose_child_state {{{{ $value }}}}: stuck). vLLM calls its connector from the engine's "
        "one thread, so every request of this engine waits for the call; /health still answers 200. No Python "
        "call can be interrupted: the call returns, or the server must be restarted.",
    )


def _tier_net_negative(p: Mapping[str, Value]) -> Rule:
    return Rule(
        'sum without (direction) (rate(kvcompose_engine_wait_seconds_total{direction="load"}[30m]))\n'
        "  - rate(kvcompose_prefill_seconds_saved_total[30m])\n"
        f"> {number(p['net_loss_seconds_per_second'])}\n"
        f"and rate(kvcompose_loaded_tokens_total[30m]) > {number(p['min_loaded_tokens_per_second'])}\n"
        # The saved seconds grow only once the engine's prefill cost per token is known (a fit above 0): a tier
        # that loads and saved nothing was not priced, and cannot be judged.
        "and rate(kvcompose_prefill_seconds_saved_total[30m]) > 0",
        "kvcompose tier {{ $labels.connector }} costs the engine more than it saves",
        f"The loads of child {{{{ $labels.connector }}}} {_WHERE} kept the forward pass waiting "
        f"{_RATE} s/s longer than the prefill they spared it (engine wait of its loads less "
        f"kvcompose_prefill_seconds_saved_total, over the last 30m; threshold "
        f"{number(p['net_loss_seconds_per_second'])} s/s, for {p['for']}, counted once it loads over "
        f"{number(p['min_loaded_tokens_per_second'])} tokens/s and the engine's prefill cost per token is "
        "known). Recomputing those prompts would be faster.",
    )


def _nixl_failures(p: Mapping[str, Value]) -> Rule:
    return Rule(
        "rate(vllm:nixl_num_failed_transfers_total[5m])\n"
        "  / (rate(vllm:nixl_xfer_time_seconds_count[5m]) + rate(vllm:nixl_num_failed_transfers_total[5m]))\n"
        f"> {number(p['failure_ratio'])}",
        "NIXL child {{ $labels.connector }} fails {{ $value | humanizePercentage }} of its KV transfers",
        f"{{{{ $value | humanizePercentage }}}} of the NIXL transfers of child {{{{ $labels.connector }}}} {_WHERE} "
        f"failed over the last 5m (handshakes, transfers and notifications; threshold "
        f"{percent(p['failure_ratio'])}, for {p['for']}). Each failure makes vLLM recompute the prompt "
        "(load.on_failure: recompute) or fail the request (fail).",
    )


def _offload_allocation_failures(p: Mapping[str, Value]) -> Rule:
    return Rule(
        f"rate(vllm:kv_offload_allocation_failure_total[10m]) > {number(p['failure_rate'])}",
        f"Offloading child {{{{ $labels.connector }}}} cannot allocate {_RATE} stores/s",
        f"OffloadingConnector child {{{{ $labels.connector }}}} {_WHERE} failed {_RATE} store "
        f"allocations per second over the last 10m (threshold {number(p['failure_rate'])}/s, for {p['for']}): "
        "its offload medium had too few blocks it could evict, because transfers in flight hold them or the "
        "medium is small for the traffic. KV that is not stored cannot be loaded later.",
    )


ALERTS: tuple[Alert, ...] = (
    Alert("KVComposeChildCircuitOpen", KVCOMPOSE_GROUP, "critical", "5m", (), _circuit_open),
    Alert("KVComposeChildErrors", KVCOMPOSE_GROUP, "warning", "10m", (
        Parameter("error_ratio", 0.05, "share of a child's calls that raise"),
    ), _child_errors),
    Alert("KVComposeChildStuck", KVCOMPOSE_GROUP, "critical", "1m", (), _child_stuck),
    Alert("KVComposeTransferSlow", KVCOMPOSE_GROUP, "warning", "15m", (
        Parameter("load_p99_seconds", 0.5, "p99 of the copy time of a child's loads, seconds"),
        Parameter("save_p99_seconds", 2.0, "p99 of the copy time of a child's saves, seconds"),
        Parameter("min_rate", 0.05, "transfers/s a child must make in that direction for its p99 to count"),
    ), _transfer_slow),
    Alert("KVComposeTierNetNegative", KVCOMPOSE_GROUP, "warning", "1h", (
        Parameter("net_loss_seconds_per_second", 0.0,
                  "engine-wait seconds per second a tier's loads may cost beyond the prefill seconds they save"),
        Parameter("min_loaded_tokens_per_second", 1.0, "tokens/s a tier must load over 30m for its net to count"),
    ), _tier_net_negative),
    Alert("KVComposeLoadHitRatioDrop", KVCOMPOSE_GROUP, "warning", "30m", (
        Parameter("drop_factor", 0.5, "alert when the 1h hit ratio is below this share of the 1d hit ratio"),
        Parameter("min_lookup_rate", 0.1, "lookups/s a child must answer over the hour for the ratio to count"),
    ), _hit_ratio_drop),
    Alert("KVComposeRouterOverpredicting", KVCOMPOSE_GROUP, "warning", "15m", (
        Parameter("overpredicted_share", 0.2, "share of the predicted tokens that were not there"),
        Parameter("min_prediction_rate", 0.1, "predictions/s an engine must get over 15m for the share to count"),
    ), _router_overpredicting),
    Alert("KVComposeSpansDropped", KVCOMPOSE_GROUP, "warning", "15m", (
        Parameter("dropped_rate", 0.0, "spans/s dropped, per reason"),
    ), _spans_dropped),
    Alert("KVComposeExporterRestarting", KVCOMPOSE_GROUP, "warning", "15m", (
        Parameter("restarts", 2.0, "span exporter restarts of an engine in 30m"),
    ), _exporter_restarting),
    Alert("KVComposeNixlTransfersFailing", CHILDREN_GROUP, "critical", "5m", (
        Parameter("failure_ratio", 0.01, "share of a NIXL child's transfers that fail"),
    ), _nixl_failures),
    Alert("KVComposeOffloadAllocationFailures", CHILDREN_GROUP, "warning", "15m", (
        Parameter("failure_rate", 0.0, "failed store allocations/s of an OffloadingConnector child"),
    ), _offload_allocation_failures),
)


def settings(overrides: Mapping[str, str]) -> dict[str, dict[str, Value]]:
    """Every alert's parameters: the defaults, with ``{"ALERT.PARAMETER": "VALUE"}`` applied."""
    resolved = {alert.name: {p.name: p.default for p in alert.parameters} for alert in ALERTS}
    by_name = {alert.name: alert for alert in ALERTS}
    for key, text in overrides.items():
        alert_name, _, parameter_name = key.partition(".")
        alert = by_name.get(alert_name)
        if alert is None:
            raise AlertSettingError(key, f"unknown alert; expected one of {', '.join(by_name)}")
        parameter = next((p for p in alert.parameters if p.name == parameter_name), None)
        if parameter is None:
            names = ", ".join(p.name for p in alert.parameters)
            raise AlertSettingError(key, f"unknown parameter of {alert_name}; expected one of {names}")
        try:
            resolved[alert_name][parameter_name] = parameter.parse(text)
        except ValueError as error:
            raise AlertSettingError(key, f"{error} (got {text!r})") from None
    return resolved


def rule_groups(overrides: Mapping[str, str] | None = None,
                runbook_url_base: str = RUNBOOK_URL_BASE) -> list[dict[str, object]]:
    """The Prometheus rule groups (the ``groups:`` of a rule file or of a PrometheusRule's spec)."""
    resolved = settings(overrides or {})
    groups: dict[str, list[dict[str, object]]] = {}
    for alert in ALERTS:
        params = resolved[alert.name]
        rule = alert.rule(params)
        groups.setdefault(alert.group, []).append({
            "alert": alert.name,
            "expr": rule.expr,
            "for": params["for"],
            "labels": {"severity": params["severity"]},
            "annotations": {
                "summary": rule.summary,
                "description": rule.description,
                "runbook_url": f"{runbook_url_base.rstrip('/')}/{alert.name}.md",
            },
        })
    return [{"name": name, "rules": rules} for name, rules in groups.items()]
