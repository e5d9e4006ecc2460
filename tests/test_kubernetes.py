"""The kustomize base in deploy/kubernetes: built the way kustomize does, validated, and its container run.

No cluster and no kustomize binary are needed: ``build()`` reads kustomization.yaml's ``resources`` and
``configMapGenerator`` (the only keys the base uses, which the first test holds it to), so every listed file
must exist inside the base (kustomize's load restrictor) and parse. Core objects are checked against the
Kubernetes OpenAPI schemas shipped with kubernetes-validate; the prometheus-operator objects structurally.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import kubernetes_validate
import yaml

from kvcompose.alerts import rule_groups
from kvcompose.config import load_pipeline
from kvcompose.deploy import KUBERNETES_DASHBOARD_FILE, PROMETHEUS_RULE_FILE, derived_files
from kvcompose.render import file_reference, kv_transfer_config

from .dashboard_support import COMMITTED_DASHBOARD, REPO
from .test_alerts import REGENERATE, RULES

BASE = REPO / "deploy" / "kubernetes"
# Schemas of a release every kubernetes-validate >= 1.30 ships, and old enough for most clusters.
KUBERNETES_VERSION = "1.30.0"
KUSTOMIZATION_KEYS = {"apiVersion", "kind", "resources", "configMapGenerator"}
GENERATOR_KEYS = {"name", "files", "literals", "options"}
CORE_KINDS = {"ConfigMap", "Deployment", "Service"}
MONITORING_API = "monitoring.coreos.com/v1"
POD_FIELDS = {"metadata.name": "vllm-7d9f-abcde", "metadata.namespace": "inference"}
# prometheus-operator's ScrapeProtocol values (monitoring.coreos.com/v1, PodMonitorSpec.scrapeProtocols).
SCRAPE_PROTOCOLS = {"PrometheusProto", "OpenMetricsText0.0.1", "OpenMetricsText1.0.0", "PrometheusText0.0.4",
                    "PrometheusText1.0.0"}
METRICS_PATH = "/metrics/"  # vLLM's prometheus_client app: OpenMetrics, with exemplars, when asked for it


def _inside_base(relative: str) -> Path:
    path = (BASE / relative).resolve()
    assert path.is_relative_to(BASE.resolve()), f"{relative}: kustomize loads no file outside {BASE}"
    assert path.is_file(), f"{relative} is listed in kustomization.yaml but missing"
    return path


def build() -> list[dict[str, Any]]:
    """The base's objects, as `kubectl kustomize` builds them (generated names without their hash suffix)."""
    kustomization = yaml.safe_load((BASE / "kustomization.yaml").read_text())
    objects = [document for resource in kustomization["resources"]
               for document in yaml.safe_load_all(_inside_base(resource).read_text()) if document]
    for generator in kustomization.get("configMapGenerator", []):
        assert set(generator) <= GENERATOR_KEYS, f"build() reads only {GENERATOR_KEYS}: {generator}"
        data = {_inside_base(file).name: _inside_base(file).read_text() for file in generator.get("files", [])}
        data.update(literal.split("=", 1) for literal in generator.get("literals", []))
        metadata = {"name": generator["name"], **{k: v for k, v in generator.get("options", {}).items()
                                                 if k in ("labels", "annotations")}}
        objects.append({"apiVersion": "v1", "kind": "ConfigMap", "metadata": metadata, "data": data})
    return objects


OBJECTS = build()


def only(kind: str, name: str | None = None) -> dict[str, Any]:
    found = [o for o in OBJECTS if o["kind"] == kind and name in (None, o["metadata"]["name"])]
    assert len(found) == 1, f"{kind} {name or ''}: {len(found)} objects"
    return found[0]


def pod_spec() -> dict[str, Any]:
    return only("Deployment")["spec"]["template"]["spec"]


def container() -> dict[str, Any]:
    (vllm,) = pod_spec()["containers"]
    return vllm


def container_env() -> dict[str, str]:
    """The container's environment as the kubelet sets it: envFrom first, then env with $(VAR) expanded."""
    env: dict[str, str] = {}
    for source in container().get("envFrom", []):
        env.update(only("ConfigMap", source["configMapRef"]["name"])["data"])
    for variable in container()["env"]:
        if "value" in variable:
            env[variable["name"]] = re.sub(r"\$\((\w+)\)", lambda m: env[m[1]], variable["value"])
        else:
            env[variable["name"]] = POD_FIELDS[variable["valueFrom"]["fieldRef"]["fieldPath"]]
    return env


