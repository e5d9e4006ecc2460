"""``kvcompose advise --metrics``: hand-built expositions whose right answers the tests work out themselves.

The expositions are written by prometheus_client (the library vLLM exports with), in the classic text
format and in OpenMetrics, from one scenario: two engines, a GPU cache of 512 blocks, an ``offload`` tier
of 1,024 blocks that pays and a ``disk`` tier of 8,192 blocks that does not. Each loader's reach is the
one the engine's sampler exports (kvcompose_tier_reach_blocks).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.openmetrics.exposition import generate_latest as generate_openmetrics

from kvcompose.cli import main

GIB = 2**30
ENGINES = ("0", "1")
START, SAVED_AT = 1_700_000_000.0, 1_700_003_600.0  # an hour of uptime
SPAN = SAVED_AT - START
BLOCK_BYTES = 2 * 2**20
GPU_BLOCKS = 512
# The curve both engines report, averaged: they report it 0.02 apart. Its ceiling is 0.8, reached by 4,096
# blocks, and 90% of that (0.72) exactly at 2,048 blocks.
CURVE = {256: 0.1, 512: 0.3, 1024: 0.6, 2048: 0.72, 4096: 0.8, 8192: 0.8}
TIERS: dict[str, dict[str, Any]] = {
    "offload": {"position": 0, "class": "OffloadingConnector", "capacity": 1024, "reach": (512, 1536),
                "hits": (30, 12),
                "misses": (50, 8), "loaded": (60_000, 12_000), "saved_s": (30.0, 6.0),
                "wait": {"load": (1.0, 0.5), "save": (0.5, 0.5)}, "bytes": {"load": (4e9, 2e9), "save": (8e9, 0)},
                "forgone": (0, 0), "waste": (0.96, 0.94)},
    "disk": {"position": 1, "class": "ExampleConnector", "capacity": 8192, "reach": (1536, 8704), "hits": (5, 5),
             "misses": (75, 15),
             "loaded": (4_000, 1_000), "saved_s": (0.7, 0.3), "wait": {"load": (0.9, 0.3), "save": (0.3, 0.2)},
             "bytes": {"load": (1e8, 0), "save": (8e9, 0)}, "forgone": (900, 100), "waste": (0.5, 0.5)},
}
# Copy times observed by the offload tier's loads: p99 falls exactly on the 0.01 s bucket bound.
COPY_TIMES = [0.0005] * 50 + [0.005] * 49 + [0.5]
# The bytes of those loads (engine 0's): the tier's other loads (failed, or with no copy time) moved bytes too,
# which are not the copies'.
COPIED_BYTES = 1.5e9
PROMPT_TOKENS = (150_000, 50_000)
PREFILL_S_PER_TOKEN = 5e-4


# A save-only child (children[].load: false) of 4,096 blocks, first in the pipeline: it loads nothing, so the
# sampler exports no reach for it, and the loaders' reaches are as they are without it.
SAVE_ONLY = {"position": 0, "class": "OffloadingConnector", "capacity": 4096, "hits": (0, 0), "misses": (0, 0),
             "loaded": (0, 0), "saved_s": (0, 0), "wait": {"load": (0, 0), "save": (0.1, 0.1)},
             "bytes": {"load": (0, 0), "save": (8e9, 0)}, "forgone": (0, 0), "waste": (0.5, 0.5)}


def registry(net_negative_disk: bool = True, start_time: bool = True, disk_loads: bool = True,
             cost: float | None = PREFILL_S_PER_TOKEN, save_only: bool = False) -> CollectorRegistry:
    """The scenario; ``cost`` None: the engines' cost is not known (the gauge absent, the saved seconds
    0); ``save_only``: a save-only child first in the pipeline."""
    reg = CollectorRegistry()
    engine = ["model_name", "engine"]
    lookups = Counter("kvcompose_lookups", "", [*engine, "connector", "result"], registry=reg)
    loaded = Counter("kvcompose_loaded_tokens", "", [*engine, "connector"], registry=reg)
    saved = Counter("kvcompose_prefill_seconds_saved", "", [*engine, "connector"], registry=reg)
    forgone = Counter("kvcompose_tokens_forgone", "", [*engine, "connector"], registry=reg)
    wait = Counter("kvcompose_engine_wait_seconds", "", [*engine, "connector", "direction"], registry=reg)
    moved = Counter("kvcompose_transfer_bytes", "", [*engine, "connector", "direction"], registry=reg)
    copied = Counter("kvcompose_transfer_copied_bytes", "", [*engine, "connector", "direction", "source"],
                     registry=reg)
    copy = Histogram("kvcompose_transfer_copy_seconds", "", [*engine, "connector", "direction", "source"],
                     buckets=(0.001, 0.01, 0.1, 1.0), registry=reg)
    info = Gauge("kvcompose_pipeline_info", "", [*engine, "pipeline", "connector", "connector_class", "position"],
                 registry=reg)
    capacity = Gauge("kvcompose_tier_capacity_blocks", "", [*engine, "connector"], registry=reg)
    reach = Gauge("kvcompose_tier_reach_blocks", "", [*engine, "connector", "edge"], registry=reg)
    waste = Gauge("kvcompose_write_waste_ratio", "", [*engine, "connector"], registry=reg)
    curve = Gauge("kvcompose_cache_size_hit_ratio", "", [*engine, "size_blocks"], registry=reg)
    block_bytes = Gauge("kvcompose_kv_block_bytes", "", engine, registry=reg)
    prefill_cost = Gauge("kvcompose_prefill_seconds_per_token", "", engine, registry=reg)
    prompt_tokens = Counter("vllm:prompt_tokens", "", engine, registry=reg)
    if start_time:
        Gauge("process_start_time_seconds", "", registry=reg).set(START)
    for index, name in enumerate(ENGINES):
        labels = {"model_name": "m", "engine": name}
        tiers = {"backup": SAVE_ONLY, **TIERS} if save_only else TIERS
        for tier, figures in tiers.items():
            at = {**labels, "connector": tier}
            lookups.labels(**at, result="hit").inc(figures["hits"][index])
            lookups.labels(**at, result="miss").inc(figures["misses"][index])
            quiet = tier == "disk" and not disk_loads
            loaded.labels(**at).inc(0 if quiet else figures["loaded"][index])
            saved_s = 0 if quiet or cost is None else figures["saved_s"][index] * (
                1 if net_negative_disk or tier != "disk" else 10)
            saved.labels(**at).inc(saved_s)
            forgone.labels(**at).inc(figures["forgone"][index])
            for direction in ("load", "save"):
                wait.labels(**at, direction=direction).inc(figures["wait"][direction][index])
                moved.labels(**at, direction=direction).inc(figures["bytes"][direction][index])
            position = figures["position"] + (1 if save_only and tier != "backup" else 0)
            info.labels(**labels, pipeline="p", connector=tier, connector_class=figures["class"],
                        position=str(position)).set(1)
            capacity.labels(**at).set(figures["capacity"])
            for edge, blocks in zip(("start", "end"), figures.get("reach", ()), strict=False):
                reach.labels(**at, edge=edge).set(blocks)
            waste.labels(**at).set(figures["waste"][index])
        capacity.labels(**labels, connector="gpu").set(GPU_BLOCKS)
        for size, ratio in CURVE.items():
            curve.labels(**labels, size_blocks=str(size)).set(ratio + (0.02 if index else -0.02))
        block_bytes.labels(**labels).set(BLOCK_BYTES)
        if cost is not None:
            prefill_cost.labels(**labels).set(cost)
        prompt_tokens.labels(**labels).inc(PROMPT_TOKENS[index])
    for seconds in COPY_TIMES:
        copy.labels(model_name="m", engine="0", connector="offload", direction="load", source="child").observe(seconds)
    copied.labels(model_name="m", engine="0", connector="offload", direction="load", source="child").inc(COPIED_BYTES)
    return reg


def write(path: Path, reg: CollectorRegistry, openmetrics: bool = False) -> Path:
    path.write_bytes((generate_openmetrics if openmetrics else generate_latest)(reg))
    os.utime(path, (SAVED_AT, SAVED_AT))
    return path


def run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    try:
        status = main(argv)
    except SystemExit as exit_:
        status = int(exit_.code or 0)
    out, err = capsys.readouterr()
    return status, out, err


def log_interpolated(size: float, lower: int, upper: int) -> float:
    share = math.log(size / lower) / math.log(upper / lower)
    return CURVE[lower] + share * (CURVE[upper] - CURVE[lower])


@pytest.mark.parametrize("openmetrics", [False, True])
def test_advice_from_a_saved_exposition(openmetrics: bool, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write(tmp_path / "metrics.txt", registry(), openmetrics)
    status, out, err = run(["advise", "--metrics", str(path), "--json"], capsys)
    assert (status, err) == (1, "")  # the disk tier is net negative
    advice = json.loads(out)
    assert advice["span_s"] == pytest.approx(SPAN)
    check_scenario_advice(advice, hours=1.0, rel=1e-6)


def check_scenario_advice(advice: dict[str, Any], hours: float, rel: float) -> None:
    """The scenario's right answers, worked out here: rates are the scenario's amounts per hour; totals are
    those amounts over ``hours``."""
    def near(expected: Any) -> Any:
        return pytest.approx(expected, rel=rel, abs=1e-12)

    assert advice["gpu_blocks"] == GPU_BLOCKS and advice["block_bytes"] == BLOCK_BYTES
    assert advice["prompt_tokens_per_s"] == near(sum(PROMPT_TOKENS) / 3600)
    assert advice["curve"]["size_blocks"] == sorted(CURVE)
    assert advice["curve"]["hit_ratio"] == pytest.approx([CURVE[size] for size in sorted(CURVE)])
    assert advice["curve"]["ceiling"] == pytest.approx(0.8)
    assert advice["curve"]["knee_blocks"] == 2048
    assert advice["net_negative"] == ["disk"]
    tiers = {tier["name"]: tier for tier in advice["tiers"]}
    assert [tier["name"] for tier in advice["tiers"]] == ["offload", "disk"]  # pipeline order

    offload, disk = tiers["offload"], tiers["disk"]
    assert offload["hit_ratio"] == near(42 / 100)
    assert offload["tokens_per_s"] == near(72_000 / 3600)
    assert offload["prefill_saved_s_per_s"] == near(36 / 3600)
    assert offload["engine_wait_s_per_s"] == near({"load": 1.5 / 3600, "save": 1.0 / 3600})
    assert offload["net_s_per_s"] == near((36 - 1.5) / 3600)  # net of its loads' wait only
    assert offload["net_negative"] is False
    assert offload["copy"]["load"]["p99_s"] == near(0.01)
    assert offload["copy"]["load"]["moved_bytes_per_s"] == near(6e9 / 3600)
    assert offload["copy"]["load"]["copy_bytes_per_s"] == near(COPIED_BYTES / sum(COPY_TIMES))
    assert offload["copy"]["save"]["p99_s"] is None  # no copy time observed for saves
    assert offload["capacity_gib"] == pytest.approx(1024 * BLOCK_BYTES / GIB)
    # Below a GPU cache of 512 blocks, 1,024 blocks serve distances [512, 1536), and 8,192 after them [1536, 8704).
    assert (offload["reach"], disk["reach"]) == ({"start": 512, "end": 1536}, {"start": 1536, "end": 8704})
    at_1536 = log_interpolated(1536, 1024, 2048)
    assert offload["curve_share"] == pytest.approx(at_1536 - CURVE[512])
    assert offload["marginal_hit_ratio_per_gib"] == pytest.approx(
        (CURVE[2048] - at_1536) / ((2048 - 1536) * BLOCK_BYTES / GIB))
    assert offload["write_waste"] == pytest.approx(0.95)
    assert offload["tokens_forgone_per_s"] == 0

    kinds = {name: [r["kind"] for r in tier["recommendations"]] for name, tier in tiers.items()}
    assert kinds == {"offload": ["grow", "write_waste"], "disk": ["net_negative", "shrink", "load_policy"]}
    grow = tiers["offload"]["recommendations"][0]["figures"]
    assert grow["recommended_capacity_blocks"] == 2048 - 512  # its reach then ends at the knee
    assert grow["hit_ratio_gain"] == pytest.approx(CURVE[2048] - at_1536)
    assert grow["prefill_s_per_s_gain"] == near(
        (CURVE[2048] - at_1536) * sum(PROMPT_TOKENS) / 3600 * PREFILL_S_PER_TOKEN)
    shrink = tiers["disk"]["recommendations"][1]["figures"]
    assert shrink["recommended_capacity_blocks"] == 2048 - 1536
    assert shrink["hit_ratio_loss"] == pytest.approx(0.8 - 0.72)
    negative = tiers["disk"]["recommendations"][0]["figures"]
    assert negative == near({"prefill_saved_s": 1.0 * hours, "engine_wait_load_s": 1.2 * hours,
                             "engine_wait_save_s": 0.5 * hours, "net_s_per_s": -0.2 / 3600})
    policy = tiers["disk"]["recommendations"][2]["figures"]
    assert policy == near({"tokens_forgone": 1000 * hours, "tokens_loaded": 5000 * hours,
                           "prefill_s_forgone": 1000 * hours * PREFILL_S_PER_TOKEN})


def test_text_states_the_numbers_behind_each_recommendation(tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    status, out, _ = run(["advise", "--metrics", str(write(tmp_path / "m.txt", registry()))], capsys)
    assert status == 1
    assert "grow it to 1,536 blocks (3.0 GiB, +1.0 GiB)" in out
    assert "it could shrink to 512 blocks (1.0 GiB, -15.0 GiB)" in out
    assert "net negative: it saved 1 s of prefill but its loads held the engine 1.2 s (its saves a further 0.5 s)" in out
    assert "95% of the blocks written to it are not read from it" in out
    assert "longest_match would have loaded 1,000 more tokens from it" in out
    # The policy is not in the metrics: behind an earlier loader a reach is what first_match would serve at most.
    assert "serves reuse distances [512, 1,536): " in out
    assert "serves reuse distances [1,536, 8,704) at most (under first_match see tokens forgone)" in out
    assert out.rstrip().endswith("net negative: disk")


def test_a_tier_that_loaded_nothing_is_not_judged_net_negative(tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    """Its start_load_kv still ran every step: a little load wait, and nothing saved."""
    status, out, _ = run(["advise", "--metrics", str(write(tmp_path / "m.txt", registry(disk_loads=False))),
                          "--json"], capsys)
    disk = {tier["name"]: tier for tier in json.loads(out)["tiers"]}["disk"]
    assert status == 0 and disk["net_negative"] is False
    assert disk["engine_wait_s_per_s"]["load"] > 0 and disk["prefill_saved_s_per_s"] == 0


def test_a_save_only_child_gets_no_band_and_leaves_the_loaders_bands_as_the_sampler_exported(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Bands over every child in pipeline order would give the save-only child [512, 4608) and the offload
    tier, no larger, nothing."""
    path = write(tmp_path / "m.txt", registry(save_only=True))
    status, out, _ = run(["advise", "--metrics", str(path), "--json"], capsys)
    advice = json.loads(out)
    tiers = {tier["name"]: tier for tier in advice["tiers"]}
    assert [tier["name"] for tier in advice["tiers"]] == ["backup", "offload", "disk"]
    assert tiers["backup"]["reach"] is None and tiers["backup"]["curve_share"] is None
    assert not any(r["kind"] in ("grow", "shrink", "size_ok", "past_the_knee", "serves_nothing")
                   for r in tiers["backup"]["recommendations"])
    assert (tiers["offload"]["reach"], tiers["disk"]["reach"]) == (
        {"start": 512, "end": 1536}, {"start": 1536, "end": 8704})
    assert [r["kind"] for r in tiers["offload"]["recommendations"]] == ["grow", "write_waste"]
    _, text, _ = run(["advise", "--metrics", str(path)], capsys)
    assert "4,096 blocks (8.0 GiB), no reach exported (it does not load" in text


