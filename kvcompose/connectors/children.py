"""Building the named children of a pipeline through vLLM's KVConnectorFactory."""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from vllm.config.kv_transfer import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorRole

from kvcompose.child_spec import ChildSpec
from kvcompose.compat import check_name_lookups
from kvcompose.config import ChildConfig, KVRole, Pipeline, load_pipeline
from kvcompose.wire.native import class_path

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

    from kvcompose.connectors.isolation import ChildGuard

PIPELINE_KEY = "pipeline"


class ChildStartupError(RuntimeError):
    """A child connector could not be built; names the child and the cause."""


def pipeline_from_vllm_config(vllm_config: VllmConfig) -> Pipeline:
    """Read the pipeline named by ``kv_connector_extra_config["pipeline"]``."""
    ktc = vllm_config.kv_transfer_config
    extra = ktc.kv_connector_extra_config if ktc is not None else {}
    return pipeline_from_extra_config(extra)


def pipeline_from_extra_config(extra_config: Mapping[str, Any]) -> Pipeline:
    source = extra_config.get(PIPELINE_KEY)
    if source is None:
        raise ValueError(
            'KVComposeConnector needs kv_connector_extra_config={"pipeline": <file path or mapping>}; '
            "`kvcompose render PIPELINE.yaml` prints a complete --kv-transfer-config"
        )
    return load_pipeline(source)


def child_transfer_config(child: ChildConfig, role: KVRole, parent: KVTransferConfig | None) -> KVTransferConfig:
    """The child's own KVTransferConfig, as MultiConnector builds one per child."""
    fields: dict[str, Any] = {
        "engine_id": parent.engine_id if parent is not None else None,
        **child.transfer,
        "kv_connector": child.connector,
        "kv_connector_module_path": child.module_path,
        "kv_role": role,
        "kv_connector_extra_config": dict(child.config),
    }
    return KVTransferConfig(**fields)


def child_specs(vllm_config: VllmConfig, pipeline: Pipeline) -> list[ChildSpec]:
    """Resolve every child's class and config without constructing it."""
    specs = []
    for index, child in enumerate(pipeline.children):
        connector_cls, transfer_config = _resolve(pipeline, index, vllm_config.kv_transfer_config)
        child_vllm_config = copy.copy(vllm_config)
        child_vllm_config.kv_transfer_config = transfer_config
        specs.append(ChildSpec(index, child, connector_cls, child_vllm_config))
    return specs


def child_classes(pipeline: Pipeline) -> list[type[KVConnectorBase_V1]]:
    """Every child's connector class, for class-level hooks that get no VllmConfig."""
    return [connector_cls for connector_cls, _ in resolved_children(pipeline, None)]


def resolved_children(
    pipeline: Pipeline, parent: KVTransferConfig | None
) -> list[tuple[type[KVConnectorBase_V1], KVTransferConfig]]:
    """Every child's connector class and its own KVTransferConfig, for class-level hooks that get the parent's."""
    return [_resolve(pipeline, index, parent) for index in range(len(pipeline.children))]


def _resolve(
    pipeline: Pipeline, index: int, parent: KVTransferConfig | None
) -> tuple[type[KVConnectorBase_V1], KVTransferConfig]:
    child = pipeline.children[index]
    try:
        ktc = child_transfer_config(child, pipeline.child_role(child), parent)
        return KVConnectorFactory.get_connector_class(ktc), ktc
    except Exception as error:
        raise ChildStartupError(_describe_failure(child, index, error)) from error


def construct_child(spec: ChildSpec, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> KVConnectorBase_V1:
    try:
        check_name_lookups(spec.config, spec.connector_cls)
        return spec.connector_cls(spec.vllm_config, role, kv_cache_config)
    except Exception as error:
        raise ChildStartupError(_describe_failure(spec.config, spec.index, error)) from error


def _describe_failure(child: ChildConfig, index: int, error: Exception) -> str:
    where = f" from {child.module_path}" if child.module_path else ""
    return (
        f"kvcompose: child {child.name!r} (children[{index}], {child.connector}{where}) failed to start: "
        f"{type(error).__name__}: {error}"
    )


class Child:
    """A constructed child connector, its place in the pipeline and its error isolation.

    The composite calls it through :class:`~kvcompose.connectors.calls.ChildCalls`, which makes each of its
    calls once (gated, timed, traced, isolated as needed); ``connector`` is the child itself.
    """

    def __init__(self, spec: ChildSpec, connector: KVConnectorBase_V1, guard: ChildGuard) -> None:
        self.spec = spec
        self.connector = connector
        self.guard = guard  # its error isolation and circuit breaker
        self.name = spec.name
        self.index = spec.index
        self.load = spec.config.load
        self.save = spec.config.save
        self.class_path = class_path(spec.connector_cls)

    def inherits(self, operation: str) -> bool:
        """Does the child keep KVConnectorBase_V1's own implementation of ``operation`` (a constant answer)?"""
        base = getattr(KVConnectorBase_V1, operation, None)
        return base is not None and getattr(getattr(self.connector, operation, None), "__func__", None) is base
