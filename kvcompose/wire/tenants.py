"""Tenants: whose request each one is, the label it is counted under, and the TenantReport the stats carry.

A request's tenant is the first of these it has:

- ``kv_transfer_params: {"kvcompose": {"tenant": "..."}}`` (under ``kvcompose
  serve``, the header ``x-kvcompose-tenant`` is moved there:
  kvcompose.prediction_header);
- the name of its LoRA adapter;

else it has none (label ``none``). ``cache_salt`` is never read: a salt is an
isolation secret, not a name.

The label rule (:func:`tenant_label`): a value must be a string; surrounding
whitespace is dropped and the rest cut to :data:`MAX_TENANT_CHARS`
characters; each character outside ``A-Z a-z 0-9 _ . : @ / -`` becomes ``_``.
A value that is not a string, is empty, holds a control character, or names
one of the reserved labels (``none``, ``other``, ``invalid``) counts as
``invalid``; its request goes on as any other.

Only the top K tenants by prompt tokens get their own label; the others count
as ``other`` (kvcompose.instrumentation.tenants).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kvcompose.wire.routing import PARAMS_KEY

TENANT_KEY = "tenant"  # the key of the kvcompose entry of kv_transfer_params a tenant comes in
TENANT_HEADER = "x-kvcompose-tenant"  # under kvcompose serve, the header it may come in instead
NONE, OTHER, INVALID = "none", "other", "invalid"
RESERVED = (NONE, OTHER, INVALID)  # labels every tenant-labelled series may show beside the top K
MAX_TENANT_CHARS = 64
_UNSAFE = re.compile(r"[^A-Za-z0-9_.:@/-]")
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")


def tenant_label(value: Any) -> str:
    """The label a tenant value counts under (the rule of the module docstring); None: ``none``."""
    if value is None:
        return NONE
    if not isinstance(value, str):
        return INVALID
    text = value.strip()[:MAX_TENANT_CHARS]
    if not text or _CONTROL.search(text) or text in RESERVED:
        return INVALID
    return _UNSAFE.sub("_", text)


def tenant_value(params: Any, lora_name: Any) -> Any:
    """The raw tenant of a request, from its ``kv_transfer_params`` or else its LoRA adapter's name (None: none).
    Reads one key, whatever the nesting or size of the rest."""
    if isinstance(params, Mapping) and isinstance(entry := params.get(PARAMS_KEY), Mapping) and \
            (value := entry.get(TENANT_KEY)) is not None:
        return value
    return lora_name


@dataclass
class TenantReport:
    """A scheduler's tenant figures since its last report, by label. Counts add up when merged; ``labelled`` and
    ``curves`` are levels (the later report wins)."""

    prompt_tokens: dict[str, int] = field(default_factory=dict)  # tenant -> prompt tokens of admitted requests
    loaded_tokens: dict[str, dict[str, int]] = field(default_factory=dict)  # tenant -> child -> tokens it loaded
    labelled: list[str] | None = None  # the tenants with a label of their own now (the top K); None: unchanged
    curves: dict[str, list[list[float]]] | None = None  # tenant -> [size in blocks, estimated LRU hit ratio]

    def admitted(self, tenant: str, prompt_tokens: int) -> None:
        self.prompt_tokens[tenant] = self.prompt_tokens.get(tenant, 0) + prompt_tokens

    def loaded(self, tenant: str, child: str, tokens: int) -> None:
        by_child = self.loaded_tokens.setdefault(tenant, {})
        by_child[child] = by_child.get(child, 0) + tokens

    def add(self, other: TenantReport) -> None:
        for tenant, tokens in other.prompt_tokens.items():
            self.admitted(tenant, tokens)
        for tenant, by_child in other.loaded_tokens.items():
            for child, tokens in by_child.items():
                self.loaded(tenant, child, tokens)
        if other.labelled is not None:
            self.labelled = list(other.labelled)
        if other.curves is not None:
            self.curves = dict(other.curves)

    def is_empty(self) -> bool:
        return not (self.prompt_tokens or self.loaded_tokens) and self.labelled is None and self.curves is None

    def copy(self) -> TenantReport:
        return TenantReport.from_payload(self.to_dict())

    def reduce(self) -> dict[str, int | float]:
        """For vLLM's log line: nothing per tenant (the log is not a place for names)."""
        return {}

    def to_dict(self) -> dict[str, Any]:
        return {"prompt_tokens": dict(self.prompt_tokens),
                "loaded_tokens": {tenant: dict(by_child) for tenant, by_child in self.loaded_tokens.items()},
                "labelled": None if self.labelled is None else list(self.labelled),
                "curves": None if self.curves is None else dict(self.curves)}

    @classmethod
    def from_payload(cls, payload: TenantReport | dict[str, Any]) -> TenantReport:
        if isinstance(payload, TenantReport):
            return payload
        return cls(prompt_tokens=dict(payload.get("prompt_tokens") or {}),
                   loaded_tokens={tenant: dict(by_child)
                                  for tenant, by_child in (payload.get("loaded_tokens") or {}).items()},
                   labelled=None if payload.get("labelled") is None else list(payload["labelled"]),
                   curves=None if payload.get("curves") is None else dict(payload["curves"]))
