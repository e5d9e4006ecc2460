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
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from kvcompose.logs import get_logger

logger = get_logger("pairing")

PAIRING_KEY = "kvcompose"

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
        """Raises ValueError when ``data`` is not what :meth:`to_params` writes."""
        try:
            children = tuple(ChildShape(*map(str, entry)) for entry in data["children"])
            return cls(str(data["pipeline"]), bool(data["hybrid_kv_cache_manager"]), children)
        except (KeyError, TypeError, ValueError) as error:
            raise ValueError(f"malformed {PAIRING_KEY!r} entry in kv_transfer_params: {data!r}") from error


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

    def __init__(self, local: PipelineShape) -> None:
        self.local = local
        self._stamp = local.to_params()
        self._reported: set[str] = set()

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
        except ValueError as error:
            return [str(error)]
        return mismatches(self.local, remote)

    def check(self, params: Mapping[str, Any] | None) -> None:
        """Log each problem with this request's pairing, the first time it is seen."""
        for problem in self.problems(params):
            if problem not in self._reported:
                self._reported.add(problem)
                logger.error("prefill/decode pipelines do not match", pipeline=self.local.pipeline, problem=problem)
