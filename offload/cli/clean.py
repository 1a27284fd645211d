"""``offload clean``: remove the run directories that processes now gone left in
an ``nvme_path`` (SIGKILL, an out-of-memory kill, a power cut), never one whose
owner is alive or ran on another host (Note [run directory ownership] in
offload/store/run_dirs.py)."""

from __future__ import annotations

import argparse
import os
import sys

from offload.cli.args import existing_directory
from offload.store import run_dirs


def add_parser(commands: argparse._SubParsersAction) -> None:
    p = commands.add_parser("clean", help="remove swap directories left by processes that are gone",
                            description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nvme-path", required=True, type=existing_directory, help="the directory the runs swapped to")
    p.add_argument("--dry-run", action="store_true", help="list what would go, remove nothing")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    if args.dry_run:
        (found, kept), left = run_dirs.survey(args.nvme_path), []
    else:
        found, left, kept = run_dirs.remove_stale(args.nvme_path)
    verb = "would remove" if args.dry_run else "removed"
    for s in found:
        print(f"{verb} {s.path} ({s.nbytes / 2**20:,.1f} MiB; {s.why})")
    for s in kept:
        print(f"kept {s.path} ({s.nbytes / 2**20:,.1f} MiB; {s.why})")
    for s, error in left:
        print(f"could not remove {s.path} ({s.why}): {error}", file=sys.stderr)
    total = sum(s.nbytes for s in found)
    print(f"offload clean: {verb} {len(found)} run director{'y' if len(found) == 1 else 'ies'} "
          f"({total / 2**20:,.1f} MiB) in {os.path.abspath(args.nvme_path)}"
          + (f"; {len(left)} could not be removed" if left else "")
          + (f"; kept {len(kept)} whose owner may be alive" if kept else ""))
    return 1 if left else 0
