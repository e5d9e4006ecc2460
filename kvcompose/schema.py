"""The JSON Schema of pipeline files, for editors and CI linters.

Pipelines may write ``${VAR}`` or ``${VAR:-default}`` for any value; it is
resolved before validation. The schema therefore also accepts such a string
wherever it expects a boolean or a number.
"""

from __future__ import annotations

from typing import Any

from kvcompose.config import Pipeline

ENV_REFERENCE: dict[str, Any] = {
    "type": "string",
    "pattern": r"\$\{[A-Za-z_][A-Za-z0-9_]*(:-[^}]*)?\}",
    "description": "An environment variable reference, resolved when the pipeline is loaded.",
}
_NON_STRING_SCALARS = {"boolean", "integer", "number"}


def pipeline_json_schema() -> dict[str, Any]:
    return _allow_env_references(Pipeline.model_json_schema())


def _allow_env_references(node: Any) -> Any:
    if isinstance(node, list):
        return [_allow_env_references(item) for item in node]
    if not isinstance(node, dict):
        return node
    node = {key: _allow_env_references(value) for key, value in node.items()}
    if node.get("type") in _NON_STRING_SCALARS:
        scalar = {key: node.pop(key) for key in list(node) if key not in ("title", "description", "default")}
        node["anyOf"] = [scalar, ENV_REFERENCE]
    return node