@pytest.mark.parametrize("cost", [None, 0.0])
def test_without_a_prefill_cost_no_tier_is_judged(cost: float | None, tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """The fit has no estimate yet (the gauge absent) or a zero slope: nothing was priced, so the saved
    seconds read 0 while the loads' wait is real; the disk tier would read net negative."""
    path = write(tmp_path / "m.txt", registry(cost=cost))
    status, out, _ = run(["advise", "--metrics", str(path), "--json"], capsys)
    advice = json.loads(out)
    assert status == 0 and advice["net_negative"] == [] and advice["prefill_cost_known"] is False
    for tier in advice["tiers"]:
        assert tier["net_negative"] is False and tier["net_s_per_s"] is None
        assert tier["prefill_saved_s_per_s"] is None
        assert [r["kind"] for r in tier["recommendations"]][0] == "value_unknown"
    _, text, _ = run(["advise", "--metrics", str(path)], capsys)
    assert "prefill cost per token not known yet" in text
    assert ("cannot judge whether it pays: the engine's prefill cost per token is not known "
            f"(kvcompose_prefill_seconds_per_token {'absent' if cost is None else '0'}") in text
    assert "5,000 tokens it loaded are not priced against the 1.2 s its loads held the engine" in text
    assert "NET NEGATIVE" not in text
    assert text.rstrip().endswith("no tier judged: the engine's prefill cost per token is not known, so no load "
                                  "was priced")


def test_all_tiers_paying_exits_zero(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write(tmp_path / "m.txt", registry(net_negative_disk=False))
    status, out, _ = run(["advise", "--metrics", str(path)], capsys)
    assert status == 0
    assert out.rstrip().endswith("no tier is net negative")


def test_without_a_start_time_there_are_totals_and_ratios_but_no_rates(tmp_path: Path,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    path = write(tmp_path / "m.txt", registry(start_time=False))
    status, out, _ = run(["advise", "--metrics", str(path), "--json"], capsys)
    advice = json.loads(out)
    assert status == 1 and advice["net_negative"] == ["disk"]  # a ratio of totals: no time needed
    assert advice["span_s"] is None
    offload = advice["tiers"][0]
    assert offload["hit_ratio"] == pytest.approx(0.42)
    assert offload["tokens_per_s"] is None and offload["net_s_per_s"] is None


def test_at_overrides_when_the_file_was_saved(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write(tmp_path / "m.txt", registry())
    for at in ("2023-11-15T00:13:20+00:00", "1700007200"):  # two hours after the start, the file says one
        _, out, _ = run(["advise", "--metrics", str(path), "--json", "--at", at], capsys)
        assert json.loads(out)["span_s"] == pytest.approx(7200)


@pytest.mark.parametrize(("argv", "lines"), [
    (["advise", "--metrics", "{missing}"], ["{missing}: cannot read: No such file or directory"]),
    (["advise", "--metrics", "{garbage}"], ["{garbage}: not a Prometheus exposition"]),
    (["advise", "--metrics", "{vllm_only}"], ["{vllm_only}: no kvcompose series"]),
    (["advise", "--metrics", "{good}", "--since", "6h", "--at", "noon"],
     ["--at noon: not a time", "--since applies to --prometheus"]),
    (["advise", "--metrics", "{good}", "--at", "1600000000"], ["{good}: saved (at 1600000000) before its server"]),
    (["advise", "--prometheus", "http://127.0.0.1:9", "--since", "6 hours"], ["--since 6 hours: not a duration"]),
    (["advise", "--prometheus", "http://127.0.0.1:9"], ["http://127.0.0.1:9: cannot query Prometheus"]),
    (["advise"], ["kvcompose advise: error: one of the arguments --metrics --prometheus is required"]),
])
def test_bad_input_exits_2_with_one_line_per_problem(argv: list[str], lines: list[str], tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    files = {"missing": tmp_path / "missing.txt", "garbage": tmp_path / "garbage.txt",
             "vllm_only": tmp_path / "vllm.txt", "good": write(tmp_path / "good.txt", registry())}
    files["garbage"].write_text('kvcompose_lookups_total{connector="a" 12\n')
    files["vllm_only"].write_text("# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running 1\n")
    status, out, err = run([part.format(**files) for part in argv], capsys)
    assert (status, out) == (2, "")
    assert len(err.splitlines()) == len(lines)
    for line, expected in zip(err.splitlines(), lines, strict=True):
        assert line.startswith(expected.format(**files))


def test_the_command_imports_neither_vllm_nor_numpy(tmp_path: Path) -> None:
    path = write(tmp_path / "m.txt", registry(net_negative_disk=False))
    probe = ("import sys; from kvcompose.cli import main; status = main(['advise', '--metrics', sys.argv[1]]); "
             "print(status, 'vllm' in sys.modules, 'numpy' in sys.modules, 'torch' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", probe, str(path)], check=False, capture_output=True, text=True,
                            timeout=60)
    assert result.stdout.splitlines()[-1] == "0 False False False", result.stderr
