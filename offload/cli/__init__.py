"""The ``offload`` command line (also ``python -m offload``).

Each subcommand lives in its own module and registers itself with ``add_parser``.
User errors (bad arguments, bad values) exit with status 2 and one line naming
the problem; anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import difflib
import os
import select
import signal
import sys
import warnings

from offload.cli import bench_adam, bench_step, bench_swap, clean, estimate, export, plan, train
from offload.errors import OffloadError


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line that points to the help page of
    the (sub)command at fault and, for a misspelt name, to the nearest valid one."""

    commands: argparse._SubParsersAction | None = None

    argv: list[str] = []  # the command line being parsed

    def error(self, message: str):
        # argparse reports a missing required option before options it does not
        # know, so `--parms 7B` would only say --params is missing: name the misspelling too.
        if "required" in message:
            options = [option for action in self._actions for option in action.option_strings]
            unknown = [arg.split("=")[0] for arg in _Parser.argv if arg.startswith("--")]
            unknown = [arg for arg in unknown if not any(o.startswith(arg) for o in options)]  # nor an abbreviation
            nearest = [f"{arg} (did you mean {near}?)" for arg in unknown if (near := _nearest(arg, options))]
            if nearest:
                message += f"; unrecognized: {', '.join(nearest)}"
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")

    def add_subparsers(self, **kwargs):
        self.commands = super().add_subparsers(**kwargs)  # subparsers are _Parsers too: argparse uses type(self)
        return self.commands

    def parse_args(self, args=None, namespace=None):
        # Options no subcommand knows come back up to the top-level parser; the
        # subcommand given them reports them, as only its help lists its options.
        _Parser.argv = list(sys.argv[1:] if args is None else args)
        namespace, extras = self.parse_known_args(args, namespace)
        if extras:
            parser = self._chosen(namespace)
            options = [option for action in parser._actions for option in action.option_strings]
            nearest = [_nearest(extra.split("=")[0], options) for extra in extras if extra.startswith("-")]
            hint = " and ".join(name for name in nearest if name)
            parser.error(f"unrecognized arguments: {' '.join(extras)}" + (f"; did you mean {hint}?" if hint else ""))
        return namespace

    def _check_value(self, action, value):
        # argparse checks every choice here, subcommands included (Python 3.14's suggest_on_error does the same).
        if action.choices is not None and value not in action.choices:
            nearest = _nearest(str(value), [str(choice) for choice in action.choices])
            if nearest:
                raise argparse.ArgumentError(action, f"invalid choice: {value!r}; did you mean {nearest!r}?")
        super()._check_value(action, value)

    def _chosen(self, namespace: argparse.Namespace) -> argparse.ArgumentParser:
        """The innermost subcommand's parser (``offload bench step``'s for that command line)."""
        if self.commands is None:
            return self
        chosen = self.commands.choices.get(getattr(namespace, self.commands.dest, None))
        return self if chosen is None else chosen._chosen(namespace)


def _nearest(name: str, names: list[str]) -> str | None:
    return next(iter(difflib.get_close_matches(name, names, n=1)), None)


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
    clean.add_parser(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        with warnings.catch_warnings():  # restores the usual format when main returns (in tests, say)
            warnings.formatwarning = _without_location
            return args.run(args) or 0
    except OffloadError as exc:  # anything else is a bug: its traceback is what a report needs
        # Under torchrun each rank may fail on its own (a path only another rank sees): say whose it is.
        rank = f" (rank {os.environ.get('RANK', '?')})" if os.environ.get("WORLD_SIZE", "1") not in ("", "1") else ""
        print(f"offload {args.command}{rank}: error: {exc}", file=sys.stderr)
        return exc.exit_status
    except BrokenPipeError:
        if not _reader_gone(sys.stdout):
            raise  # another pipe broke (a socket, a child's): a bug to report
        # The reader of our output left (`| head`): stop as the shell's own tools do.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # so the exit's flush does not fail again
        return 128 + signal.SIGPIPE


def _without_location(message, category, filename, lineno, line=None) -> str:
    """A warning as one line: under the command line, the place Python would
    name is offload's own code, or runpy's, which tells a user nothing."""
    return f"{category.__name__}: {message}\n"


def _reader_gone(stream) -> bool:
    """``stream`` is the write end of a pipe whose reading end is closed (poll's POLLERR)."""
    try:
        poller = select.poll()
        poller.register(stream.fileno(), select.POLLOUT)
        return any(events & select.POLLERR for _, events in poller.poll(0))
    except (OSError, ValueError, AttributeError):  # no file descriptor, or no poll on this platform
        return False
