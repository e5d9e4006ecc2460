"""A real Prometheus server scraping one target, and its HTTP query API."""

from __future__ import annotations

import json
import shutil
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .server_support import free_port, stop_process

SCRAPE_INTERVAL_S = 1
JOB = "vllm"


@dataclass
class PrometheusServer:
    process: subprocess.Popen[bytes]
    url: str
    log: Path

    def stop(self) -> None:
        stop_process(self.process)


def start_prometheus(
    target_url: str, root: Path, metrics_path: str = "/metrics", features: tuple[str, ...] = (),
) -> PrometheusServer:
    """Start Prometheus scraping ``target_url`` every second; return once it has scraped it.

    ``features``: Prometheus feature flags, e.g. ``exemplar-storage`` to keep exemplars."""
    binary = shutil.which("prometheus")
    assert binary, "the Prometheus server is missing: `make test` installs it (scripts/ensure-prometheus.sh)"
    target = target_url.removeprefix("http://")
    (root / "prometheus.yml").write_text(
        f"global: {{scrape_interval: {SCRAPE_INTERVAL_S}s}}\n"
        f"scrape_configs:\n  - job_name: {JOB}\n    metrics_path: {metrics_path}\n"
        f"    static_configs: [{{targets: ['{target}']}}]\n"
    )
    url = f"http://127.0.0.1:{free_port()}"
    log = root / "prometheus.log"
    with log.open("wb") as sink:
        process = subprocess.Popen(
            [binary, f"--config.file={root / 'prometheus.yml'}", f"--storage.tsdb.path={root / 'data'}",
             f"--web.listen-address={url.removeprefix('http://')}", *(f"--enable-feature={f}" for f in features)],
            stdout=sink, stderr=subprocess.STDOUT)
    server = PrometheusServer(process, url, log)
    try:
        wait(lambda: urllib.request.urlopen(f"{url}/-/ready", timeout=2).status == 200, 60, log.read_text)
        wait(lambda: [float(r["value"][1]) for r in instant(url, f'up{{job="{JOB}"}}')["result"]] == [1.0], 60,
             log.read_text)
    except BaseException:
        server.stop()
        raise
    return server


def wait(ready: Callable[[], Any], seconds: float, explain: Callable[[], str]) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            if ready():
                return
        except OSError:
            pass
        time.sleep(0.5)
    raise AssertionError(f"timed out after {seconds}s:\n{explain()[-3000:]}")


def api(url: str, path: str, params: dict[str, Any]) -> dict[str, Any]:
    """GET an /api/v1 endpoint; the answer's ``data``, or the error Prometheus gave."""
    request = f"{url}/api/v1/{path}?{urllib.parse.urlencode(params, doseq=True)}"
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            body = json.load(response)
    except urllib.error.HTTPError as error:
        body = json.load(error)
    assert body["status"] == "success", f"{params}: {body}"
    return body["data"]


def instant(url: str, promql: str, at: float | None = None) -> dict[str, Any]:
    """An instant query: ``{"resultType": ..., "result": [...]}``."""
    return api(url, "query", {"query": promql, **({"time": at} if at is not None else {})})
