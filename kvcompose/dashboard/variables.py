"""The dashboard's template variables: datasource, model_name, engine, connector, op.

Each label variable lists the values of the series that kvcompose always
exports, narrowed by the variables before it. "All" is sent as ``.*``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvcompose.dashboard.model import DATASOURCE

# The editor Grafana 10+ shows for Prometheus variable queries.
VARIABLE_QUERY_REF_ID = "PrometheusVariableQueryEditor-VariableQuery"


@dataclass(frozen=True)
class LabelVariable:
    name: str
    label: str
    metric: str
    filters: tuple[str, ...]  # earlier variables that narrow this one

    @property
    def query(self) -> str:
        """Grafana's label_values(): the values of ``name`` on the matching series."""
        matchers = ", ".join(f'{var}=~"${var}"' for var in self.filters)
        series = f"{self.metric}{{{matchers}}}" if matchers else self.metric
        return f"label_values({series}, {self.name})"


LABEL_VARIABLES: tuple[LabelVariable, ...] = (
    LabelVariable("model_name", "Model", "kvcompose_pipeline_info", ()),
    LabelVariable("engine", "Engine", "kvcompose_pipeline_info", ("model_name",)),
    LabelVariable("connector", "Child", "kvcompose_pipeline_info", ("model_name", "engine")),
    LabelVariable("op", "Operation", "kvcompose_call_duration_seconds_count", ("model_name", "engine", "connector")),
)


def template_variables() -> list[dict[str, Any]]:
    datasource = {
        "name": "datasource", "label": "Data source", "type": "datasource", "query": "prometheus",
        "current": {}, "hide": 0, "includeAll": False, "multi": False, "options": [], "refresh": 1, "regex": "",
    }
    return [datasource, *(_label_variable(variable) for variable in LABEL_VARIABLES)]


def _label_variable(variable: LabelVariable) -> dict[str, Any]:
    return {
        "name": variable.name,
        "label": variable.label,
        "type": "query",
        "datasource": DATASOURCE,
        "definition": variable.query,
        "query": {"query": variable.query, "refId": VARIABLE_QUERY_REF_ID},
        "current": {"selected": True, "text": ["All"], "value": ["$__all"]},
        "hide": 0,
        "includeAll": True,
        "allValue": ".*",
        "multi": True,
        "options": [],
        "refresh": 2,  # on time range change
        "regex": "",
        "sort": 1,
    }
