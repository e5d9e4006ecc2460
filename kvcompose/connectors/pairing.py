"""Do the two servers of a prefill/decode pair run compatible pipelines?

NIXL refuses the KV handshake between two servers whose compatibility hash
differs ("NIXL compatibility hash mismatch"), and its message names no
kvcompose setting. The hash covers, besides the model and vLLM version,
whether the hybrid KV cache manager is on (decided by the composite class) and
the NIXL child's transfer mode (decided by its connector).

So the server that prefills a request describes its pipeline in the
``kv_transfer_params`` it hands out for a remote decode (key ``kvcompose``,
only where they carry ``do_remote_prefill``); the server that
receives them compares that description with its own pipeline before NIXL's
handshake and logs which pipeline setting differs. The rule it checks is the
documented one: both servers run the same children (names and connectors)
under the same composite class. Child configs (a storage path) may differ.

``kv_transfer_params`` arrive in request bodies, so a client can send any
``kvcompose`` entry. An entry is read only if every name in it is a label-safe
name or a class name; otherwise the log names the field at fault and a hash
of the entry, never its content. Each distinct problem is logged once while
remembered, and at most a few lines a minute (:class:`LogThrottle`).
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from kvcompose.config import LABEL_SAFE_PATTERN
from kvcompose.log_throttle import LogThrottle
from kvcompose.logs import get_logger

logger = get_logger("pairing")

PAIRING_KEY = "kvcompose"

# What a name in a received entry may look like: no quoting, control character or length to worry about.
_NAME = re.compile(LABEL_SAFE_PATTERN)
_CLASS_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,127}")
MAX_REMOTE_CHILDREN = 64  # far more than any pipeline has; a longer list is not a pipeline description
MAX_HASHED_VALUES = 10_000  # of a received entry, for its hash in the log (a description has a few dozen)

HMA_ADVICE = (
    "The connector class in --kv-transfer-config decides it: KVComposeConnector turns it off, "
    "KVComposeHMAConnector leaves it on (unless --disable-hybrid-kv-cache-manager); use the same on both servers"
)


class ChildSpecLike(Protocol):
    @property
    def name(self) -> str: ...

    @property
    def class_name(self) -> str: ...

    @property
    def config(self) -> Any: ...  # kvcompose.config.ChildConfig


@dataclass(frozen=True)
class ChildShape:
    name: str
    connector: str  # as written in the pipeline file
    connector_class: str  # the class vLLM resolved it to (NixlConnector is NixlPullConnector)

    def describe(self) -> str:
        if self.connector == self.connector_class:
            return f"{self.name!r} ({self.connector})"
        return f"{self.name!r} ({self.connector}, class {self.connector_class})"


@dataclass(frozen=True)
class PipelineShape:
    """What of a pipeline must match on the other server of a pair."""

    pipeline: str
    hybrid_kv_cache_manager: bool
    children: tuple[ChildShape, ...]

    @classmethod
    def of(cls, pipeline: str, specs: Iterable[ChildSpecLike], hybrid_kv_cache_manager: bool) -> PipelineShape:
        children = tuple(ChildShape(s.name, s.config.connector, s.class_name) for s in specs)
        return cls(pipeline, hybrid_kv_cache_manager, children)

    def to_params(self) -> dict[str, Any]:
        return {
            "pipeline": self.pipeline,
            "hybrid_kv_cache_manager": self.hybrid_kv_cache_manager,
            "children": [[c.name, c.connector, c.connector_class] for c in self.children],
        }

    @classmethod
    def from_params(cls, data: Any) -> PipelineShape:
        """Raises :class:`MalformedEntry` when ``data`` is not what :meth:`to_params` writes."""
        if not isinstance(data, Mapping):
            raise MalformedEntry(PAIRING_KEY, f"not a mapping ({_kind(data)})")
        pipeline = _field(data, "pipeline")
        if not isinstance(pipeline, str) or not _NAME.fullmatch(pipeline):
            raise MalformedEntry(f"{PAIRING_KEY}.pipeline", "not a label-safe pipeline name")
        hybrid = _field(data, "hybrid_kv_cache_manager")
        if not isinstance(hybrid, bool):
            raise MalformedEntry(f"{PAIRING_KEY}.hybrid_kv_cache_manager", f"not a boolean ({_kind(hybrid)})")
        entries = _field(data, "children")
        if not isinstance(entries, list) or not 0 < len(entries) <= MAX_REMOTE_CHILDREN:
            raise MalformedEntry(f"{PAIRING_KEY}.children", f"not a list of 1 to {MAX_REMOTE_CHILDREN} children")
        return cls(pipeline, hybrid, tuple(_child(index, entry) for index, entry in enumerate(entries)))


class MalformedEntry(ValueError):
    """A ``kvcompose`` entry in kv_transfer_params that is not a pipeline description.

    The message names the field at fault; it quotes nothing of the entry, which comes from a request body.
    """

    def __init__(self, field: str, fault: str) -> None:
        super().__init__(f"malformed {PAIRING_KEY!r} entry in kv_transfer_params: {field}: {fault}")
        self.field = field


def _field(data: Mapping[Any, Any], key: str) -> Any:
    if key not in data:
        raise MalformedEntry(f"{PAIRING_KEY}.{key}", "missing")
    return data[key]


def _child(index: int, entry: Any) -> ChildShape:
    if not isinstance(entry, list) or len(entry) != 3 or not all(isinstance(part, str) for part in entry):
        raise MalformedEntry(f"{PAIRING_KEY}.children[{index}]", "not [name, connector, class] strings")
    name, connector, connector_class = entry
    if not _NAME.fullmatch(name):
        raise MalformedEntry(f"{PAIRING_KEY}.children[{index}][0]", "not a label-safe child name")
    if not _CLASS_NAME.fullmatch(connector) or not _CLASS_NAME.fullmatch(connector_class):
        raise MalformedEntry(f"{PAIRING_KEY}.children[{index}]", "connector or class is not a class name")
    return ChildShape(name, connector, connector_class)


def _kind(value: Any) -> str:
    """The JSON kind of a value, for messages that must not quote it."""
    kinds = {dict: "an object", list: "an array", str: "a string", bool: "a boolean", int: "a number",
             float: "a number", type(None): "null"}
    return kinds.get(type(value), "not JSON")


def entry_hash(entry: Any) -> str:
    """A short hash of a received entry, to find the request's params without logging them.

    The entry comes from a request body: it is walked without recursion (a client may nest it hundreds of levels
    deep, past Python's recursion limit) and at most :data:`MAX_HASHED_VALUES` of its values are read."""
    digest = hashlib.sha256()
    pending = [entry]
    for _ in range(MAX_HASHED_VALUES):
        if not pending:
            break
        value = pending.pop()
        if isinstance(value, Mapping):
            digest.update(b"{%d" % len(value))
            for key in sorted(value, key=str):
                digest.update(_hashed_scalar(key))
                pending.append(value[key])
        elif isinstance(value, (list, tuple)):
            digest.update(b"[%d" % len(value))
            pending.extend(reversed(value))
        else:
            digest.update(_hashed_scalar(value))
    return digest.hexdigest()[:16]


def _hashed_scalar(value: Any) -> bytes:
    text = str(value) if isinstance(value, (str, int, float, bool, type(None))) else ""
    return f"{type(value).__name__}:{len(text)}:{text}".encode("utf-8", "backslashreplace")


def mismatches(local: PipelineShape, remote: PipelineShape) -> list[str]:
    """Every pipeline setting at which ``local`` and ``remote`` differ, each
    message naming the setting (as a field path of the local pipeline file)."""
    there = f"pipeline {remote.pipeline!r} of the server that prefilled this request"
    here = f"pipeline {local.pipeline!r}"
    problems = []
    if local.hybrid_kv_cache_manager != remote.hybrid_kv_cache_manager:
        state = {True: "on", False: "off"}
        problems.append(
            f"the hybrid KV cache manager is {state[local.hybrid_kv_cache_manager]} for {here} and "
            f"{state[remote.hybrid_kv_cache_manager]} for {there}; NIXL's compatibility hash covers it, so the "
            f"KV handshake fails. {HMA_ADVICE}"
        )
    remote_by_name = {c.name: c for c in remote.children}
    local_names = {c.name for c in local.children}
    for index, child in enumerate(local.children):
        if child.name not in remote_by_name:
            problems.append(
                f"children[{index}].name: child {child.describe()} of {here} is not in {there} "
                f"(its children: {_names(remote.children)}); both servers of a pair run the same children"
            )
            continue
        remote_child = remote_by_name[child.name]
        if child.connector_class != remote_child.connector_class:
            problems.append(
                f"children[{index}].connector: child {child.name!r} is {child.connector!r} "
                f"(class {child.connector_class}) here but {remote_child.connector!r} "
                f"(class {remote_child.connector_class}) in {there}; both servers need the same connector "
                "for each child"
            )
    for child in remote.children:
        if child.name not in local_names:
            problems.append(
                f"children: {there} has child {child.describe()}, which {here} lacks; "
                "both servers of a pair run the same children"
            )
    return problems


def _names(children: tuple[ChildShape, ...]) -> str:
    return ", ".join(repr(c.name) for c in children) or "none"


class PairingCheck:
    """Stamps outgoing kv_transfer_params with this pipeline's shape and
    checks incoming ones against it, logging each distinct problem once."""

    def __init__(self, local: PipelineShape, throttle: LogThrottle | None = None) -> None:
        self.local = local
        self._stamp = local.to_params()
        self.throttle = throttle or LogThrottle()

    def stamp(self, params: dict[str, Any] | None) -> dict[str, Any] | None:
        """Add this pipeline's shape to kv_transfer_params that hand a prefilled
        request to another server (``do_remote_prefill``: vLLM's P/D convention)."""
        if not params or not params.get("do_remote_prefill"):
            return params
        if PAIRING_KEY in params:
            raise RuntimeError(
                f"kvcompose: a child returns kv_transfer_params key {PAIRING_KEY!r}, which kvcompose reserves "
                "for describing the pipeline to the other server of a prefill/decode pair"
            )
        params[PAIRING_KEY] = self._stamp
        return params

    def problems(self, params: Mapping[str, Any] | None) -> list[str]:
        """What is wrong with pairing this server with the one that prefilled the request."""
        if not params or not params.get("do_remote_prefill"):
            return []
        description = params.get(PAIRING_KEY)
        if description is None:
            state = "on" if self.local.hybrid_kv_cache_manager else "off"
            return [
                f"this request's kv_transfer_params ask for a remote prefill but carry no {PAIRING_KEY!r} key: the "
                f"server that prefilled it runs no kvcompose pipeline (or the proxy dropped the key), so kvcompose "
                f"cannot check the pair. NIXL's compatibility hash covers the hybrid KV cache manager, which is "
                f"{state} for pipeline {self.local.pipeline!r}; a bare NixlConnector leaves it on. Run both "
                "servers with kvcompose pipelines of the same shape"
            ]
        try:
            remote = PipelineShape.from_params(description)
        except MalformedEntry as error:
            return [str(error)]
        return mismatches(self.local, remote)

    def check(self, params: Mapping[str, Any] | None) -> None:
        """Log each problem with this request's pairing, the first time it is seen (within the throttle's rate)."""
        for problem in self.problems(params):
            if not self.throttle.admit(problem):
                continue
            assert params is not None  # there are problems only with params
            held_back = self.throttle.take_suppressed()
            logger.error(
                "prefill/decode pipelines do not match", pipeline=self.local.pipeline, problem=problem,
                entry_sha256=entry_hash(params.get(PAIRING_KEY)), **({"suppressed": held_back} if held_back else {}),
            )
