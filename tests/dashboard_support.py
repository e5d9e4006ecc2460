"""Reading dashboards as Grafana would: panels, targets, and queries with variables filled in."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvcompose.config import load_pipeline
from kvcompose.dashboard import QUERIES, Query, Scope, build_dashboard

REPO = Path(__file__).resolve().parents[1]
COMMITTED_DASHBOARD = REPO / "dashboards" / "kvcompose.json"
EXAMPLE_PIPELINE = REPO / "examples" / "pipeline.yaml"
# A pipeline whose children have native panels: OffloadingConnector ("hot") and NIXL ("cold").
NATIVE_PIPELINE = {"version": 1, "name": "native", "children": [
    {"name": "hot", "connector": "OffloadingConnector"},
    {"name": "cold", "connector": "NixlConnector", "transfer": {"kv_buffer_device": "cpu"}},
]}
LABEL_VALUES = re.compile(r"^label_values\((?P<series>.+), (?P<label>\w+)\)$")


@dataclass(frozen=True)
class Target:
    panel: str
    ref_id: str
    expr: str

    @property
    def where(self) -> str:
        return f"{self.panel!r} {self.ref_id}"


def dashboards() -> dict[str, dict[str, Any]]:
    """The committed dashboard and the generator's pipeline layouts."""
    return {
        "committed": json.loads(COMMITTED_DASHBOARD.read_text()),
        "example-pipeline": build_dashboard(load_pipeline(EXAMPLE_PIPELINE)),
        "native-pipeline": build_dashboard(load_pipeline(NATIVE_PIPELINE)),
    }


def all_panels(dashboard: Mapping[str, Any]) -> Iterator[dict[str, Any]]:
    """Every panel, rows and the panels inside collapsed rows included."""
    for panel in dashboard["panels"]:
        yield panel
        yield from panel.get("panels", [])


def targets(dashboard: Mapping[str, Any]) -> list[Target]:
    return [Target(panel["title"], target["refId"], target["expr"])
            for panel in all_panels(dashboard) for target in panel.get("targets", [])]


def variable_queries(dashboard: Mapping[str, Any]) -> dict[str, str]:
    """label_values() queries of the query variables, by variable name."""
    return {v["name"]: v["query"]["query"] for v in dashboard["templating"]["list"] if v["type"] == "query"}


def label_values_parts(query: str) -> tuple[str, str]:
    """``label_values(SERIES, LABEL)`` -> (SERIES, LABEL)."""
    match = LABEL_VALUES.match(query)
    assert match, f"not a label_values() query: {query}"
    return match["series"], match["label"]


def fill(expr: str, values: Mapping[str, str], rate_interval: str) -> str:
    """Replace Grafana's variables as it does before sending a query to Prometheus."""
    expr = expr.replace("$__rate_interval", rate_interval)
    for name, value in values.items():
        expr = expr.replace(f"${name}", value)
    assert "$" not in expr, f"unfilled variable in {expr}"
    return expr


def query_and_scope(expr: str, children: list[str]) -> tuple[Query, Scope]:
    """The catalogue query (and scope) a dashboard expression was built from."""
    scopes = [Scope(), *(Scope(child) for child in children)]
    built: dict[str, tuple[Query, Scope]] = {}
    for query in QUERIES:
        for scope in scopes:  # a query of the engine's series reads the same in every scope: the first is kept
            built.setdefault(query.expr(scope), (query, scope))
    assert expr in built, f"not built from kvcompose.dashboard.queries: {expr}"
    return built[expr]


def metrics_read(expr: str) -> set[str]:
    return set(re.findall(r"(kvcompose_\w+|vllm:\w+)\{", expr))
