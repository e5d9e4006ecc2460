"""Children's own KVConnectorStats, carried per child name across processes.

vLLM ships connector stats from workers to the front-end as plain dicts and
rebuilds them with the connector class's ``build_kv_connector_stats``. The
front-end has no pipeline at hand, so each child's entry names its class.
"""

from __future__ import annotations

import copy
import importlib
from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

CLASS_KEY = "class"
STATS_KEY = "stats"


def class_path(cls: type) -> str:
    return f"{cls.__module__}:{cls.__qualname__}"


def import_class(path: str) -> type:
    module, _, qualname = path.partition(":")
    target: Any = importlib.import_module(module)
    for part in qualname.split("."):
        target = getattr(target, part)
    return target


@dataclass
class NativeStats:
    """One child's own stats object and the class that can rebuild it."""

    connector_class: str
    stats: KVConnectorStats

    def to_dict(self) -> dict[str, Any]:
        return {CLASS_KEY: self.connector_class, STATS_KEY: self.stats.to_dict()}

    @classmethod
    def from_payload(cls, payload: Any) -> NativeStats | None:
        if isinstance(payload, NativeStats):
            return payload
        connector_cls = import_class(payload[CLASS_KEY])
        stats = connector_cls.build_kv_connector_stats(data=payload[STATS_KEY])
        return cls(payload[CLASS_KEY], stats) if stats is not None else None

    @staticmethod
    def stats_data(payload: Any) -> dict[str, Any]:
        """The child's stats as its own Prometheus metrics read them (its ``to_dict``), from a payload or object."""
        return payload.stats.to_dict() if isinstance(payload, NativeStats) else payload[STATS_KEY]

    def add(self, other: NativeStats) -> None:
        """Add ``other``'s stats into these (the child's own ``aggregate``; ``other`` is not modified)."""
        self.stats = self.stats.aggregate(other.stats)

    def copy(self) -> NativeStats:
        return NativeStats(self.connector_class, copy.deepcopy(self.stats))
