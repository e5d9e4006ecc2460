"""The pipeline file: pydantic models for every section, and how to load one.

A pipeline names each child connector, its place in the load order and its
config, plus the tracing, metrics and logging settings of the composite.
Unknown keys are errors, so a typo never passes silently.
"""

from __future__ import annotations

import difflib
import math
import typing
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, ValidationError, field_validator, model_validator

from kvcompose.errors import FieldPath, PipelineConfigError, Problem, shown
from kvcompose.interpolation import interpolate_env
from kvcompose.source import PipelineDocument, mapping_document, read_pipeline_source
from kvcompose.vllm_names import BUILTIN_CONNECTORS, KV_TRANSFER_FIELDS, KV_TRANSFER_FIELDS_OWNED_BY_KVCOMPOSE

LABEL_SAFE_PATTERN = r"^[a-z0-9][a-z0-9_-]{0,62}$"
LabelSafeName = Annotated[str, StringConstraints(pattern=LABEL_SAFE_PATTERN)]
KVRole = Literal["kv_producer", "kv_consumer", "kv_both"]

# 1 us to 10 s, 1-2.5-5 per decade: connector calls range from a dict lookup of a
# microsecond (a lowest bound above that reports every such call at half that bound)
# to a remote fetch of seconds.
DEFAULT_LATENCY_BUCKETS: tuple[float, ...] = (
    0.000001, 0.0000025, 0.000005, 0.00001, 0.000025, 0.00005, 0.0001, 0.00025, 0.0005,
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
)  # fmt: skip
# 10 us to 50 s, 1-2.5-5 per decade: a KV transfer ranges from a copy of one block
# in host memory to a multi-second fetch from a remote tier.
DEFAULT_TRANSFER_BUCKETS: tuple[float, ...] = (
    0.00001, 0.000025, 0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005,
    0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 25.0, 50.0,
)  # fmt: skip


