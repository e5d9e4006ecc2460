"""Two versions of kvcompose end to end, side by side in one run: ``python -m benchmarks.compare REV``.

Runs of ``make bench`` minutes apart move by about 10% on these machines (two runs of one commit read step
tracing's framework time per first token 380 and 414 us on 2026-11-26), more than most changes make. This runs
the end-to-end engines (``benchmarks/end_to_end.py``) of this checkout's kvcompose and of REV's (a git revision,
extracted with ``git archive``) in one set of rotating rounds, beside MultiConnector. The benchmark code,
stopwatch included, is this checkout's for both: only ``kvcompose`` differs. Per configuration it reports the
medians of both versions and the median of the per-round differences (this checkout's less REV's), and each
version's ratios to MultiConnector from the frameworks' cost.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from benchmarks import end_to_end
from benchmarks.end_to_end import REPO, STORES_DIR, EngineProcess, kv_transfer_config, run_rounds
from benchmarks.otlp_sink import OtlpSink

CONFIGURATIONS = ("kvc_off", "kvc_step")
BASELINE = "multi"


def extract(revision: str, into: Path) -> Path:
    """A directory that runs this checkout's benchmarks (and test helpers) over ``revision``'s kvcompose."""
    archive = subprocess.run(["git", "archive", revision, "kvcompose"], cwd=REPO, check=True, capture_output=True)
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive.stdout, check=True)
    for shared in ("benchmarks", "tests"):
        (into / shared).symlink_to(REPO / shared)
    return into


def figures(measured: dict[str, float]) -> dict[str, float]:
    """One engine's round: the frameworks' own time per first token and per output token (children's calls left
    out; the outbox thread and exporter process counted), time to first token, tokens/s."""
    return {
        "framework_us_per_first_token": measured["connector_us_per_first_token"]
        - measured["children_us_per_first_token"],
        "framework_us_per_token": sum(measured[key] for key in end_to_end.CONNECTOR_COST)
        - measured[end_to_end.CHILDREN_COST],
        "ttft_ms": measured["ttft_ms"], "tokens_per_s": measured["tokens_per_s"],
    }


def summarize(rounds: list[dict[str, dict[str, float]]], revision: str) -> dict[str, Any]:
    """Per configuration: both versions' medians, the per-round differences, and the ratios to MultiConnector."""
    result: dict[str, Any] = {"revision": revision, "rounds": len(rounds), "configurations": {}}
    for name in [name for name in rounds[0] if name != BASELINE and "@" not in name]:
        versions = {"now": name, revision: f"{name}@{revision}"}
        per_round = {version: [figures(measured[engine]) for measured in rounds]
                     for version, engine in versions.items()}
        entry: dict[str, Any] = {}
        for version, engine in versions.items():
            entry[version] = {key: statistics.median(row[key] for row in per_round[version])
                              for key in per_round[version][0]}
            entry[version]["tokens_per_s_from_framework_cost"] = statistics.median(
                end_to_end._from_cost(measured[engine], measured[BASELINE], True) for measured in rounds)
            entry[version]["ttft_from_framework_cost"] = statistics.median(
                end_to_end._ttft_from_cost(measured[engine], measured[BASELINE], True) for measured in rounds)
        entry["difference"] = {key: statistics.median(now[key] - then[key]
                                                      for now, then in zip(per_round["now"], per_round[revision]))
                               for key in per_round["now"][0]}
        result["configurations"][name] = entry
    return result


def measure(revision: str, rounds: int = 24, configurations: tuple[str, ...] = CONFIGURATIONS) -> dict[str, Any]:
    sink = OtlpSink()
    endpoints = {name: sink.endpoint for name in end_to_end.GRANULARITY}
    engines: list[EngineProcess] = []
    with tempfile.TemporaryDirectory(prefix="kvcompose-compare-", dir=STORES_DIR) as workdir:
        work = Path(workdir)
        old_tree = extract(revision, Path(tempfile.mkdtemp(dir=work)))
        try:
            trees = [(BASELINE, REPO)]
            for name in configurations:
                trees += [(name, REPO), (f"{name}@{revision}", old_tree)]
            for name, tree in trees:
                config = kv_transfer_config(name.split("@")[0], work / name, endpoints)
                engines.append(EngineProcess(name, config, work, tree))
            measured, _ = run_rounds(engines, rounds)
        finally:
            for engine in engines:
                engine.kill()
            sink.stop()
    return summarize(measured, revision)


def table(result: dict[str, Any]) -> str:
    revision = result["revision"]
    lines = [f"{result['rounds']} rounds; this checkout against {revision}; medians (difference: of per-round "
             "differences)", "",
             "| configuration | framework us per first token | framework us per output token | TTFT ms | tokens/s | "
             "tokens/s from the frameworks' cost | TTFT from the frameworks' cost |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for name, entry in result["configurations"].items():
        old, now, difference = entry[revision], entry["now"], entry["difference"]
        lines.append(
            f"| {name} | {old['framework_us_per_first_token']:.1f} -> {now['framework_us_per_first_token']:.1f} "
            f"({difference['framework_us_per_first_token']:+.1f}) | {old['framework_us_per_token']:.2f} -> "
            f"{now['framework_us_per_token']:.2f} ({difference['framework_us_per_token']:+.2f}) | "
            f"{old['ttft_ms']:.2f} -> {now['ttft_ms']:.2f} | {old['tokens_per_s']:.0f} -> {now['tokens_per_s']:.0f} | "
            f"{old['tokens_per_s_from_framework_cost']:.3f}x -> {now['tokens_per_s_from_framework_cost']:.3f}x | "
            f"{old['ttft_from_framework_cost']:.3f}x -> {now['ttft_from_framework_cost']:.3f}x |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.compare", description=__doc__.splitlines()[0])
    parser.add_argument("revision", help="the git revision to compare this checkout's kvcompose with")
    parser.add_argument("--rounds", type=int, default=24)
    parser.add_argument("--configurations", default=",".join(CONFIGURATIONS),
                        help=f"comma-separated, of {', '.join(end_to_end.CONFIGURATIONS[3:])}")
    args = parser.parse_args()
    print(table(measure(args.revision, args.rounds, tuple(args.configurations.split(",")))))


if __name__ == "__main__":
    main()