def run_container_command(tmp_path: Path, pipeline_text: str) -> subprocess.CompletedProcess[str]:
    """The container's command, with the pipeline at a temporary path and a `vllm` that prints its arguments."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    vllm = bin_dir / "vllm"
    vllm.write_text(f"#!{sys.executable}\nimport json, sys\nprint(json.dumps(sys.argv[1:]))\n")
    vllm.chmod(0o755)
    pipeline = tmp_path / "pipeline.yaml"
    pipeline.write_text(pipeline_text)
    env = {**container_env(), "KVCOMPOSE_PIPELINE": str(pipeline), "PYTHONPATH": str(REPO),
           "PATH": f"{bin_dir}:{Path(sys.executable).parent}:/usr/bin:/bin"}
    return subprocess.run([*container()["command"], *container()["args"]], env=env, capture_output=True, text=True,
                          timeout=60)


# --- the build ---------------------------------------------------------------------------------

def test_the_base_uses_only_what_build_reads_and_holds_every_object_once() -> None:
    kustomization = yaml.safe_load((BASE / "kustomization.yaml").read_text())
    unread = set(kustomization) - KUSTOMIZATION_KEYS
    assert not unread, f"extend build() before using {unread}"
    assert (kustomization["apiVersion"], kustomization["kind"]) == ("kustomize.config.k8s.io/v1beta1", "Kustomization")
    kinds = sorted((o["kind"], o["metadata"]["name"]) for o in OBJECTS)
    assert kinds == [("ConfigMap", "kvcompose-dashboard"), ("ConfigMap", "kvcompose-otlp"),
                     ("ConfigMap", "kvcompose-pipeline"), ("Deployment", "vllm"), ("PodMonitor", "vllm"),
                     ("PrometheusRule", "kvcompose"), ("Service", "vllm")]


def test_core_objects_are_valid_kubernetes_objects() -> None:
    core = [o for o in OBJECTS if o["kind"] in CORE_KINDS]
    assert len(core) == 5
    for obj in core:
        kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)


def test_committed_copies_are_what_generate_writes() -> None:
    for path in (PROMETHEUS_RULE_FILE, KUBERNETES_DASHBOARD_FILE):
        assert (REPO / path).read_text() == derived_files()[path], f"{path} is stale: run `{REGENERATE}`"


# --- prometheus-operator ------------------------------------------------------------------------

def test_prometheus_rule_holds_exactly_the_groups_of_the_rule_file() -> None:
    rule = only("PrometheusRule")
    assert rule["apiVersion"] == MONITORING_API
    assert set(rule) == {"apiVersion", "kind", "metadata", "spec"} and set(rule["spec"]) == {"groups"}
    assert rule["spec"]["groups"] == yaml.safe_load(RULES.read_text())["groups"] == rule_groups()


def test_pod_monitor_scrapes_openmetrics_with_exemplars_from_the_vllm_pods() -> None:
    """/metrics/ in OpenMetrics, the only form vLLM's server gives the transfer exemplars in
    (tests/test_dashboard_live.py scrapes that path with a real Prometheus and finds them)."""
    monitor = only("PodMonitor")
    assert monitor["apiVersion"] == MONITORING_API
    assert set(monitor["spec"]) == {"selector", "scrapeProtocols", "podMetricsEndpoints"}
    pod_labels = only("Deployment")["spec"]["template"]["metadata"]["labels"]
    assert monitor["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    protocols = monitor["spec"]["scrapeProtocols"]
    assert set(protocols) <= SCRAPE_PROTOCOLS and len(set(protocols)) == len(protocols)  # a set, of known values
    assert protocols[0].startswith("OpenMetricsText")
    ports = {port["name"]: port["containerPort"] for port in container()["ports"]}
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    assert set(endpoint) <= {"port", "path", "interval", "scrapeTimeout"}
    assert endpoint["port"] in ports and endpoint["path"] == METRICS_PATH
    assert re.fullmatch(r"\d+s", endpoint["interval"])


# --- the Deployment and its Service -------------------------------------------------------------

def test_the_service_and_the_deployment_select_the_pods_and_the_http_port() -> None:
    deployment, service = only("Deployment"), only("Service")
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert deployment["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    assert service["spec"]["selector"].items() <= pod_labels.items()
    ports = {port["name"]: port["containerPort"] for port in container()["ports"]}
    (service_port,) = service["spec"]["ports"]
    assert service_port["targetPort"] in ports
    assert f"--port {ports[service_port['targetPort']]}" in container()["args"][0]


def test_the_pipeline_config_map_is_mounted_where_the_container_reads_it() -> None:
    mounts = {mount["name"]: mount["mountPath"] for mount in container()["volumeMounts"]}
    volumes = {volume["name"]: volume for volume in pod_spec()["volumes"]}
    pipeline_path = Path(container_env()["KVCOMPOSE_PIPELINE"])
    (volume_name,) = [name for name, path in mounts.items() if Path(path) == pipeline_path.parent]
    config_map = only("ConfigMap", volumes[volume_name]["configMap"]["name"])
    assert pipeline_path.name in config_map["data"]


def test_the_pipeline_is_valid_and_traces_through_the_otlp_settings(tmp_path: Path) -> None:
    (tmp_path / "pipeline.yaml").write_text(only("ConfigMap", "kvcompose-pipeline")["data"]["pipeline.yaml"])
    pipeline = load_pipeline(tmp_path / "pipeline.yaml")
    assert [child.connector for child in pipeline.children] == ["OffloadingConnector", "LMCacheConnectorV1"]
    # Its offload space comes from the Deployment, inside the container's memory limit.
    cpu_bytes = int(container_env()["KVCOMPOSE_CPU_BYTES"])
    limit = container()["resources"]["limits"]["memory"]
    assert limit.endswith("Gi") and cpu_bytes < int(limit[:-2]) * 2**30
    # No endpoint in the pipeline: kvcompose's exporter, like vLLM's, reads OTEL_EXPORTER_OTLP_TRACES_*.
    assert pipeline.tracing.enabled and pipeline.tracing.exporter == "otlp" and pipeline.tracing.endpoint is None
    env = container_env()
    endpoint = urlsplit(env["OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"])
    assert (endpoint.scheme, endpoint.port, endpoint.path) == ("http", 4318, "/v1/traces")
    assert re.fullmatch(r"[a-z0-9-]+\.[a-z0-9-]+\.svc(\.cluster\.local)?", endpoint.hostname), endpoint.hostname
    assert env["OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"] == "http/protobuf"
    assert env["OTEL_RESOURCE_ATTRIBUTES"] == "k8s.pod.name=vllm-7d9f-abcde,k8s.namespace.name=inference"


def test_the_container_starts_vllm_serve_with_the_rendered_pipeline(tmp_path: Path) -> None:
    """The container's shell command, run with a `vllm` that prints its arguments; vLLM's own `serve`
    parser must accept them and read the --kv-transfer-config that `kvcompose render` prints."""
    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    pipeline_text = only("ConfigMap", "kvcompose-pipeline")["data"]["pipeline.yaml"]
    result = run_container_command(tmp_path, pipeline_text)
    assert result.returncode == 0, result.stderr
    argv = json.loads(result.stdout)
    assert argv[0] == "serve"

    parser = FlexibleArgumentParser()
    command = ServeSubcommand()
    command.subparser_init(parser.add_subparsers(dest="subparser"))
    args = parser.parse_args(argv)
    command.validate(args)
    env = container_env()
    assert args.model_tag == env["MODEL"]
    assert (args.host, args.port) == ("0.0.0.0", container()["ports"][0]["containerPort"])
    assert args.otlp_traces_endpoint == env["OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"]
    pipeline_path = tmp_path / "pipeline.yaml"
    expected = kv_transfer_config(load_pipeline(pipeline_path), file_reference(pipeline_path))
    assert {key: getattr(args.kv_transfer_config, key) for key in expected} == expected


def test_the_container_stops_with_status_2_on_a_bad_pipeline_before_vllm_starts(tmp_path: Path) -> None:
    pipeline_text = only("ConfigMap", "kvcompose-pipeline")["data"]["pipeline.yaml"]
    result = run_container_command(tmp_path, pipeline_text.replace("OffloadingConnector", "OffloadConnector"))
    assert (result.returncode, result.stdout) == (2, "")
    assert "children[0].connector: unknown connector 'OffloadConnector'" in result.stderr
    assert result.stderr.count("\n") == 1, result.stderr


# --- the dashboard ------------------------------------------------------------------------------

def test_the_dashboard_config_map_is_the_committed_dashboard_for_grafanas_sidecar() -> None:
    config_map = only("ConfigMap", "kvcompose-dashboard")
    assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert config_map["data"] == {"kvcompose.json": COMMITTED_DASHBOARD.read_text()}
    generator = next(g for g in yaml.safe_load((BASE / "kustomization.yaml").read_text())["configMapGenerator"]
                     if g["name"] == "kvcompose-dashboard")
    assert generator["options"]["disableNameSuffixHash"] is True  # a stable name for the sidecar to update


# --- generate -----------------------------------------------------------------------------------

def test_generate_writes_every_derived_file_and_refuses_a_directory_that_is_no_checkout(tmp_path: Path) -> None:
    refused = subprocess.run([sys.executable, "-m", "kvcompose.deploy", "generate", "--root", str(tmp_path)],
                             capture_output=True, text=True, timeout=60)
    assert (refused.returncode, refused.stdout) == (2, "")
    assert refused.stderr == f"--root {tmp_path}: not a kvcompose checkout (no deploy/kubernetes/kustomization.yaml)\n"

    (tmp_path / "deploy" / "kubernetes").mkdir(parents=True)
    (tmp_path / "deploy" / "kubernetes" / "kustomization.yaml").write_text("resources: []\n")
    result = subprocess.run([sys.executable, "-m", "kvcompose.deploy", "generate", "--root", str(tmp_path)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    expected = derived_files()
    assert result.stdout.splitlines() == [f"wrote {path}" for path in expected]
    assert {path: (tmp_path / path).read_text() for path in expected} == expected
