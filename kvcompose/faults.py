"""What FaultInjectionConnector injects, and the seeded draws that decide when.

The settings are the connector's ``kv_connector_extra_config``::

    seed: 7
    inner: {connector: ExampleConnector, config: {shared_storage_path: /tmp/x}}
    faults:
      raise: {save_kv_layer: 0.5}                              # operation -> probability
      latency: {wait_for_save: {probability: 1.0, seconds: 0.01}}
      lie: 0.3          # probability that a hit is reported, then not loaded

Or, to change the faults of a running engine, ``faults_file: /etc/kvcompose/faults.yaml``
instead of ``faults``: the file holds what ``faults`` would, and is read again
whenever it changes (a ``stat`` on every call, so a change applies to the next
call in every process). An absent or empty file injects nothing; a file that
is not valid is logged, naming the field, and the faults stay as they were.
Replace the file (write another, rename it over) so no process reads it half
written.

Every decision is a hash of (seed, kind, subject, how many times this subject
was drawn before), not a shared random stream, so the scheduler and every
worker process decide alike and a run with the same seed and the same calls
repeats its faults exactly. This module does not import vLLM.
"""

from __future__ import annotations

import hashlib
import os
import time
from collections import Counter
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from kvcompose.config import ChildConfig, LabelSafeName, did_you_mean, validation_problems
from kvcompose.errors import PipelineConfigError, Problem
from kvcompose.logs import get_logger
from kvcompose.operations import CONNECTOR_OPERATIONS, HMA_OPERATIONS
from kvcompose.source import read_pipeline_source

logger = get_logger("fault_injection")

# Every connector operation FaultInjectionConnector passes to its inner
# connector, and so every operation a fault may target (it does not support HMA).
FAULT_OPERATIONS: tuple[str, ...] = tuple(op for op in CONNECTOR_OPERATIONS if op not in HMA_OPERATIONS)

Probability = Annotated[float, Field(ge=0.0, le=1.0)]


class InjectedFault(RuntimeError):
    """Raised on purpose by FaultInjectionConnector (metrics show ``error_type="InjectedFault"``)."""


class _Settings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class LatencyFault(_Settings):
    """Sleep before an operation reaches the inner connector."""

    probability: Probability = Field(1.0, description="Chance that a call is delayed.")
    seconds: Annotated[float, Field(ge=0.0, allow_inf_nan=False)] = Field(description="How long to sleep.")


class Faults(_Settings):
    """The faults to inject; all off by default."""

    raise_: dict[str, Probability] = Field(
        default_factory=dict,
        alias="raise",
        description="Operation -> chance that a call raises InjectedFault instead of reaching the inner connector.",
    )
    latency: dict[str, LatencyFault] = Field(default_factory=dict, description="Operation -> added latency.")
    lie: Probability = Field(
        0.0,
        description="Chance that a synchronous hit of the inner connector is reported but never loaded: the "
        "worker reports its blocks through get_block_ids_with_load_errors.",
    )

    @field_validator("raise_", "latency")
    @classmethod
    def _known_operations(cls, by_operation: dict[str, Any]) -> dict[str, Any]:
        for operation in by_operation:
            if operation not in FAULT_OPERATIONS:
                message = f"unknown operation {operation!r}"
                if suggestion := did_you_mean(operation, frozenset(FAULT_OPERATIONS)):
                    message += f"; did you mean {suggestion!r}?"
                raise ValueError(f"{message} (allowed: {', '.join(FAULT_OPERATIONS)})")
        return by_operation


# The keys of a pipeline child that describe a connector; the others (name,
# load, save, error handling, ...) are about its place in a pipeline.
INNER_KEYS = ("connector", "module_path", "role", "config", "transfer")


class InnerConnector(ChildConfig):
    """The wrapped connector, described with a pipeline child's connector keys
    (:data:`INNER_KEYS`); its role defaults to the fault injector's own."""

    name: LabelSafeName = "inner"

    @model_validator(mode="before")
    @classmethod
    def _connector_keys_only(cls, data: Any) -> Any:
        if isinstance(data, Mapping):
            for key in data:
                if key in ChildConfig.model_fields and key not in INNER_KEYS:
                    raise ValueError(f"{key!r} belongs on the pipeline child, not on the wrapped connector; remove it")
        return data


class FaultInjectionConfig(_Settings):
    """FaultInjectionConnector's ``kv_connector_extra_config``."""

    seed: int = Field(0, description="Same seed and same calls, same faults.")
    inner: InnerConnector = Field(description="The connector that does the real work.")
    faults: Faults = Faults()
    faults_file: Annotated[str, Field(min_length=1)] | None = Field(
        None,
        description="A YAML or JSON file holding the faults instead, read again whenever it changes: the faults "
        "of a running engine can change. Absent or empty: no faults.",
    )

    @model_validator(mode="after")
    def _one_source_of_faults(self) -> FaultInjectionConfig:
        if self.faults_file is not None and "faults" in self.model_fields_set:
            raise ValueError("set faults or faults_file, not both")
        return self


