"""kvcompose's copies of vLLM's names must match the installed vLLM."""

from __future__ import annotations

import dataclasses

from kvcompose.vllm_names import BUILTIN_CONNECTORS, KV_TRANSFER_FIELDS

from .vllm_api import UNUSED_KV_TRANSFER_FIELDS


def test_builtin_connectors_match_factory_registry() -> None:
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    import kvcompose.plugin

    registered = set(KVConnectorFactory._registry) - {"KVComposeConnector", "KVComposeHMAConnector"}
    assert kvcompose.plugin  # the plugin may have added kvcompose's own names
    assert registered == set(BUILTIN_CONNECTORS)


def test_kv_transfer_fields_match_vllm() -> None:
    from vllm.config import KVTransferConfig

    installed = {f.name for f in dataclasses.fields(KVTransferConfig)}
    assert installed - UNUSED_KV_TRANSFER_FIELDS == set(KV_TRANSFER_FIELDS)
