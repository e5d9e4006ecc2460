"""The ``kvcompose`` command line: start, check, render and serve pipelines, and watch them run.

Only ``serve`` imports vLLM (about 13 s to import), and only once the
pipeline has passed its checks, so every other command answers in well under
a second. Bad input exits with status 2 and one line per problem on stderr,
never a traceback.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from kvcompose import __version__
from kvcompose.checks import check_pipeline
from kvcompose.command_line import EXIT_USAGE, CommandParser
from kvcompose.config import load_pipeline
from kvcompose.deploy import add_commands as add_deploy_commands
from kvcompose.economics.advise import add_command as add_advise_command
from kvcompose.economics.fleet import add_command as add_fleet_command
from kvcompose.errors import PipelineConfigError
from kvcompose.render import kv_transfer_config
from kvcompose.schema import pipeline_json_schema
from kvcompose.serve import add_command as add_serve_command
from kvcompose.starters import add_command as add_init_command
from kvcompose.top import add_command as add_top_command

FILE_HELP = "the pipeline file (YAML or JSON); - reads standard input"


def _build_parser() -> argparse.ArgumentParser:
    parser = CommandParser(prog="kvcompose", description="Compose vLLM KV-cache connectors, observably.")
    parser.add_argument("--version", action="version", version=f"kvcompose {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=CommandParser)

    add_init_command(commands)
    validate = commands.add_parser("validate", help="check a pipeline file; exit 2 on any problem")
    validate.add_argument("file", type=Path, help=FILE_HELP)
    validate.set_defaults(run=_validate)

    render = commands.add_parser("render", help="print the JSON for `vllm serve --kv-transfer-config`")
    render.add_argument("file", type=Path, help=FILE_HELP)
    render.add_argument("--inline", action="store_true",
                        help="embed the pipeline instead of its path (always, for a pipeline from standard input)")
    render.set_defaults(run=_render)

    schema = commands.add_parser("schema", help="print the JSON Schema of pipeline files")
    schema.set_defaults(run=_schema)

    dashboard = commands.add_parser("dashboard", help="print (or write) the Grafana dashboard JSON")
    dashboard.add_argument("--pipeline", type=Path, help="lay out one row per child of this pipeline file")
    dashboard.add_argument("--output", type=Path, help="write the dashboard to this file instead of stdout")
    dashboard.add_argument("--provisioning", type=Path, metavar="DIR",
                           help="also write Grafana provisioning files (datasource, dashboard provider) under DIR")
    dashboard.set_defaults(run=_dashboard)
    add_serve_command(commands)
    add_top_command(commands)
    add_advise_command(commands)
    add_fleet_command(commands)
    add_deploy_commands(commands)
    return parser


def _validate(args: argparse.Namespace) -> None:
    checked = check_pipeline(args.file)
    checked.print_warnings()
    pipeline = checked.pipeline
    count = len(pipeline.children)
    names = ", ".join(child.name for child in pipeline.children)
    print(f"ok: pipeline {pipeline.name!r}, {count} {'child' if count == 1 else 'children'} ({names}), "
          f"load policy {pipeline.load.policy}")


def _render(args: argparse.Namespace) -> None:
    checked = check_pipeline(args.file)
    checked.print_warnings()
    print(json.dumps(kv_transfer_config(checked.pipeline, checked.reference(args.inline)), separators=(",", ":")))


def _schema(args: argparse.Namespace) -> None:
    print(json.dumps(pipeline_json_schema(), indent=2))


def _dashboard(args: argparse.Namespace) -> None:
    from kvcompose.dashboard import dashboard_json, provisioning_files  # only this command pays for the import

    text = dashboard_json(load_pipeline(args.pipeline) if args.pipeline else None)
    if args.output is None:
        sys.stdout.write(text)
    else:
        _write(args.output, text)
    if args.provisioning is not None:
        for relative, content in provisioning_files().items():
            _write(args.provisioning / relative, content, make_parents=True)


def _write(path: Path, text: str, make_parents: bool = False) -> None:
    try:
        if make_parents:
            path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    except OSError as error:
        print(f"{path}: cannot write: {error.strerror}", file=sys.stderr)
        raise SystemExit(EXIT_USAGE) from None


def main(argv: Sequence[str] | None = None) -> int:
    args = _build_parser().parse_args(argv)
    try:
        args.run(args)
    except PipelineConfigError as error:
        print(error, file=sys.stderr)
        return EXIT_USAGE
    return 0


if __name__ == "__main__":
    sys.exit(main())
