"""The ``offload`` command line (also ``python -m offload``).

Each subcommand lives in its own module and registers itself with ``add_parser``.
User errors (bad arguments, bad values) exit with status 2 and one line naming
the problem; anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import sys

from offload.cli import bench_adam, bench_step, bench_swap, estimate, export, plan, train
from offload.errors import OffloadError


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (the usage is one ``--help`` away)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="offload", description="ZeRO-Offload / ZeRO-Infinity training for PyTorch.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    train.add_parser(commands)
    estimate.add_parser(commands)
    plan.add_parser(commands)
    bench = commands.add_parser("bench", help="measure this machine: the CPU Adam, disks")
    benchmarks = bench.add_subparsers(dest="benchmark", required=True, metavar="BENCHMARK")
    bench_adam.add_parser(benchmarks)
    bench_swap.add_parser(benchmarks)
    bench_step.add_parser(benchmarks)
    export.add_parser(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.run(args) or 0
    except OffloadError as exc:  # anything else is a bug: its traceback is what a report needs
        print(f"offload {args.command}: error: {exc}", file=sys.stderr)
        return exc.exit_status
