"""What the composite sends from the scheduler to its workers, and back."""

from __future__ import annotations

from dataclasses import dataclass

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata, KVConnectorWorkerMetadata

from kvcompose.tracing import TracedRequest


@dataclass
class KVComposeMetadata(KVConnectorMetadata):
    """One metadata object per child (pipeline order), plus shared bookkeeping."""

    per_child: tuple[KVConnectorMetadata | None, ...]
    # request id -> how many async savers beyond the first still owe a
    # finished_sending for it; lets workers report a request once all are done.
    extra_async_saves: dict[str, int] | None = None
    # The step's sampled requests, so worker-side spans join their traces.
    traced_requests: tuple[TracedRequest, ...] | None = None


@dataclass
class KVComposeWorkerMetadata(KVConnectorWorkerMetadata):
    """Per-child worker metadata (pipeline order; None where a child sent none)."""

    per_child: tuple[KVConnectorWorkerMetadata | None, ...]

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        if not isinstance(other, KVComposeWorkerMetadata) or len(other.per_child) != len(self.per_child):
            raise TypeError(f"cannot aggregate KVComposeWorkerMetadata with {other!r}")
        merged = tuple(
            mine if theirs is None else theirs if mine is None else mine.aggregate(theirs)
            for mine, theirs in zip(self.per_child, other.per_child, strict=True)
        )
        return KVComposeWorkerMetadata(per_child=merged)
