"""The ``--kv-transfer-config`` JSON that points vLLM at a pipeline."""

from __future__ import annotations

import datetime
import math
from pathlib import Path
from typing import Any

from kvcompose.config import Pipeline, untyped_field
from kvcompose.errors import FieldPath, PipelineConfigError, Problem, shown
from kvcompose.interpolation import is_whole_reference
from kvcompose.source import PipelineDocument
from kvcompose.vllm_names import COMPOSITE_CONNECTOR, COMPOSITE_MODULE

_NOT_JSON = "JSON cannot hold it, so --inline cannot embed it: quote it in the file to keep it as text, or render " \
            "without --inline"


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


def inline_reference(document: PipelineDocument) -> dict[str, Any]:
    """The pipeline as written (references unresolved), once it is known to survive JSON unchanged.

    The engine reads the embedded mapping as JSON, so a value JSON cannot
    hold (a date, binary data, a set, a non-string key, NaN) is refused, and
    so is a quoted whole reference in a child's config or transfer: in the
    file quoting keeps it a string, which a mapping cannot express.
    """
    problems: list[Problem] = []
    _check_json_safe(document.data, (), document, problems)
    if problems:
        raise PipelineConfigError(problems, document.label)
    return dict(document.data)


def _check_json_safe(value: Any, path: FieldPath, document: PipelineDocument, problems: list[Problem]) -> None:
    def refuse(where: FieldPath, message: str) -> None:
        problems.append(Problem(where, message, document.line_of(where)))

    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                refuse((*path, key), f"the key {shown(key)} is not a string; {_NOT_JSON}")
            _check_json_safe(item, (*path, key), document, problems)
    elif isinstance(value, list):
        for index, item in enumerate(value):
            _check_json_safe(item, (*path, index), document, problems)
    elif isinstance(value, str):
        if path in document.quoted and untyped_field(path) and is_whole_reference(value):
            refuse(path, f"{shown(value)} is quoted, so it stays a string after substitution; an embedded value "
                   "is read as if unquoted, so --inline cannot keep that: write it unquoted, or render without "
                   "--inline")
    elif isinstance(value, float) and not math.isfinite(value):
        refuse(path, f"{value} is not a finite number; {_NOT_JSON}")
    elif isinstance(value, datetime.date):
        refuse(path, f"{value.isoformat()} is a date or timestamp; {_NOT_JSON}")
    elif not isinstance(value, (bool, int, float)) and value is not None:
        refuse(path, f"a {type(value).__name__} value (from a tag such as !!binary or !!set); {_NOT_JSON}")