# Keys earlier releases accepted, and what a pipeline that still has one should do.
REMOVED_KEYS: dict[tuple[str, ...], str] = {
    ("metrics", "sample_every"): "removed: every call into a child is timed now, so there is no sampling to set; "
    "delete this key",
}


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
    shared: LabelSafeName | None = Field(
        None, description="The id of a tier several engines share (an LMCache server, a Mooncake store, a shared "
        "directory): engines whose pipelines give a child the same id feed one fleet-wide hit-ratio curve "
        "(`kvcompose fleet`), sampled as the pipeline's fleet section says.",
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
    sample_ratio: Annotated[float, Field(ge=0.0, le=1.0)] | None = Field(
        None, description="Share of requests without a sampled caller that are traced. Unset: OTEL_TRACES_SAMPLER "
        "and OTEL_TRACES_SAMPLER_ARG decide, else every request is traced.",
    )
    granularity: Literal["request", "step", "layer"] = "request"
    slow_call_ms: Annotated[float, Field(ge=0.0)] = Field(
        1.0, description="At request granularity, a call other than the lookup makes a span only if it failed or "
        "took longer than this (milliseconds). step and layer granularity trace every call.",
    )
    shutdown_flush_s: Annotated[float, Field(gt=0.0, le=60.0)] = Field(
        2.0, description="At shutdown, spans still waiting are exported for at most this long (the exporter "
        "process outlives an engine that is killed), then counted as lost and logged.",
    )


class MetricsSection(_Section):
    """Per-child stats and Prometheus metrics."""

    enabled: bool = True
    per_layer: bool = Field(
        False,
        description="Also record the latency of save_kv_layer and wait_for_layer_load (called once per layer per "
        "step). Off, their time still counts as engine wait; the step-level calls are timed either way.",
    )
    latency_buckets: tuple[float, ...] = Field(
        DEFAULT_LATENCY_BUCKETS, description="Upper bounds (seconds) of the latency histogram buckets."
    )
    transfer_buckets: tuple[float, ...] = Field(
        DEFAULT_TRANSFER_BUCKETS, description="Upper bounds (seconds) of the transfer duration histogram buckets."
    )

    @field_validator("latency_buckets", "transfer_buckets")
    @classmethod
    def _increasing_buckets(cls, buckets: tuple[float, ...]) -> tuple[float, ...]:
        if not buckets:
            raise ValueError("needs at least one bucket bound")
        if any(not math.isfinite(b) or b <= 0 for b in buckets):
            raise ValueError("bucket bounds must be positive, finite seconds (+Inf is added for you)")
        if any(a >= b for a, b in zip(buckets, buckets[1:], strict=False)):
            raise ValueError("bucket bounds must be strictly increasing")
        return buckets


class TenantsSection(_Section):
    """Per-tenant series, with their cardinality bounded (docs/tenants.md)."""

    top_k: Annotated[int, Field(ge=0, le=200)] = Field(
        20, description="The tenants with the most prompt tokens over the recent window that get a label of their "
        "own; every other tenant counts as 'other'. 0 turns per-tenant series off.",
    )
    half_life_s: Annotated[float, Field(gt=0.0)] = Field(
        3600.0, description="The window the top tenants are chosen over: a prompt token's weight halves in this "
        "many seconds.",
    )


class LoggingSection(_Section):
    """kvcompose's own structured logs."""

    format: Literal["json", "console"] = "console"
    level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"


class FleetSection(_Section):
    """How an engine samples its prefix-block stream for the tiers it shares with other engines (children's
    ``shared``), and where ``kvcompose fleet`` pulls the samples from."""

    sample_rate: Annotated[float, Field(gt=0.0, le=1.0)] = Field(
        1 / 256, description="The share of block keys sampled, fixed and the same on every engine of the fleet, "
        "so that the engines' samples merge: a key is sampled on every engine or on none.",
    )
    secret_env: Annotated[str, StringConstraints(pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")] = Field(
        "KVCOMPOSE_FLEET_SECRET", description="The environment variable holding the fleet's secret, the key of the "
        "digest that stands for each sampled block: the same on every engine, unknown to whoever reads the samples "
        "without it.",
    )
    host: Annotated[str, StringConstraints(min_length=1)] = Field(
        "0.0.0.0", description="The address the engine's fleet endpoint listens on.")
    port: Annotated[int, Field(ge=0, le=65535)] = Field(
        8790, description="The port of the engine's fleet endpoint (plus the engine's data-parallel rank); "
        "${VAR} gives each engine on one host its own; 0: any free port, logged (fleet_endpoint_listening).",
    )
    buffer_samples: Annotated[int, Field(ge=16, le=1 << 24)] = Field(
        1 << 16, description="Sampled requests kept for the aggregator between its pulls; older ones are dropped "
        "and counted.",
    )


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
    tenants: TenantsSection = TenantsSection()
    fleet: FleetSection = FleetSection()
    watchdog_s: Annotated[float, Field(gt=0)] | None = Field(
        5.0, description="A call into a child still running after this many seconds is logged (with the child's "
        "stack) and shown as stuck (kvcompose_child_state 3) until it returns; a request's lookup that a child keeps "
        "deferring ('ask again later') for longer counts as a failed lookup. null turns both off.",
    )
    receipts: bool = Field(
        False, description="Each finished request's kv_transfer_params (returned in the response) carry a "
        "'kvcompose' receipt: the prompt's tokens served by the GPU prefix cache, loaded by each loading child, "
        "and computed.",
    )

    @model_validator(mode="after")
    def _check_children(self) -> Pipeline:
        problems = [*_children_problems(self.children), *_shared_problems(self)]
        if problems:
            # Not a ValueError: pydantic would drop the field paths.
            raise PipelineConfigError(problems)
        return self

    def child_role(self, child: ChildConfig) -> KVRole:
        return child.role or self.role


def _shared_problems(pipeline: Pipeline) -> list[Problem]:
    """A shared tier named twice in one pipeline, or named where metrics are off (the fleet's samples are taken
    with the engine's curve, which metrics turn on)."""
    problems, first_seen = [], {}
    for index, child in enumerate(pipeline.children):
        if child.shared is None:
            continue
        if not pipeline.metrics.enabled:
            problems.append(Problem(("children", index, "shared"), "a shared tier needs metrics.enabled: true (the "
                                    "fleet's samples are taken with the engine's hit-ratio curve)"))
        if child.shared in first_seen:
            problems.append(Problem(("children", index, "shared"), f"tier {shown(child.shared)} is already named "
                                    f"by children[{first_seen[child.shared]}]; one child per shared tier"))
        first_seen.setdefault(child.shared, index)
    return problems


# (name, connector, has a module_path) of a child; None where the value is not a string.
_ChildIdentity = tuple[str | None, str | None, bool]


def _children_problems(children: Sequence[ChildConfig | Any]) -> list[Problem]:
    """Duplicate names and unknown connectors among ``children``.

    Also reads children that failed validation (raw mappings), so these
    problems are reported together with the others.
    """
    identities = [_identity(child) for child in children]
    return [*_duplicate_names(identities), *_unknown_connectors(identities)]


def _identity(child: ChildConfig | Any) -> _ChildIdentity:
    if isinstance(child, ChildConfig):
        return child.name, child.connector, child.module_path is not None
    if not isinstance(child, Mapping):
        return None, None, False
    name, connector = child.get("name"), child.get("connector")
    return (name if isinstance(name, str) else None, connector if isinstance(connector, str) else None,
            child.get("module_path") is not None)


def _duplicate_names(identities: list[_ChildIdentity]) -> list[Problem]:
    first_seen: dict[str, int] = {}
    problems = []
    for index, (name, _, _) in enumerate(identities):
        if name is None:
            continue
        if name in first_seen:
            problems.append(
                Problem(
                    ("children", index, "name"),
                    f"duplicate child name {shown(name)} (first used by children[{first_seen[name]}]); "
                    "names must be unique",
                )
            )
        else:
            first_seen[name] = index
    return problems


def _unknown_connectors(identities: list[_ChildIdentity]) -> list[Problem]:
    problems = []
    for index, (_, connector, has_module_path) in enumerate(identities):
        if connector is not None and not has_module_path and connector not in BUILTIN_CONNECTORS:
            message = f"unknown connector {shown(connector)}"
            if suggestion := did_you_mean(connector, BUILTIN_CONNECTORS):
                message += f"; did you mean {suggestion!r}?"
            else:
                message += "; set module_path for an out-of-tree connector"
            problems.append(Problem(("children", index, "connector"), message))
    return problems


def did_you_mean(name: str, known: Iterable[str]) -> str | None:
    by_lower = {k.lower(): k for k in known}
    matches = difflib.get_close_matches(name.lower(), by_lower, n=1, cutoff=0.6)
    return by_lower[matches[0]] if matches else None


def untyped_field(path: FieldPath) -> bool:
    """Whether ``path`` lies in a child's ``config`` or ``transfer``, passed on to vLLM as written."""
    return len(path) > 3 and path[0] == "children" and isinstance(path[1], int) and path[2] in ("config", "transfer")


def load_pipeline(source: str | Path | Mapping[str, Any] | PipelineDocument) -> Pipeline:
    """Load and validate a pipeline from a YAML/JSON file path, a mapping, or a read document.

    Raises :class:`PipelineConfigError` (and nothing else) for any bad input,
    listing every problem found, in file order.
    """
    if isinstance(source, PipelineDocument):
        document = source
    elif isinstance(source, Mapping):
        document = mapping_document(source)
    else:
        document = read_pipeline_source(Path(source))
    raw = document.data
    if not isinstance(raw, dict):
        got = "an empty document" if raw is None else f"a {type(raw).__name__}"
        line = 1 if document.label else None
        problems = document.problems or (Problem((), f"the pipeline must be a mapping, got {got}", line),)
        raise PipelineConfigError(problems, document.label)
    problems = list(document.problems)
    data, env_problems = interpolate_env(raw, retype=lambda path: untyped_field(path) and path not in document.quoted)
    _add_new(problems, env_problems)
    try:
        pipeline = Pipeline.model_validate(data)
    except PipelineConfigError as error:
        _add_new(problems, error.problems)
    except ValidationError as error:
        _add_new(problems, validation_problems(error, Pipeline))
        children = data.get("children")
        _add_new(problems, _children_problems(children) if isinstance(children, list) else [])
    if problems:
        located = [_with_line(problem, document) for problem in problems]
        located.sort(key=lambda problem: (problem.line is None, problem.line or 0))
        raise PipelineConfigError(located, document.label)
    return pipeline


def _add_new(problems: list[Problem], found: Iterable[Problem]) -> None:
    """Add the problems of a later check, except those at or under a field that already has one."""
    known = {problem.path for problem in problems}
    problems.extend(p for p in found if not any(p.path[:end] in known for end in range(len(p.path) + 1)))


def validation_problems(error: ValidationError, model: type[BaseModel] | None = None) -> list[Problem]:
    """One :class:`Problem` per pydantic error, worded for people editing a config.

    With ``model`` (the validated class), an unknown key is matched against
    the keys allowed where it stands.
    """
    problems = []
    for e in error.errors():
        loc, message = tuple(e["loc"]), _pydantic_message(e, model)
        if loc[-1:] == ("[key]",):  # pydantic's marker for an error in a mapping key
            loc, message = loc[:-1], f"the key {shown(loc[-2])} is invalid: {message}"
        problems.append(Problem(loc, message))
    return problems


def _pydantic_message(error: Mapping[str, Any], model: type[BaseModel] | None) -> str:
    if error["type"] == "extra_forbidden":
        if (removed := REMOVED_KEYS.get(tuple(str(part) for part in error["loc"]))) is not None:
            return removed
        known = _keys_at(model, error["loc"][:-1]) if model is not None else ()
        if suggestion := did_you_mean(str(error["loc"][-1]), known):
            return f"unknown key; did you mean {suggestion!r}?"
        return "unknown key (check the spelling; `kvcompose schema` lists every key)"
    if error["type"] == "missing":
        return "required key is missing"
    if error["type"] == "string_pattern_mismatch":
        return (f"{shown(error['input'])} is not label-safe: use 1-63 lowercase letters, digits, '_' or '-', "
                "starting with a letter or digit")
    return str(error["msg"]).removeprefix("Value error, ")


def _keys_at(model: type[BaseModel], loc: Sequence[str | int]) -> list[str]:
    """The keys allowed at ``loc`` inside ``model`` (list indexes included in ``loc``)."""
    annotation: Any = model
    for part in loc:
        if isinstance(part, int):
            annotation = next(iter(typing.get_args(annotation)), None)
        elif _is_model(annotation) and part in annotation.model_fields:
            annotation = annotation.model_fields[part].annotation
        else:
            return []
    return list(annotation.model_fields) if _is_model(annotation) else []


def _is_model(annotation: Any) -> bool:
    return isinstance(annotation, type) and issubclass(annotation, BaseModel)


def _with_line(problem: Problem, document: PipelineDocument) -> Problem:
    if problem.line is not None:
        return problem
    return Problem(problem.path, problem.message, document.line_of(problem.path))
