"""The ``--kv-transfer-config`` JSON that points vLLM at a pipeline."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvcompose.config import Pipeline
from kvcompose.vllm_names import COMPOSITE_CONNECTOR, COMPOSITE_MODULE


def kv_transfer_config(pipeline: Pipeline, pipeline_ref: str | dict[str, Any]) -> dict[str, Any]:
    """Build the mapping vLLM's ``KVTransferConfig(**mapping)`` accepts.

    ``pipeline_ref`` is an absolute file path (the engine reads the file, so
    ``${VAR}`` resolves in the engine's environment) or the raw mapping itself.
    ``kv_connector_module_path`` is set so the config works even where the
    kvcompose vLLM plugin is not loaded.
    """
    return {
        "kv_connector": COMPOSITE_CONNECTOR,
        "kv_connector_module_path": COMPOSITE_MODULE,
        "kv_role": pipeline.role,
        "kv_load_failure_policy": pipeline.load.on_failure,
        "kv_connector_extra_config": {"pipeline": pipeline_ref},
    }


def file_reference(path: Path) -> str:
    return str(path.resolve())
