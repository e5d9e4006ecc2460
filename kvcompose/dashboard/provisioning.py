"""Grafana provisioning files: the Prometheus and Jaeger datasources and the dashboard provider.

They fit examples/observability/docker-compose.yml (Prometheus reachable as
``prometheus:9090``, Jaeger as ``jaeger:16686``, the dashboards mounted at
``DASHBOARDS_PATH``); copy and edit them for another Grafana. The Prometheus
datasource links the ``trace_id`` of each exemplar to that trace in Jaeger.
"""

from __future__ import annotations

import yaml

from kvcompose.metrics.histograms import TRACE_ID_LABEL

PROMETHEUS_URL = "http://prometheus:9090"
JAEGER_URL = "http://jaeger:16686"
JAEGER_UID = "jaeger"
# Must equal scrape_interval in examples/observability/prometheus.yml:
# Grafana's $__rate_interval is at least four of them.
SCRAPE_INTERVAL = "5s"
DASHBOARDS_PATH = "/var/lib/grafana/dashboards/kvcompose"
HEADER = "# Written by `kvcompose dashboard --provisioning DIR`; regenerate rather than edit.\n"


def provisioning_files() -> dict[str, str]:
    """File contents by path relative to Grafana's provisioning directory."""
    datasource = {"apiVersion": 1, "datasources": [{
        "name": "Prometheus",
        "type": "prometheus",
        "access": "proxy",
        "url": PROMETHEUS_URL,
        "isDefault": True,
        "jsonData": {
            "timeInterval": SCRAPE_INTERVAL,
            "exemplarTraceIdDestinations": [{"name": TRACE_ID_LABEL, "datasourceUid": JAEGER_UID}],
        },
    }, {
        "name": "Jaeger",
        "type": "jaeger",
        "uid": JAEGER_UID,
        "access": "proxy",
        "url": JAEGER_URL,
    }]}
    provider = {"apiVersion": 1, "providers": [{
        "name": "kvcompose",
        "folder": "kvcompose",
        "type": "file",
        "disableDeletion": False,
        "allowUiUpdates": False,
        "updateIntervalSeconds": 30,
        "options": {"path": DASHBOARDS_PATH},
    }]}
    return {
        "datasources/kvcompose.yaml": HEADER + yaml.safe_dump(datasource, sort_keys=False),
        "dashboards/kvcompose.yaml": HEADER + yaml.safe_dump(provider, sort_keys=False),
    }
