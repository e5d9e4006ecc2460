"""How a child reports its transfers' completion, and where their copy times come from, by the child's class.

- ``jobs``: vLLM's OffloadingConnector (see :mod:`kvcompose.adapters.offloading`).
- ``finish``: NIXL (see :mod:`kvcompose.adapters.nixl`), whose sends complete
  after the request's end.
- ``sync``: any other connector, known only through vLLM's connector API.

A class is matched by its own or a base class's name, so that telling a
child's mode imports no connector module.
"""

from __future__ import annotations

from typing import Literal

from kvcompose.adapters import nixl, offloading
from kvcompose.operations import Direction

Mode = Literal["sync", "finish", "jobs"]
CopySource = Literal["child", "calls"]

_MODES: dict[str, Mode] = {
    offloading.CONNECTOR.rpartition(".")[2]: "jobs",
    nixl.CONNECTOR.rpartition(".")[2]: "finish",
}


def completion_mode(connector_cls: type) -> Mode:
    for cls in connector_cls.__mro__:
        if (mode := _MODES.get(cls.__name__)) is not None:
            return mode
    return "sync"


def copy_source(connector_cls: type) -> dict[Direction, CopySource | None]:
    """Where a child's copy times come from, per direction: its own measurements (OffloadingConnector, NIXL's
    loads), kvcompose's calls into it, or None where none is recorded (NIXL's saves: in its default pull mode
    the decode side moves the blocks, and the prefill side measures no send; a connector whose adapter this
    vLLM breaks)."""
    mode = completion_mode(connector_cls)
    if mode == "sync":
        return {"load": "calls", "save": "calls"}
    if mode == "jobs":
        measured: CopySource | None = None if offloading.unmet() else "child"
        return {"load": measured, "save": measured}
    return {"load": None if nixl.unmet() else "child", "save": None}
