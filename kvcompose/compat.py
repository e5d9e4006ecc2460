"""What differs between the vLLM releases kvcompose runs on (0.30-0.33), detected from the installed vLLM.

One kvcompose release imports and runs on each of them. The connector API
only grows: 0.31 added ``get_mem_pool_context``, 0.32
``get_loaded_kv_cache_group_ids`` and ``get_external_cache_hit_sources``, 0.33
sleep mode (``supports_sleep_mode``, ``unregister_kv_caches``,
``restore_kv_caches``). kvcompose implements all of them; a release that does
not know a method never calls it. Where a child's class predates a method the
composite needs, the base class's default stands in (see :func:`supports_sleep_mode`).

What a method set cannot show is vLLM finding a connector by name:
``KVTransferConfig.has_connector(name)`` sees the connector named in
``--kv-transfer-config`` and MultiConnector's children, never a kvcompose child.
:func:`check_name_lookups` refuses such a child at start-up where it would
run wrongly and warns where it escapes one of vLLM's checks (:data:`NAME_LOOKUPS`).
``tests/vllm_api/`` holds each release's API and lookups;
``tests/test_conformance.py`` fails when a new release adds one.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from vllm.config import CacheConfig

from kvcompose.config import ChildConfig
from kvcompose.logs import get_logger

if TYPE_CHECKING:
    from vllm.config.kv_transfer import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

logger = get_logger("compat")

SIMPLE_CPU_OFFLOAD = "SimpleCPUOffloadConnector"

# vLLM 0.33 sizes SimpleCPUOffloadConnector's CPU pool from its workers' count,
# kept in this CacheConfig field, for a connector it finds by name.
SIZED_BY_NAME = "simple_cpu_offload_num_blocks" in {field.name for field in dataclasses.fields(CacheConfig)}

# Connector name -> what vLLM's has_connector(name) does, which a kvcompose child
# of that class escapes. SimpleCPUOffloadConnector is handled apart, see
# simple_cpu_offload_problem.
_NIXL_CHECKS = "vLLM's NIXL checks (the Mamba conv-state layout on CPU, refusing --enable-return-routed-experts)"
_ROUTED_EXPERTS = "vLLM's refusal of --enable-return-routed-experts with this connector"
NAME_LOOKUPS: dict[str, str] = {
    "NixlConnector": _NIXL_CHECKS + " and its decode context parallelism checks",
    "NixlPullConnector": _NIXL_CHECKS,
    "NixlPushConnector": _NIXL_CHECKS,
    "MooncakeConnector": _ROUTED_EXPERTS,
    "MoRIIOConnector": _ROUTED_EXPERTS,
    "HiSparseConnector": "the HiSparse attention config vLLM turns on for this connector (set it yourself)",
}


def supports_sleep_mode(connector_cls: type[KVConnectorBase_V1], kv_transfer_config: KVTransferConfig) -> bool:
    """The class's answer; a class from before vLLM 0.33 has none, and the base class's default is True."""
    answer = getattr(connector_cls, "supports_sleep_mode", None)
    return True if answer is None else bool(answer(kv_transfer_config))


def check_name_lookups(child: ChildConfig, connector_cls: type[KVConnectorBase_V1]) -> None:
    """Refuse a child vLLM would size wrongly (ValueError); warn about checks that vLLM makes by name."""
    if (problem := simple_cpu_offload_problem(connector_cls, child.config)) is not None:
        raise ValueError(problem)
    names = {child.connector, *(cls.__name__ for cls in connector_cls.__mro__)}
    for name in sorted(names & NAME_LOOKUPS.keys()):
        logger.warning("vLLM finds this connector by name and does not see it under kvcompose",
                       connector=child.name, connector_class=name, escapes=NAME_LOOKUPS[name])


def simple_cpu_offload_problem(connector_cls: type[KVConnectorBase_V1], config: Mapping[str, Any]) -> str | None:
    """Why this child cannot run under kvcompose on this vLLM, or None.

    vLLM 0.33 gives SimpleCPUOffloadConnector's scheduler the CPU block count its
    workers allocated only when it finds the connector by name; under kvcompose
    the scheduler would size the pool itself and may count blocks the workers
    do not have. An explicit ``num_cpu_blocks`` makes both sides use one count.
    """
    is_simple_cpu_offload = any(cls.__name__ == SIMPLE_CPU_OFFLOAD for cls in connector_cls.__mro__)
    if not (SIZED_BY_NAME and is_simple_cpu_offload) or config.get("num_cpu_blocks") is not None:
        return None
    return (
        "SimpleCPUOffloadConnector needs config.num_cpu_blocks under kvcompose: vLLM sizes its CPU pool from the "
        "workers only when it is named in --kv-transfer-config or under MultiConnector; set num_cpu_blocks "
        "(the same on every rank) or use OffloadingConnector"
    )
