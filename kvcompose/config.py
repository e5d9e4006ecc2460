"""The pipeline file: pydantic models for every section, and how to load one.

A pipeline names each child connector, its place in the load order and its
config, plus the tracing, metrics and logging settings of the composite.
Unknown keys are errors, so a typo never passes silently.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, ValidationError, field_validator, model_validator

from kvcompose.errors import PipelineConfigError, Problem
from kvcompose.interpolation import interpolate_env
from kvcompose.source import read_pipeline_source
from kvcompose.vllm_names import BUILTIN_CONNECTORS, KV_TRANSFER_FIELDS, KV_TRANSFER_FIELDS_OWNED_BY_KVCOMPOSE

LABEL_SAFE_PATTERN = r"^[a-z0-9][a-z0-9_-]{0,62}$"
LabelSafeName = Annotated[str, StringConstraints(pattern=LABEL_SAFE_PATTERN)]
KVRole = Literal["kv_producer", "kv_consumer", "kv_both"]

# About 50 us to 10 s: connector calls range from a dict lookup to a remote fetch.
DEFAULT_LATENCY_BUCKETS: tuple[float, ...] = (
    0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01,
    0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
)  # fmt: skip


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class LoadSection(_Section):
    """How the composite picks the child that loads a request's KV."""

    policy: Literal["first_match", "longest_match"] = Field(
        "first_match",
        description="first_match: the first child (in order) that has tokens loads them, as vLLM's "
        "MultiConnector does. longest_match: the child reporting the most tokens loads (ties go to "
        "the earlier child).",
    )
    on_failure: Literal["recompute", "fail"] = Field(
        "recompute",
        description="What vLLM does when a child cannot deliver tokens it claimed (rendered as "
        "kv_load_failure_policy): recompute them, or fail the request.",
    )


class CircuitBreakerSection(_Section):
    """Skip a failing child for a while instead of calling it on every step."""

    enabled: bool = True
    failures: Annotated[int, Field(ge=1)] = Field(
        5, description="Consecutive failed calls of one data-path operation (lookup, load, save, ...) that open "
        "the circuit."
    )
    cooldown_s: Annotated[float, Field(gt=0)] = Field(
        30.0, description="Seconds the child is skipped before one probing call is let through."
    )


class ChildConfig(_Section):
    """One child connector of the pipeline."""

    name: LabelSafeName = Field(description="Unique, label-safe name used in metrics, spans and logs.")
    connector: Annotated[str, StringConstraints(min_length=1)] = Field(
        description="A connector name vLLM's KVConnectorFactory knows, or a class name in module_path."
    )
    module_path: Annotated[str, StringConstraints(min_length=1)] | None = Field(
        None, description="Python module holding an out-of-tree connector class."
    )
    role: KVRole | None = Field(None, description="The child's kv_role; defaults to the pipeline's role.")
    load: bool = Field(True, description="May this child serve loads?")
    save: bool = Field(True, description="Does this child receive saves?")
    on_error: Literal["isolate", "raise"] = Field(
        "isolate",
        description="isolate: a failing call is logged, counted and traced, and the request goes on without "
        "this child (a lookup is a miss, a load is recomputed). raise: the error reaches vLLM.",
    )
    circuit_breaker: CircuitBreakerSection = CircuitBreakerSection()
    config: dict[str, Any] = Field(
        default_factory=dict, description="Passed to the child as its kv_connector_extra_config."
    )
    transfer: dict[str, Any] = Field(
        default_factory=dict,
        description="Other KVTransferConfig fields for this child, e.g. {kv_buffer_device: cpu}.",
    )

    @field_validator("transfer")
    @classmethod
    def _known_transfer_fields(cls, transfer: dict[str, Any]) -> dict[str, Any]:
        for key in transfer:
            if key in KV_TRANSFER_FIELDS_OWNED_BY_KVCOMPOSE:
                raise ValueError(f"{key!r} is set by kvcompose from the child's own fields; remove it here")
            if key not in KV_TRANSFER_FIELDS:
                allowed = ", ".join(sorted(KV_TRANSFER_FIELDS - KV_TRANSFER_FIELDS_OWNED_BY_KVCOMPOSE))
                raise ValueError(f"KVTransferConfig has no field {key!r}; allowed: {allowed}")
        return transfer


class TracingSection(_Section):
    """OpenTelemetry spans around child calls."""

    enabled: bool = False
    service_name: Annotated[str, StringConstraints(min_length=1)] = "kvcompose"
    exporter: Literal["otlp", "console", "none"] = "otlp"
    endpoint: str | None = Field(
        None, description="OTLP/HTTP traces endpoint; else the OTEL_EXPORTER_OTLP_* environment variables."
    )
    sample_ratio: Annotated[float, Field(ge=0.0, le=1.0)] = 1.0
    granularity: Literal["request", "step", "layer"] = "request"


