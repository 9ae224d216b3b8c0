"""The `loadgen` command: subcommands registered from their own modules.

A subcommand module exposes `register(subparsers)`, which adds its parser and sets
`handler=func(args) -> int`.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

from loadgen import compare, run_cli
from loadgen.errors import LoadgenError
from loadgen.simulator import cli as simulate_cli

SUBCOMMANDS: list[Callable[[argparse._SubParsersAction], None]] = [
    run_cli.register,
    compare.register,
    simulate_cli.register,
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="loadgen",
        description="Replay request traces against an OpenAI-compatible endpoint and measure it "
        "the way `vllm bench serve` does.",
    )
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for register in SUBCOMMANDS:
        register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.handler(args)
    except LoadgenError as exc:
        print(f"loadgen: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("loadgen: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
