"""``make bench``: every benchmark, side by side in one run; a JSON result and markdown tables.

Writes ``benchmarks/results/latest.json`` and ``latest.md`` and prints the
markdown. ``--parts`` runs a subset (e.g. ``--parts hot_path,stats_merge``
skips the engines).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import subprocess
import time
from pathlib import Path
from typing import Any

from benchmarks.batch_scaling import ROUNDS as BATCH_SCALING_ROUNDS

RESULTS = Path(__file__).resolve().parent / "results"
E2E_ROUNDS = 32
PARTS = ("hot_path", "request_cost", "request_rate", "transfer_cost", "watchdog", "stats_merge", "economics",
         "end_to_end", "batch_scaling")


def machine() -> dict[str, Any]:
    """What the figures were measured on."""
    import vllm

    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    model = next((line.split(":", 1)[1].strip() for line in lscpu.splitlines() if line.startswith("Model name")), "?")
    commit = subprocess.run(["git", "describe", "--always", "--dirty"], capture_output=True, text=True,
                            cwd=RESULTS.parent).stdout.strip()
    return {"cpu": model, "cores": os.cpu_count(), "python": platform.python_version(), "vllm": vllm.__version__,
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "commit": commit}


def run(parts: tuple[str, ...], rounds: int | None) -> tuple[dict[str, Any], str]:
    """``rounds``: of the engine parts (end_to_end, batch_scaling); None: each part's default."""
    from benchmarks import (
        batch_scaling,
        economics,
        end_to_end,
        hot_path,
        request_cost,
        request_rate,
        stats_merge,
        targets,
        transfer_cost,
        watchdog,
    )

    result: dict[str, Any] = {"machine": machine()}
    sections, checks = [], []
    if "hot_path" in parts:
        result["hot_path"] = rows = hot_path.measure()
        sections.append("### A worker step's and a request's calls (us; in brackets, the extra over MultiConnector)"
                        "\n\n" + hot_path.table(rows))
        checks += targets.hot_path_checks(rows)
    if "request_cost" in parts:
        result["request_cost"] = costs = request_cost.measure()
        sections.append("### Engine-process CPU per request, every request traced (OTLP export)\n\n"
                        + request_cost.table(costs))
        checks += targets.request_cost_checks(costs)
    if "request_rate" in parts:
        result["request_rate"] = rates = request_rate.measure()
        sections.append(f"### Engine-process CPU at request rates, every request traced (OTLP export), "
                        f"{request_rate.CHILDREN} children\n\n" + request_rate.table(rates))
        checks += targets.request_rate_checks(rates)
    if "transfer_cost" in parts:
        result["transfer_cost"] = tracked = transfer_cost.measure()
        sections.append("### Tracking a transfer (2 children)\n\n" + transfer_cost.table(tracked))
        checks += targets.transfer_cost_checks(tracked)
    if "watchdog" in parts:
        result["watchdog"] = looks = watchdog.measure()
        sections.append("### The watchdog (2 children)\n\n" + watchdog.table(looks))
        checks += targets.watchdog_checks(looks)
    if "stats_merge" in parts:
        result["stats_merge"] = merged = stats_merge.measure()
        sections.append("### Stats\n\n" + stats_merge.table(merged))
        checks += targets.stats_checks(merged)
    if "economics" in parts:
        result["economics"] = sampled = economics.measure()
        sections.append("### Tier economics: the SHARDS sampler against vLLM's hashing of the same requests\n\n"
                        + economics.table(sampled))
        checks += targets.economics_checks(sampled)
    if "end_to_end" in parts:
        result["end_to_end"] = e2e = end_to_end.measure(rounds=rounds or E2E_ROUNDS)
        sections.append(f"### End to end (CPU engine, tiny model, median of {e2e['rounds']} rounds)\n\n"
                        + end_to_end.table(e2e))
        checks += targets.end_to_end_checks(e2e)
    if "batch_scaling" in parts:
        result["batch_scaling"] = scaled = batch_scaling.measure(rounds=rounds or BATCH_SCALING_ROUNDS)
        sections.append(f"### Batch scaling (CPU engine, tiny model, OffloadingConnector and a no-op child, "
                        f"median of {scaled['rounds']} rounds)\n\n" + batch_scaling.table(scaled))
        checks += targets.batch_scaling_checks(scaled)
    result["targets"] = targets.as_records(checks)
    described = result["machine"]
    header = (f"Measured {described['date']} on {described['cpu']} ({described['cores']} cores), "
              f"vLLM {described['vllm']}, Python {described['python']}, kvcompose {described['commit']}.")
    markdown = "\n\n".join([header, "### Targets\n\n" + targets.table(checks), *sections]) + "\n"
    return result, markdown


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.splitlines()[0])
    parser.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of {', '.join(PARTS)}")
    parser.add_argument("--rounds", type=int, default=None,
                        help=f"rounds of the engine parts (default: end_to_end {E2E_ROUNDS}, batch_scaling "
                        f"{BATCH_SCALING_ROUNDS})")
    args = parser.parse_args()
    parts = tuple(part for part in args.parts.split(",") if part)
    if unknown := set(parts) - set(PARTS):
        parser.error(f"unknown parts {sorted(unknown)}; choose from {', '.join(PARTS)}")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    logging.getLogger("vllm").setLevel(logging.ERROR)  # its start-up notes would bury the tables
    result, markdown = run(parts, args.rounds)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "latest.json").write_text(json.dumps(result, indent=1) + "\n")
    (RESULTS / "latest.md").write_text(markdown)
    print(markdown)


if __name__ == "__main__":
    main()
