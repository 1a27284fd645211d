"""``offload export``: a checkpoint's consolidated weights as one safetensors file.

Reads the fp32 master weights from every rank's shard file and assembles each
parameter in turn, so the whole model is never in memory at once; needs
neither the model's code nor the world size that saved it. Every chunk's
checksum is verified before it is used, and the output appears complete or
not at all.
"""

from __future__ import annotations

import argparse
import os
import time

from offload import checkpoint
from offload.cli.args import output_file
from offload.engine import DTYPES


def add_parser(commands: argparse._SubParsersAction) -> None:
    p = commands.add_parser("export", help="write a checkpoint's weights to a safetensors file",
                            description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoint", help="a checkpoint directory, or the save directory holding `latest`")
    p.add_argument("--tag", default=None, help="the checkpoint under CHECKPOINT to export (default: latest)")
    p.add_argument("--out", type=output_file, required=True, help="the safetensors file to write")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32", help="weights' dtype (default float32)")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    start = time.perf_counter()
    manifest = checkpoint.export(args.checkpoint, args.out, DTYPES[args.dtype], args.tag)
    size = os.path.getsize(args.out)
    print(f"wrote {args.out}: {size / 1e6:.1f} MB, {args.dtype}, from {manifest.tag} "
          f"(step {manifest.training.global_steps}, {manifest.world_size} ranks) in {time.perf_counter() - start:.1f} s")
    return 0