def fault_injection_config(extra_config: Mapping[str, Any]) -> FaultInjectionConfig:
    """Validate the connector's settings; every problem names its field."""
    try:
        return FaultInjectionConfig.model_validate(dict(extra_config))
    except ValidationError as error:
        raise PipelineConfigError(validation_problems(error), "FaultInjectionConnector config") from None


def draw(seed: int, kind: str, subject: str, count: int) -> float:
    """A number in [0, 1), the same in every process for the same arguments."""
    key = f"{seed}\0{kind}\0{subject}\0{count}".encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "big") / 2.0**64


class FaultsFile:
    """Faults read from a file, again whenever the file changes."""

    def __init__(self, path: str) -> None:
        self.path = Path(path)
        self._stamp: tuple[int, ...] | None = None

    def changed(self) -> Faults | None:
        """The file's faults if it changed since the last call (no faults once it is gone), else None.

        A file that cannot be read or is not valid is logged and answers None."""
        try:
            stat = os.stat(self.path)
        except FileNotFoundError:
            stamp: tuple[int, ...] | None = None
        else:
            stamp = (stat.st_mtime_ns, stat.st_ctime_ns, stat.st_size, stat.st_ino)
        if stamp == self._stamp:
            return None
        self._stamp = stamp
        if stamp is None:
            return Faults()
        try:
            document = read_pipeline_source(self.path)
            if document.problems:
                raise PipelineConfigError(document.problems, document.label)
            try:
                return Faults.model_validate(document.data or {})
            except ValidationError as error:
                problems = [Problem(p.path, p.message, document.line_of(p.path)) for p in validation_problems(error)]
                raise PipelineConfigError(problems, document.label) from None
        except PipelineConfigError as error:
            logger.error("faults file not applied; the faults stay as they were", problems=str(error))
            return None


class FaultPlan:
    """Seeded decisions for one connector instance."""

    def __init__(
        self, seed: int, faults: Faults, source: FaultsFile | None = None,
        refuse: Callable[[Faults], str | None] = lambda faults: None,
    ) -> None:
        self.seed = seed
        self.faults = faults
        self._source = source
        self._refuse = refuse
        self._counts: dict[tuple[str, str], int] = {}
        self.injected: Counter[str] = Counter()  # operation (or "lie") -> faults injected
        self.refresh()

    @classmethod
    def of(cls, config: FaultInjectionConfig, refuse: Callable[[Faults], str | None]) -> FaultPlan:
        """The plan of a connector's settings; ``refuse`` says why faults cannot run here, if they cannot."""
        source = FaultsFile(config.faults_file) if config.faults_file is not None else None
        return cls(config.seed, config.faults, source, refuse)

    def refresh(self) -> None:
        """Take the faults file's new faults, if it changed and they can run here."""
        if self._source is None or (faults := self._source.changed()) is None:
            return
        if (refusal := self._refuse(faults)) is not None:
            logger.error("faults file not applied; the faults stay as they were", problems=refusal)
            return
        self.faults = faults
        logger.warning("faults changed", path=str(self._source.path), **describe(faults))

    def happens(self, kind: str, subject: str, probability: float) -> bool:
        """The next decision for (kind, subject): True with ``probability``."""
        key = (kind, subject)
        count = self._counts.get(key, 0)
        self._counts[key] = count + 1
        return probability > 0.0 and draw(self.seed, kind, subject, count) < probability

    def lies_about(self, request_id: str) -> bool:
        if self.faults.lie > 0.0 and self.happens("lie", request_id, self.faults.lie):
            self.injected["lie"] += 1
            return True
        return False

    def forget(self, request_id: str) -> None:
        """Drop a finished request's draw count."""
        self._counts.pop(("lie", request_id), None)

    @property
    def requests_drawn(self) -> int:
        """Requests with a lie draw count (each is forgotten when the request finishes)."""
        return sum(1 for kind, _ in self._counts if kind == "lie")

    def has_faults(self, operation: str) -> bool:
        """May calls of ``operation`` ever fail or wait? (Always, when the faults come from a file.)"""
        return self._source is not None or operation in self.faults.raise_ or operation in self.faults.latency

    def before(self, operation: str) -> None:
        """Inject this call's faults: sleep if latency is drawn, then raise if a failure is."""
        if self._source is not None:
            self.refresh()
        if (latency := self.faults.latency.get(operation)) is not None and self.happens(
            "latency", operation, latency.probability
        ):
            time.sleep(latency.seconds)
        if (probability := self.faults.raise_.get(operation)) is not None and self.happens(
            "raise", operation, probability
        ):
            self.injected[operation] += 1
            raise InjectedFault(f"fault injected into {operation} (probability {probability}, seed {self.seed})")

    def wrap(self, operation: str, call: Callable[..., Any]) -> Callable[..., Any]:
        """``call`` preceded by the operation's faults; ``call`` itself when it can have none."""
        if not self.has_faults(operation):
            return call

        def faulty(*args: Any, **kwargs: Any) -> Any:
            self.before(operation)
            return call(*args, **kwargs)

        return faulty


def describe(faults: Faults) -> dict[str, Any]:
    """The faults as log fields."""
    return {
        "raise_probability": dict(faults.raise_),
        "latency": {op: f.model_dump() for op, f in faults.latency.items()},
        "lie_probability": faults.lie,
    }
