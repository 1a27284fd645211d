"""``offload export``: a checkpoint's consolidated weights as one safetensors
file (``--out``), or as a model directory ``transformers``' ``from_pretrained``
reads (``--hf``: sharded safetensors with their index, and the model's config
files when the checkpoint kept them).

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
from offload.cli.args import byte_size, output_directory, output_file
from offload.engine import DTYPES
from offload.errors import UsageError
from offload.pretrained import DEFAULT_SHARD_BYTES, INDEX, WEIGHTS


def add_parser(commands: argparse._SubParsersAction) -> None:
    p = commands.add_parser("export", help="write a checkpoint's weights to a safetensors file",
                            description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoint", help="a checkpoint directory, or the save directory holding `latest`")
    p.add_argument("--tag", default=None, help="the checkpoint under CHECKPOINT to export (default: latest)")
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--out", type=output_file, help="the safetensors file to write")
    where.add_argument("--hf", metavar="DIR", type=output_directory,
                       help="the model directory to write, for from_pretrained")
    p.add_argument("--max-shard-size", type=byte_size, default=DEFAULT_SHARD_BYTES,
                   help="with --hf: the largest shard, e.g. 5GB (default 5GB, as transformers)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                   help="weights' dtype (default: float32 with --out, the run's compute dtype with --hf, as "
                        "engine.save_pretrained writes)")
    p.add_argument("--model-names", action="store_true",
                   help="with --hf: the model's own state-dict keys, not the older layout transformers' "
                        "save_pretrained writes (one tensor per MoE expert, as on the Hub)")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    start = time.perf_counter()
    if args.out and args.model_names:
        raise UsageError("--model-names is for --hf: a file written with --out always holds the model's own keys")
    if args.hf:
        earlier = [name for name in (WEIGHTS, INDEX) if os.path.isfile(os.path.join(args.hf, name))]
        manifest, files = checkpoint.export_pretrained(args.checkpoint, args.hf, args.dtype and DTYPES[args.dtype],
                                                       args.tag, args.max_shard_size, not args.model_names)
        size = sum(os.path.getsize(os.path.join(args.hf, f)) for f in files)
        wrote = f"{args.hf}: {', '.join(files)}{' (in place of the model that was there)' if earlier else ''};"
    else:
        earlier = os.path.isfile(args.out)
        manifest = checkpoint.export(args.checkpoint, args.out, DTYPES[args.dtype or "float32"], args.tag)
        size = os.path.getsize(args.out)
        wrote = f"{args.out}{' (in place of the file that was there)' if earlier else ''}:"
    ranks = f"{manifest.world_size} rank{'s' * (manifest.world_size != 1)}"
    dtype = args.dtype or ("float32" if args.out else manifest.compute_dtype)
    print(f"wrote {wrote} {size / 1e6:.1f} MB, {dtype}, from {manifest.tag} "
          f"(step {manifest.training.global_steps}, {ranks}) in {time.perf_counter() - start:.1f} s")
    return 0
