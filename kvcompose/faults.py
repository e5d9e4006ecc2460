"""What FaultInjectionConnector injects, and the seeded draws that decide when.

The settings are the connector's ``kv_connector_extra_config``::

    seed: 7
    inner: {connector: ExampleConnector, config: {shared_storage_path: /tmp/x}}
    faults:
      raise: {save_kv_layer: 0.5}                              # operation -> probability
      latency: {wait_for_save: {probability: 1.0, seconds: 0.01}}
      lie: 0.3          # probability that a hit is reported, then not loaded

Every decision is a hash of (seed, kind, subject, how many times this subject
was drawn before), not a shared random stream, so the scheduler and every
worker process decide alike and a run with the same seed and the same calls
repeats its faults exactly. This module does not import vLLM.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Mapping
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from kvcompose.config import ChildConfig, LabelSafeName, did_you_mean, validation_problems
from kvcompose.errors import PipelineConfigError
from kvcompose.operations import CONNECTOR_OPERATIONS, HMA_OPERATIONS

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


class FaultPlan:
    """Seeded decisions for one connector instance."""

    def __init__(self, seed: int, faults: Faults) -> None:
        self.seed = seed
        self.faults = faults
        self._counts: dict[tuple[str, str], int] = {}

    def happens(self, kind: str, subject: str, probability: float) -> bool:
        """The next decision for (kind, subject): True with ``probability``."""
        key = (kind, subject)
        count = self._counts.get(key, 0)
        self._counts[key] = count + 1
        return probability > 0.0 and draw(self.seed, kind, subject, count) < probability

    def lies_about(self, request_id: str) -> bool:
        return self.happens("lie", request_id, self.faults.lie)

    def forget(self, request_id: str) -> None:
        """Drop a finished request's draw count."""
        self._counts.pop(("lie", request_id), None)

    def has_faults(self, operation: str) -> bool:
        return operation in self.faults.raise_ or operation in self.faults.latency

    def before(self, operation: str) -> None:
        """Inject this call's faults: sleep if latency is drawn, then raise if a failure is."""
        if (latency := self.faults.latency.get(operation)) is not None and self.happens(
            "latency", operation, latency.probability
        ):
            time.sleep(latency.seconds)
        if (probability := self.faults.raise_.get(operation)) is not None and self.happens(
            "raise", operation, probability
        ):
            raise InjectedFault(f"fault injected into {operation} (probability {probability}, seed {self.seed})")

    def wrap(self, operation: str, call: Callable[..., Any]) -> Callable[..., Any]:
        """``call`` preceded by the operation's faults; ``call`` itself when it has none."""
        if not self.has_faults(operation):
            return call

        def faulty(*args: Any, **kwargs: Any) -> Any:
            self.before(operation)
            return call(*args, **kwargs)

        return faulty
