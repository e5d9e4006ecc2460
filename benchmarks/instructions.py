"""Instructions per request life, counted by valgrind's callgrind: the request benchmarks without the noise.

``python -m benchmarks.instructions`` (optional: needs valgrind, Debian's
``valgrind`` package; not part of ``make bench``). CPU time on these shared
2-core machines moves by 10-30% between runs of the same code, too much to
see a change of a few percent; the number of instructions a request life
executes does not move. It is not time (an instruction that misses the cache
costs more), so use it to compare versions of kvcompose, and the CPU-time
benchmarks for the targets.

The subjects are ``benchmarks/request_life.py``'s (the traced one ships its
spans through the ring to an exporter process, which runs outside valgrind and
is not counted). One process under callgrind builds them all, warms each up,
then runs each subject's lives with counting switched on (``callgrind_control``)
and dumps the count after each, so the start-up (vLLM's import, about 100 s
under valgrind) is paid once and never counted.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.request_life import SUBJECTS, Collector, live, subjects, warm_up

CHILD_COUNTS = (2, 8)
REQUESTS = 300
TOTALS = "totals:"


def _counted(children_counts: tuple[int, ...], requests: int) -> None:
    """The process under callgrind: a line ``ready <label>`` before each subject's lives, ``done``
    after them; each waits for a line on stdin."""
    with Collector() as sink:
        for children in children_counts:
            served = subjects(children, sink.endpoint)
            warm_up(served, f"warm-{children}")
            for name in SUBJECTS:
                print(f"ready {children} {name}", flush=True)
                sys.stdin.readline()
                for index in range(requests):
                    live(served[name], f"{name}-{children}-{index}")
                print("done", flush=True)
                sys.stdin.readline()
            served["kvc_traced"].shutdown()


def _control(pid: int, *flags: str) -> None:
    subprocess.run(["callgrind_control", *flags, str(pid)], check=True, capture_output=True)


def measure(children_counts: tuple[int, ...] = CHILD_COUNTS, requests: int = REQUESTS) -> dict[str, int]:
    """Instructions per request life, by ``"<children> <subject>"``."""
    with tempfile.TemporaryDirectory() as directory:
        out = Path(directory) / "callgrind.out"
        command = ["valgrind", "--tool=callgrind", "--instr-atstart=no", f"--callgrind-out-file={out}",
                   sys.executable, "-m", "benchmarks.instructions", "--counted",
                   "--children", ",".join(map(str, children_counts)), "--requests", str(requests)]
        process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert process.stdin is not None and process.stdout is not None
        labels = []
        for line in process.stdout:
            if line.startswith("ready "):
                labels.append(line.split(" ", 1)[1].strip())
                _control(process.pid, "--instr=on")
            elif line.strip() == "done":
                _control(process.pid, "--instr=off")
                _control(process.pid, "--dump")
            else:
                continue
            process.stdin.write("\n")
            process.stdin.flush()
        process.wait()
        dumps = sorted(Path(directory).glob("callgrind.out.*"), key=lambda path: int(path.suffix[1:]))
        totals = [next(int(line.split()[1]) for line in path.read_text().splitlines() if line.startswith(TOTALS))
                  for path in dumps]
    return {label: round(total / requests) for label, total in zip(labels, totals, strict=True)}


def table(counts: dict[str, int]) -> str:
    lines = ["| children | subject | instructions per request life | over MultiConnector |", "| --- | --- | --- | --- |"]
    for label, count in counts.items():
        children, name = label.split()
        baseline = counts[f"{children} multi"]
        lines.append(f"| {children} | {name} | {count:,} | {count / baseline:.2f}x (+{count - baseline:,}) |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--children", default=",".join(map(str, CHILD_COUNTS)))
    parser.add_argument("--requests", type=int, default=REQUESTS)
    parser.add_argument("--counted", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    children_counts = tuple(int(count) for count in args.children.split(","))
    if args.counted:
        _counted(children_counts, args.requests)
        return
    if shutil.which("valgrind") is None or shutil.which("callgrind_control") is None:
        parser.exit(2, "benchmarks.instructions needs valgrind (Debian: apt-get install valgrind)\n")
    print(table(measure(children_counts, args.requests)))


if __name__ == "__main__":
    main()
