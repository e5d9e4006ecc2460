"""``kvcompose init``: write a commented starter pipeline to edit.

The starters are this package's ``*.yaml`` files, so an installed kvcompose
has them; the repository's ``examples/`` are documentation. Each says how to
check, serve, watch and trace it, and turns tracing on through an
environment variable (``enabled: ${KVCOMPOSE_TRACING:-false}``).
"""

from __future__ import annotations

import argparse
import shlex
import sys
from importlib import resources
from pathlib import Path

from kvcompose.command_line import Commands, refuse

STARTERS = {
    "offload": "a CPU offload tier (vLLM's OffloadingConnector, kvcompose's CPU spec) in front of a disk tier",
    "disk": "two disk tiers, a fast one in front of a large one",
    "pd": "prefill/decode disaggregation: NIXL between the two servers, and a disk tier on each",
}
DEFAULT_STARTER = "offload"
DEFAULT_FILE = Path("pipeline.yaml")
STDOUT = "-"
FILE_PLACEHOLDER = "THIS_FILE"  # in the starters' comments, replaced by the file's path


def starter_text(kind: str) -> str:
    return resources.files(__name__).joinpath(f"{kind}.yaml").read_text(encoding="utf-8")


def add_command(commands: Commands) -> None:
    init = commands.add_parser("init", help="write a commented starter pipeline (default: --offload)")
    kinds = init.add_mutually_exclusive_group()
    for kind, description in STARTERS.items():
        kinds.add_argument(f"--{kind}", dest="starter", action="store_const", const=kind, help=description)
    init.add_argument("path", nargs="?", type=Path, default=DEFAULT_FILE,
                      help=f"the file to write (default: {DEFAULT_FILE}; {STDOUT} prints it)")
    init.add_argument("--force", action="store_true", help="overwrite the file if it exists")
    init.set_defaults(run=_init, starter=DEFAULT_STARTER)


def _init(args: argparse.Namespace) -> None:
    path: Path = args.path
    if str(path) == STDOUT:
        sys.stdout.write(starter_text(args.starter))
        return
    if path.is_dir():
        refuse(f"{path}: is a directory; name the file to write, e.g. {path / DEFAULT_FILE}")
    text = starter_text(args.starter).replace(FILE_PLACEHOLDER, shlex.quote(str(path)))
    try:
        with path.open("w" if args.force else "x", encoding="utf-8") as file:  # "x": never overwrite
            file.write(text)
    except FileExistsError:
        refuse(f"{path}: exists; pass --force to overwrite it")
    except OSError as error:
        refuse(f"{path}: cannot write: {error.strerror}")
    print(f"wrote {path}: {STARTERS[args.starter]}")
    print(f"next: kvcompose validate {shlex.quote(str(path))}")