class MetricsSection(_Section):
    """Per-child stats and Prometheus metrics."""

    enabled: bool = True
    per_layer: bool = Field(
        False,
        description="Also time save_kv_layer and wait_for_layer_load (once per layer per step: costs about "
        "1 us per call and child). Off, the step-level start_load_kv and wait_for_save are timed.",
    )
    latency_buckets: tuple[float, ...] = Field(
        DEFAULT_LATENCY_BUCKETS, description="Upper bounds (seconds) of the latency histogram buckets."
    )

    @field_validator("latency_buckets")
    @classmethod
    def _increasing_buckets(cls, buckets: tuple[float, ...]) -> tuple[float, ...]:
        if not buckets:
            raise ValueError("needs at least one bucket bound")
        if any(not math.isfinite(b) or b <= 0 for b in buckets):
            raise ValueError("bucket bounds must be positive, finite seconds (+Inf is added for you)")
        if any(a >= b for a, b in zip(buckets, buckets[1:], strict=False)):
            raise ValueError("bucket bounds must be strictly increasing")
        return buckets


class LoggingSection(_Section):
    """kvcompose's own structured logs."""

    format: Literal["json", "console"] = "console"
    level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"


class Pipeline(_Section):
    """A whole pipeline file."""

    version: Literal[1] = Field(description="Pipeline file format version.")
    name: LabelSafeName = Field(description="Pipeline name, used as a metric label.")
    role: KVRole = Field("kv_both", description="Default kv_role of every child.")
    load: LoadSection = LoadSection()
    children: list[ChildConfig] = Field(min_length=1, description="Child connectors; order is load priority.")
    tracing: TracingSection = TracingSection()
    metrics: MetricsSection = MetricsSection()
    logging: LoggingSection = LoggingSection()

    @model_validator(mode="after")
    def _check_children(self) -> Pipeline:
        problems = [*_duplicate_names(self.children), *_unknown_connectors(self.children)]
        if problems:
            # Not a ValueError: pydantic would drop the field paths.
            raise PipelineConfigError(problems)
        return self

    def child_role(self, child: ChildConfig) -> KVRole:
        return child.role or self.role


def _duplicate_names(children: list[ChildConfig]) -> list[Problem]:
    first_seen: dict[str, int] = {}
    problems = []
    for index, child in enumerate(children):
        if child.name in first_seen:
            problems.append(
                Problem(
                    ("children", index, "name"),
                    f"duplicate child name {child.name!r} (first used by children[{first_seen[child.name]}]); "
                    "names must be unique",
                )
            )
        else:
            first_seen[child.name] = index
    return problems


def _unknown_connectors(children: list[ChildConfig]) -> list[Problem]:
    problems = []
    for index, child in enumerate(children):
        if child.module_path is None and child.connector not in BUILTIN_CONNECTORS:
            message = f"unknown connector {child.connector!r}"
            if suggestion := did_you_mean(child.connector, BUILTIN_CONNECTORS):
                message += f"; did you mean {suggestion!r}?"
            else:
                message += "; set module_path for an out-of-tree connector"
            problems.append(Problem(("children", index, "connector"), message))
    return problems


def did_you_mean(name: str, known: frozenset[str]) -> str | None:
    by_lower = {k.lower(): k for k in known}
    matches = difflib.get_close_matches(name.lower(), by_lower, n=1, cutoff=0.6)
    return by_lower[matches[0]] if matches else None


def load_pipeline(source: str | Path | Mapping[str, Any]) -> Pipeline:
    """Load and validate a pipeline from a YAML/JSON file path or a mapping.

    Raises :class:`PipelineConfigError` (and nothing else) for any bad input.
    """
    if isinstance(source, Mapping):
        raw, lines, label = dict(source), {}, None
    else:
        raw, lines, label = read_pipeline_source(Path(source))
    if not isinstance(raw, dict):
        got = "an empty document" if raw is None else f"a {type(raw).__name__}"
        raise PipelineConfigError([Problem((), f"the pipeline must be a mapping, got {got}", 1 if label else None)], label)
    try:
        data = interpolate_env(raw)
        return Pipeline.model_validate(data)
    except PipelineConfigError as error:
        raise PipelineConfigError([_with_line(p, lines) for p in error.problems], label) from None
    except ValidationError as error:
        raise PipelineConfigError([_with_line(p, lines) for p in validation_problems(error)], label) from None


def validation_problems(error: ValidationError) -> list[Problem]:
    """One :class:`Problem` per pydantic error, worded for people editing a config."""
    return [Problem(tuple(e["loc"]), _pydantic_message(e)) for e in error.errors()]


def _pydantic_message(error: Mapping[str, Any]) -> str:
    if error["type"] == "extra_forbidden":
        return "unknown key (check the spelling; `kvcompose schema` lists every key)"
    if error["type"] == "missing":
        return "required key is missing"
    if error["type"] == "string_pattern_mismatch":
        return (f"{error['input']!r} is not label-safe: use 1-63 lowercase letters, digits, '_' or '-', "
                "starting with a letter or digit")
    return str(error["msg"]).removeprefix("Value error, ")


def _with_line(problem: Problem, lines: Mapping[tuple[str | int, ...], int]) -> Problem:
    path = problem.path
    while path and path not in lines:
        path = path[:-1]
    return Problem(problem.path, problem.message, lines.get(path, problem.line))
