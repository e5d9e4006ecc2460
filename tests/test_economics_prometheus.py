"""``kvcompose advise --prometheus``: the real Prometheus server, holding three hours of the advise scenario.

The scenario of tests/test_economics_advise.py becomes series: each counter grows by its amount every hour,
each gauge holds its value, a sample a minute. ``promtool tsdb create-blocks-from openmetrics`` writes them
into a TSDB, and Prometheus serves it; advise queries it over a window and must find the same answers.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from .prometheus_support import wait
from .server_support import free_port, stop_process
from .test_economics_advise import check_scenario_advice, registry, run

HOURS_OF_DATA = 3
STEP_S = 60
END = 1_790_000_000  # the last sample; Prometheus keeps backfilled blocks of any age within its retention


def backfill(path: Path) -> None:
    """The scenario as OpenMetrics with timestamps: counters rise linearly from zero, gauges stay."""
    start = END - HOURS_OF_DATA * 3600
    times = range(start, END + 1, STEP_S)
    lines = []
    for family in registry().collect():
        lines.append(f"# TYPE {family.name} {family.type}")
        rising = family.type in ("counter", "histogram")
        for sample in family.samples:
            if sample.name.endswith("_created"):
                continue
            labels = ",".join(f'{key}="{value}"' for key, value in sorted(sample.labels.items()))
            series = f"{sample.name}{{{labels}}}" if labels else sample.name
            lines += [f"{series} {sample.value * (t - start) / 3600 if rising else sample.value} {t}" for t in times]
    path.write_text("\n".join([*lines, "# EOF"]) + "\n")


@pytest.fixture(scope="module")
def prometheus(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    root = tmp_path_factory.mktemp("prometheus")
    binary, promtool = shutil.which("prometheus"), shutil.which("promtool")
    assert binary and promtool, "Prometheus is missing: `make test` installs it (scripts/ensure-prometheus.sh)"
    backfill(root / "series.om")
    subprocess.run([promtool, "tsdb", "create-blocks-from", "openmetrics", "--quiet", str(root / "series.om"),
                    str(root / "data")], check=True, capture_output=True, timeout=120)
    (root / "prometheus.yml").write_text("global: {}\n")
    url = f"http://127.0.0.1:{free_port()}"
    log = root / "prometheus.log"
    with log.open("wb") as sink:
        process = subprocess.Popen(
            [binary, f"--config.file={root / 'prometheus.yml'}", f"--storage.tsdb.path={root / 'data'}",
             "--storage.tsdb.retention.time=100y", f"--web.listen-address={url.removeprefix('http://')}"],
            stdout=sink, stderr=subprocess.STDOUT)
    try:
        wait(lambda: urllib.request.urlopen(f"{url}/-/ready", timeout=2).status == 200, 60, log.read_text)
        yield url
    finally:
        stop_process(process)


@pytest.mark.parametrize(("since", "hours"), [("2h", 2.0), ("6h", HOURS_OF_DATA)])
def test_advice_over_a_window_matches_the_scenario(since: str, hours: float, prometheus: str,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """Over 2 h the window is full; over 6 h only the last 3 h hold data, and per second still means per
    second of data (dividing by the whole window would halve every rate)."""
    status, out, err = run(["advise", "--prometheus", prometheus, "--since", since, "--at", str(END), "--json"],
                           capsys)
    assert (status, err) == (1, "")
    advice = json.loads(out)
    assert advice["span_s"] == pytest.approx(hours * 3600)
    # Prometheus extrapolates an increase by up to half a sample interval past the first sample.
    check_scenario_advice(advice, hours=hours, rel=STEP_S / 2 / (hours * 3600) + 1e-6)


def test_a_window_without_kvcompose_data_is_bad_input(prometheus: str, capsys: pytest.CaptureFixture[str]) -> None:
    before = END - 24 * 3600
    status, out, err = run(["advise", "--prometheus", prometheus, "--at", str(before)], capsys)
    assert (status, out) == (2, "")
    assert err == f"{prometheus}: no kvcompose series in the 21600 s before {before}\n"
