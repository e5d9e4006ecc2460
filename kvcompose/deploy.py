"""The operations kit's files: alert rules as a rule file or a PrometheusRule, and the repository's derived copies.

``kvcompose alerts`` prints the rules with your thresholds; ``kvcompose
generate`` rewrites every file the repository derives from code (the
dashboard, its provisioning, the alert rules and their Kubernetes copies), so
one command keeps them all in step. ``add_commands`` registers both on the
``kvcompose`` command line; ``python -m kvcompose.deploy`` runs them too.
Nothing here imports vLLM.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import NoReturn
from pathlib import Path

import yaml

from kvcompose.alerts import RUNBOOK_URL_BASE, AlertSettingError, rule_groups
from kvcompose.command_line import CommandParser, Commands, EXIT_USAGE

ALERTS_FILE = "deploy/prometheus/alerts.yaml"
PROMETHEUS_RULE_FILE = "deploy/kubernetes/prometheusrule.yaml"
KUSTOMIZATION_DIR = "deploy/kubernetes"
# kustomize reads files from the kustomization's own directory only, so the dashboard ConfigMap needs a copy.
KUBERNETES_DASHBOARD_FILE = "deploy/kubernetes/dashboards/kvcompose.json"
DASHBOARD_FILE = "dashboards/kvcompose.json"
PROVISIONING_DIR = "dashboards/provisioning"
PROMETHEUS_RULE_NAME = "kvcompose"
PART_OF = {"app.kubernetes.io/part-of": "kvcompose"}
GENERATED = ("# Written by `kvcompose generate` from kvcompose/alerts.py; regenerate rather than edit.\n"
             "# Other thresholds: `kvcompose alerts --set ALERT.PARAMETER=VALUE` (docs/runbooks/README.md).\n")


class _Dumper(yaml.SafeDumper):
    """Multi-line strings (PromQL) as literal blocks, so the rules read as written."""


def _represent_str(dumper: yaml.SafeDumper, text: str) -> yaml.ScalarNode:
    return dumper.represent_scalar("tag:yaml.org,2002:str", text, style="|" if "\n" in text else None)


_Dumper.add_representer(str, _represent_str)


def dump_yaml(document: object) -> str:
    return yaml.dump(document, Dumper=_Dumper, sort_keys=False, width=120, allow_unicode=True)


def prometheus_rule(groups: list[dict[str, object]]) -> dict[str, object]:
    """The prometheus-operator object holding ``groups``."""
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PrometheusRule",
        "metadata": {"name": PROMETHEUS_RULE_NAME, "labels": {**PART_OF, "app.kubernetes.io/component": "alerts"}},
        "spec": {"groups": groups},
    }


def alerts_text(groups: list[dict[str, object]], as_prometheus_rule: bool = False) -> str:
    return GENERATED + dump_yaml(prometheus_rule(groups) if as_prometheus_rule else {"groups": groups})


def derived_files() -> dict[str, str]:
    """Every file the repository derives from code, by path from the repository root."""
    from kvcompose.dashboard import dashboard_json, provisioning_files  # only `generate` pays for the import

    dashboard = dashboard_json()
    groups = rule_groups()
    return {
        DASHBOARD_FILE: dashboard,
        **{f"{PROVISIONING_DIR}/{path}": text for path, text in provisioning_files().items()},
        ALERTS_FILE: alerts_text(groups),
        PROMETHEUS_RULE_FILE: alerts_text(groups, as_prometheus_rule=True),
        KUBERNETES_DASHBOARD_FILE: dashboard,
    }


def add_commands(commands: Commands) -> None:
    """Register ``alerts`` and ``generate`` on a subcommand parser (``kvcompose``'s)."""
    alerts = commands.add_parser("alerts", help="print the Prometheus alert rules, with your thresholds")
    alerts.add_argument("--set", dest="overrides", action="append", default=[], metavar="ALERT.PARAMETER=VALUE",
                        help="change a threshold, `for` or `severity`, e.g. KVComposeTransferSlow.load_p99_seconds=1")
    alerts.add_argument("--runbook-url-base", default=RUNBOOK_URL_BASE,
                        help="URL prefix of the runbooks; each alert links to BASE/<AlertName>.md")
    alerts.add_argument("--prometheus-rule", action="store_true",
                        help="print a prometheus-operator PrometheusRule instead of a Prometheus rule file")
    alerts.add_argument("--output", type=Path, help="write to this file instead of stdout")
    alerts.set_defaults(run=_alerts)

    generate = commands.add_parser("generate", help="rewrite the repository's generated files (dashboards, deploy/)")
    generate.add_argument("--root", type=Path, default=Path("."), help="the kvcompose checkout (default: .)")
    generate.set_defaults(run=_generate)


def _alerts(args: argparse.Namespace) -> None:
    overrides = {}
    for item in args.overrides:
        key, equals, value = item.partition("=")
        if not equals:
            _fail(f"--set {item}: expected ALERT.PARAMETER=VALUE")
        overrides[key] = value
    try:
        groups = rule_groups(overrides, args.runbook_url_base)
    except AlertSettingError as error:
        _fail(f"--set {error}")
    text = alerts_text(groups, as_prometheus_rule=args.prometheus_rule)
    if args.output is None:
        sys.stdout.write(text)
    else:
        _write(args.output, text)


def _generate(args: argparse.Namespace) -> None:
    if not (args.root / KUSTOMIZATION_DIR / "kustomization.yaml").is_file():
        _fail(f"--root {args.root}: not a kvcompose checkout (no {KUSTOMIZATION_DIR}/kustomization.yaml)")
    for relative, text in derived_files().items():
        path = args.root / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        _write(path, text)
        print(f"wrote {relative}")


def _write(path: Path, text: str) -> None:
    try:
        path.write_text(text)
    except OSError as error:
        _fail(f"{path}: cannot write: {error.strerror}")


def _fail(message: str) -> NoReturn:
    print(message, file=sys.stderr)
    raise SystemExit(EXIT_USAGE)


def main(argv: Sequence[str] | None = None) -> None:
    parser = CommandParser(prog="python -m kvcompose.deploy", description=__doc__.splitlines()[0])
    add_commands(parser.add_subparsers(dest="command", required=True, parser_class=CommandParser))
    args = parser.parse_args(argv)
    args.run(args)


if __name__ == "__main__":
    main()
