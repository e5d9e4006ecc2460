"""ChildSpec: what is known of a pipeline's child before it is constructed.

Every layer reads it (the composite builds children from it; the
instrumentation, metrics and tracing name and classify them by it), so it
lives below them all.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

    from kvcompose.config import ChildConfig


@dataclass(frozen=True)
class ChildSpec:
    """A child's place in the pipeline, its configuration, its connector class and its own VllmConfig."""

    index: int
    config: ChildConfig
    connector_cls: type[KVConnectorBase_V1]
    vllm_config: VllmConfig

    @property
    def name(self) -> str:
        return self.config.name

    @property
    def class_name(self) -> str:
        return self.connector_cls.__name__
