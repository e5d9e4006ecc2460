"""Panels as data, and their Grafana classic-dashboard JSON.

Every panel and target names its datasource through the ``$datasource``
template variable, never a uid, so the dashboard imports into any Grafana.

An XY chart plots instant table queries, one frame per query: its ``x_field``
(a label, turned into a number) across, each query's value up. Grafana names
a table's value column ``Value`` for a panel of one query and ``Value #<refId>``
for more. The options are Grafana 10.3's (``seriesMapping``, a ``frame`` per
series), which Grafana 10.4 and later migrate on load.
"""

from __future__ import annotations

from dataclasses import dataclass
from string import ascii_uppercase
from typing import Any, Literal

from kvcompose.dashboard.queries import Query, Scope

DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}


@dataclass(frozen=True)
class State:
    """One value of a state panel: what it means and its colour."""

    value: int
    text: str
    color: str


@dataclass(frozen=True)
class PanelSpec:
    title: str
    description: str
    unit: str
    queries: tuple[Query, ...]
    kind: Literal["timeseries", "table", "state-timeline", "stat", "xychart"] = "timeseries"
    width: int = 12
    height: int = 8
    min: float | None = None
    max: float | None = None
    no_value: str | None = None  # shown instead of "No data" where no series is the normal case
    columns: tuple[str, ...] = ()  # table: the labels to show, in order
    states: tuple[State, ...] = ()  # state-timeline: value mappings
    x_field: str | None = None  # xychart: the label plotted across (every query is a table with it)
    x_label: str = ""  # xychart: the x axis's title


def panel_json(spec: PanelSpec, panel_id: int, grid_pos: dict[str, int], scope: Scope) -> dict[str, Any]:
    defaults: dict[str, Any] = {"unit": spec.unit}
    for key, value in (("min", spec.min), ("max", spec.max), ("noValue", spec.no_value)):
        if value is not None:
            defaults[key] = value
    if spec.states:
        defaults["color"] = {"mode": "thresholds"}
        defaults["mappings"] = [{"type": "value", "options": {
            str(state.value): {"text": state.text, "color": state.color, "index": index}
            for index, state in enumerate(spec.states)
        }}]
    ref_ids = ascii_uppercase[:len(spec.queries)]
    panel: dict[str, Any] = {
        "id": panel_id,
        "type": spec.kind,
        "title": spec.title,
        "description": spec.description,
        "datasource": DATASOURCE,
        "gridPos": grid_pos,
        "fieldConfig": {"defaults": defaults, "overrides": _x_axis(spec)},
        "options": _options(spec, ref_ids),
        "targets": [_target(query, ref_id, scope) for query, ref_id in zip(spec.queries, ref_ids)],
    }
    if spec.x_field:
        panel["transformations"] = [
            {"id": "convertFieldType", "options": {"fields": {}, "conversions": [
                {"targetField": spec.x_field, "destinationType": "number"}]}},
            {"id": "sortBy", "options": {"fields": {}, "sort": [{"field": spec.x_field}]}},
        ]
    if spec.columns:
        panel["transformations"] = [{"id": "organize", "options": {
            "excludeByName": {"Time": True, "Value": True},
            "indexByName": {column: index for index, column in enumerate(spec.columns)},
        }}]
    return panel


def row_json(title: str, panel_id: int, y: int, collapsed: bool, panels: list[dict[str, Any]]) -> dict[str, Any]:
    """A row; a collapsed one carries its panels, an expanded one is followed by them."""
    return {
        "id": panel_id,
        "type": "row",
        "title": title,
        "collapsed": collapsed,
        "gridPos": {"h": 1, "w": 24, "x": 0, "y": y},
        "panels": panels if collapsed else [],
    }


def _target(query: Query, ref_id: str, scope: Scope) -> dict[str, Any]:
    target = {
        "refId": ref_id,
        "datasource": DATASOURCE,
        "editorMode": "code",
        "expr": query.expr(scope),
        "legendFormat": query.legend or "__auto",
        "format": "table" if query.table else "time_series",
        "instant": query.table,
        "range": not query.table,
    }
    if query.exemplars:
        target["exemplar"] = True
    return target


def _x_axis(spec: PanelSpec) -> list[dict[str, Any]]:
    """An XY chart's x field: a count of blocks and more, on a log2 axis (its sizes are mostly powers of two)."""
    if not spec.x_field:
        return []
    return [{"matcher": {"id": "byName", "options": spec.x_field}, "properties": [
        {"id": "unit", "value": "short"},
        {"id": "custom.scaleDistribution", "value": {"type": "log", "log": 2}},
        {"id": "custom.axisLabel", "value": spec.x_label},
    ]}]


def _options(spec: PanelSpec, ref_ids: str) -> dict[str, Any]:
    legend = {"displayMode": "list", "placement": "bottom", "showLegend": True, "calcs": []}
    tooltip = {"mode": "multi", "sort": "desc"}
    if spec.kind == "xychart":
        value = (lambda ref_id: f"Value #{ref_id}") if len(ref_ids) > 1 else (lambda ref_id: "Value")
        series = [{"name": query.legend, "frame": frame, "x": spec.x_field, "y": value(ref_id),
                   # the first query is the line, the others mark points on it
                   "show": "points+lines" if frame == 0 else "points",
                   "pointSize": {"fixed": 5 if frame == 0 else 14, "min": 1, "max": 40}}
                  for frame, (query, ref_id) in enumerate(zip(spec.queries, ref_ids))]
        return {"seriesMapping": "manual", "dims": {"frame": 0}, "series": series, "legend": legend,
                "tooltip": {"mode": "single", "sort": "none"}}
    if spec.kind == "stat":
        return {"reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
                "orientation": "horizontal", "textMode": "value_and_name", "colorMode": "none",
                "graphMode": "none", "justifyMode": "auto"}
    if spec.kind == "table":
        return {"showHeader": True, "cellHeight": "sm", "sortBy": [{"displayName": spec.columns[0], "desc": False}]}
    if spec.kind == "state-timeline":
        return {"mergeValues": True, "showValue": "auto", "alignValue": "left", "rowHeight": 0.9,
                "legend": legend, "tooltip": tooltip}
    return {"legend": legend, "tooltip": tooltip}
