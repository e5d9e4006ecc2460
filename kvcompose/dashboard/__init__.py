"""Grafana dashboards as code: ``kvcompose dashboard`` writes them; nothing here imports vLLM."""

from kvcompose.dashboard.layout import build_dashboard, dashboard_json
from kvcompose.dashboard.provisioning import provisioning_files
from kvcompose.dashboard.queries import QUERIES, Query, Scope

__all__ = ["QUERIES", "Query", "Scope", "build_dashboard", "dashboard_json", "provisioning_files"]
