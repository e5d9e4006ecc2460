"""What every kvcompose command shares: misuse and bad input exit with status 2 and one line per problem.

The ``kvcompose`` command line (:mod:`kvcompose.cli`) and the modules that add
commands to it (:mod:`kvcompose.deploy`, :mod:`kvcompose.serve`, ...) import
this module, never each other's parsers.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any, NoReturn, Protocol

EXIT_USAGE = 2  # bad input or misuse: nothing was started or written
EXIT_FAILURE = 1  # the input was fine but the environment was not (a server down, a package missing)


class Commands(Protocol):
    """Where a module adds its subcommands: what ``ArgumentParser.add_subparsers()`` returns."""

    def add_parser(self, name: str, **kwargs: Any) -> argparse.ArgumentParser: ...


class CommandParser(argparse.ArgumentParser):
    """An ArgumentParser whose misuse message is one line and whose exit status is :data:`EXIT_USAGE`."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see --help)\n")


def refuse(message: str, status: int = EXIT_USAGE) -> NoReturn:
    """End the command with ``message`` on stderr (one line per problem, never a traceback)."""
    print(message, file=sys.stderr)
    raise SystemExit(status)
