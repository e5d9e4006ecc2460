"""The ``kvcompose`` command line: validate, render and describe pipelines.

Nothing here imports vLLM (about 13 s to import), so every command answers
in well under a second. Bad input exits with status 2 and one line per
problem on stderr, never a traceback.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import NoReturn

from kvcompose import __version__
from kvcompose.config import load_pipeline
from kvcompose.deploy import add_commands as add_deploy_commands
from kvcompose.errors import PipelineConfigError
from kvcompose.render import file_reference, inline_reference, kv_transfer_config
from kvcompose.schema import pipeline_json_schema
from kvcompose.source import read_pipeline_source

EXIT_USAGE = 2


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see --help)\n")


def _build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="kvcompose", description="Compose vLLM KV-cache connectors, observably.")
    parser.add_argument("--version", action="version", version=f"kvcompose {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    validate = commands.add_parser("validate", help="check a pipeline file; exit 2 on any problem")
    validate.add_argument("file", type=Path)
    validate.set_defaults(run=_validate)

    render = commands.add_parser("render", help="print the JSON for `vllm serve --kv-transfer-config`")
    render.add_argument("file", type=Path)
    render.add_argument("--inline", action="store_true", help="embed the pipeline instead of its path")
    render.set_defaults(run=_render)

    schema = commands.add_parser("schema", help="print the JSON Schema of pipeline files")
    schema.set_defaults(run=_schema)

    dashboard = commands.add_parser("dashboard", help="print (or write) the Grafana dashboard JSON")
    dashboard.add_argument("--pipeline", type=Path, help="lay out one row per child of this pipeline file")
    dashboard.add_argument("--output", type=Path, help="write the dashboard to this file instead of stdout")
    dashboard.add_argument("--provisioning", type=Path, metavar="DIR",
                           help="also write Grafana provisioning files (datasource, dashboard provider) under DIR")
    dashboard.set_defaults(run=_dashboard)
    add_deploy_commands(commands)
    return parser


def _validate(args: argparse.Namespace) -> None:
    pipeline = load_pipeline(args.file)
    names = ", ".join(child.name for child in pipeline.children)
    print(f"ok: pipeline {pipeline.name!r}, {len(pipeline.children)} children ({names}), "
          f"load policy {pipeline.load.policy}")


def _render(args: argparse.Namespace) -> None:
    document = read_pipeline_source(args.file)
    pipeline = load_pipeline(document)
    ref = inline_reference(document) if args.inline else file_reference(args.file)
    print(json.dumps(kv_transfer_config(pipeline, ref), separators=(",", ":")))


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
