"""The whole dashboard: rows of panels on Grafana's 24-column grid.

Without a pipeline, one dashboard fits every pipeline: an overview, the
children's live health, the calls into each child, its transfers and the
tiers' economics (one series per child), routers' predictions checked, the tenants, and collapsed
rows for the native metrics of OffloadingConnector and NIXL children. With a pipeline, the
overview and live health are followed by one row per child, holding that
child's calls, its transfers and, for a known class, its native panels, and
then the tiers' economics, the routers' predictions and the tenants.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

from kvcompose.config import Pipeline
from kvcompose.dashboard.model import PanelSpec, panel_json, row_json
from kvcompose.dashboard.panels import (
    CHILD_CALLS, LIVE_HEALTH, NATIVE_PANELS, NIXL, OFFLOADING, OVERVIEW, ROUTING, TENANTS, TIER_ECONOMICS,
    TRANSFERS,
)
from kvcompose.dashboard.queries import Scope
from kvcompose.dashboard.variables import template_variables

SCHEMA_VERSION = 39  # Grafana 10.3/10.4; later versions migrate it on load
GRID_WIDTH = 24
DASHBOARD_UID = "kvcompose"
MAX_UID_LENGTH = 40


@dataclass(frozen=True)
class Section:
    """A row and its panels, all queried in one scope."""

    title: str
    panels: tuple[PanelSpec, ...]
    scope: Scope = Scope()
    collapsed: bool = False


def sections(pipeline: Pipeline | None) -> list[Section]:
    if pipeline is None:
        return [
            Section("Pipeline", OVERVIEW),
            Section("Live health", LIVE_HEALTH),
            Section("Calls into each child", CHILD_CALLS),
            Section("Transfers", TRANSFERS),
            Section("Tier economics", TIER_ECONOMICS),
            Section("Routing", ROUTING),
            Section("Tenants", TENANTS),
            Section("OffloadingConnector children", OFFLOADING, collapsed=True),
            Section("NIXL children", NIXL, collapsed=True),
        ]
    return [
        Section(f"Pipeline {pipeline.name}", OVERVIEW),
        Section("Live health", LIVE_HEALTH),
        *(Section(f"{child.name} ({child.connector})",
                  CHILD_CALLS + TRANSFERS + NATIVE_PANELS.get(child.connector, ()), Scope(child.name))
          for child in pipeline.children),
        Section("Tier economics", TIER_ECONOMICS),
        Section("Routing", ROUTING),
        Section("Tenants", TENANTS),
    ]


def build_dashboard(pipeline: Pipeline | None = None) -> dict[str, Any]:
    """The dashboard as Grafana's classic JSON model (a dict)."""
    title = "kvcompose" if pipeline is None else f"kvcompose: {pipeline.name}"
    return {
        "id": None,
        "uid": DASHBOARD_UID if pipeline is None else _pipeline_uid(pipeline.name),
        "title": title,
        "description": "What each child connector of a kvcompose pipeline did, from vLLM's /metrics.",
        "tags": ["kvcompose", "vllm"],
        "timezone": "browser",
        "editable": True,
        "graphTooltip": 1,
        "time": {"from": "now-1h", "to": "now"},
        "refresh": "30s",
        "schemaVersion": SCHEMA_VERSION,
        "version": 1,
        "links": [],
        "annotations": {"list": []},
        "templating": {"list": template_variables()},
        "panels": _place(sections(pipeline)),
    }


def dashboard_json(pipeline: Pipeline | None = None) -> str:
    """The dashboard file's exact text (what ``kvcompose dashboard`` writes)."""
    return json.dumps(build_dashboard(pipeline), indent=2) + "\n"


def _pipeline_uid(name: str) -> str:
    uid = f"{DASHBOARD_UID}-{name}"
    if len(uid) <= MAX_UID_LENGTH:
        return uid
    return f"{DASHBOARD_UID}-{hashlib.sha256(name.encode()).hexdigest()[:16]}"


def _place(layout: list[Section]) -> list[dict[str, Any]]:
    """Give every row and panel an id and a grid position, left to right, top to bottom."""
    placed: list[dict[str, Any]] = []
    next_id, y = 1, 0
    for section in layout:
        row_id, row_y = next_id, y
        next_id, y = next_id + 1, y + 1
        children, x, line_height = [], 0, 0
        for spec in section.panels:
            if x + spec.width > GRID_WIDTH:
                x, y, line_height = 0, y + line_height, 0
            grid_pos = {"h": spec.height, "w": spec.width, "x": x, "y": y}
            children.append(panel_json(spec, next_id, grid_pos, section.scope))
            next_id, x, line_height = next_id + 1, x + spec.width, max(line_height, spec.height)
        y += line_height
        placed.append(row_json(section.title, row_id, row_y, section.collapsed, children))
        if section.collapsed:
            y = row_y + 1  # the panels live inside the row until it is expanded
        else:
            placed.extend(children)
    return placed
