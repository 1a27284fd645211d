"""Train a model far larger than this machine's memory: weights, gradients and
optimizer state on NVMe (ZeRO-Infinity), built under offload.init.

    python benchmarks/scale_demo.py --nvme-path /work/scratch --arch llama --layers 24 --state-dtype bfloat16 --steps 10
    python benchmarks/scale_demo.py --nvme-path /work/scratch --arch gpt --layers 41 --width 2560 --steps 3

On a CPU without bf16 instructions, ``--emulate-bf16-matmul`` runs bf16
compute's linear layers and attention in fp32 from bf16 operands
(``bf16_emulation.py``): the weights, gradients and master on disk stay bf16.

``--arch llama`` is Llama-2-7B's shape (32 layers, width 4096, SwiGLU 11008,
vocabulary 32000) unless ``--layers``/``--width`` say otherwise; ``gpt`` is
the bundled GPT. Batches are windows of the bundled text, a new one every
step; the first ``--warmup`` steps are not counted.

Before building, the disk this setup needs (``offload estimate``) is checked
against the free space, and the run stops there, saying how much is needed,
if it does not fit. Reports the parameter count, seconds per step against the
disk-bound limit (each step's bytes at the disk's speed, measured in the same
run), the bytes read and written per step, predicted and measured, the disk
used, the peak resident set size (the kernel's own high-water mark,
ru_maxrss) and the losses.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import sys
import time

import psutil
import torch
import bf16_emulation

import offload
from offload.cli import bench_swap
from offload.data import ByteBatches, stdlib_corpus
from offload.estimate import ModelShape, Setup, estimate
from offload.models.gpt import GPT, GPTConfig
from offload.models.llama import Llama, LlamaConfig
from offload.optim.state_format import MASTER_DTYPES, STATE_DTYPES
from offload.store import AioSettings

DISK_HEADROOM = 0.97  # of the free space: swap files round up to whole pages, and the filesystem needs some


def model_config(args: argparse.Namespace) -> GPTConfig | LlamaConfig:
    if args.arch == "llama":
        base = LlamaConfig()
        width = args.width or base.n_embd
        intermediate = base.intermediate if width == base.n_embd else 256 * round(8 * width / 3 / 256)
        return LlamaConfig(n_layer=args.layers or base.n_layer, n_head=width // 128, n_embd=width,
                           intermediate=intermediate, block_size=args.seq_len)
    width = args.width or 2560
    return GPTConfig(n_layer=args.layers or 41, n_head=width // 128, n_embd=width, block_size=args.seq_len)


def engine_config(args: argparse.Namespace, c: GPTConfig | LlamaConfig) -> dict:
    return {
        "optimizer": {"type": "AdamW", "params": {"lr": args.lr}},
        "gradient_clipping": 1.0,
        "zero_optimization": {
            "stage": 3, "sub_group_size": args.sub_group_size, "stage3_param_persistence_threshold": 100_000,
            "offload_param": {"device": "nvme", "nvme_path": args.nvme_path, "buffer_count": 4, "max_in_cpu": 0,
                              "buffer_size": max(c.param_sizes())},
            "offload_optimizer": {"device": "nvme", "nvme_path": args.nvme_path, "buffer_count": 4,
                                  "gradients_on_nvme": True, "state_dtype": args.state_dtype,
                                  "master_dtype": args.master_dtype}},
        "bf16": {"enabled": args.compute == "bfloat16"},
        "aio": {"block_size": 8 << 20, "queue_depth": 32, "thread_count": 1},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nvme-path", required=True)
    parser.add_argument("--arch", choices=("llama", "gpt"), default="llama")
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--width", type=int, default=None)
    parser.add_argument("--state-dtype", choices=sorted(STATE_DTYPES), default="float32")
    parser.add_argument("--master-dtype", choices=sorted(MASTER_DTYPES), default="float32")
    parser.add_argument("--compute", choices=("float32", "bfloat16"), default="bfloat16",
                        help="compute dtype, also the weights' on disk (CPUs without bf16 instructions multiply "
                             "bf16 matrices about 80 times slower than fp32: use float32 or --emulate-bf16-matmul)")
    bf16_emulation.add_argument(parser)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--steps", type=int, default=10, help="steps measured, after the warm-up")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--sub-group-size", type=int, default=20_000_000)
    parser.add_argument("--lr", type=float, default=1e-4, help="AdamW learning rate (1e-3 overshoots at this size)")
    args = parser.parse_args()

    c = model_config(args)
    cfg = engine_config(args, c)
    params = c.params()
    ram = psutil.virtual_memory().total
    print(f"{args.arch} ({c.n_layer} layers, width {c.n_embd}): {params / 1e9:.2f}B parameters; training state at "
          f"16 B/param: {16 * params / 2**30:.1f} GiB ({16 * params / ram:.1f}x this machine's "
          f"{ram / 2**30:.1f} GiB of RAM); {args.compute} compute{' (matmuls emulated)' * args.emulate_bf16_matmul}, "
          f"{args.master_dtype} master, "
          f"{args.state_dtype} moments", flush=True)
    expected = estimate(ModelShape.from_config(c), Setup(3, "nvme", "nvme"), offload.Config.load(cfg), 1)
    os.makedirs(args.nvme_path, exist_ok=True)  # the engine would make it; the free space is read before
    free = shutil.disk_usage(args.nvme_path).free
    print(f"offload estimate: {expected.node['nvme'] / 1e9:.1f} GB on disk ({free / 1e9:.1f} GB free), "
          f"{expected.node['host'] / 1e9:.2f} GB host, {expected.disk_read_per_step / 1e9:.1f} GB read and "
          f"{expected.disk_written_per_step / 1e9:.1f} GB written per step", flush=True)
    if expected.node["nvme"] > DISK_HEADROOM * free:
        sys.exit(f"scale_demo: this setup needs {expected.node['nvme'] / 1e9:.1f} GB on {args.nvme_path}, which has "
                 f"{free / 1e9:.1f} GB free; use fewer --layers or a more compact --state-dtype")

    start = time.perf_counter()
    torch.manual_seed(0)
    arch = Llama if args.arch == "llama" else GPT
    with offload.init(cfg):
        model = arch(c)
    engine = offload.initialize(model, cfg, init_fn=model.init_module)
    build_s = time.perf_counter() - start
    print(f"built and partitioned in {build_s:.0f} s; peak RSS so far {_peak_rss() / 2**30:.2f} GiB", flush=True)

    data = ByteBatches(stdlib_corpus(), args.seq_len, args.batch_size, seed=0)
    steps, disk_used = [], 0
    emulation = bf16_emulation.bf16_matmuls(args.emulate_bf16_matmul)
    for step in range(args.warmup + args.steps):
        before = engine.disk_traffic()
        t0 = time.perf_counter()
        with emulation:
            loss = engine(data.batch(step, 0, 0))
        engine.backward(loss)
        engine.step()
        engine.synchronize()
        seconds = time.perf_counter() - t0
        after = engine.disk_traffic()
        disk_used = max(disk_used, _bytes_under(args.nvme_path))
        read, written = after.bytes_read - before.bytes_read, after.bytes_written - before.bytes_written
        warm = step >= args.warmup
        if warm:
            steps.append({"seconds": seconds, "loss": loss.item(), "bytes_read": read, "bytes_written": written})
        print(f"{'step' if warm else 'warm-up step'} {step + 1}: loss {loss.item():.4f}, {seconds:.0f} s, "
              f"read {read / 1e9:.1f} GB, written {written / 1e9:.1f} GB, peak RSS {_peak_rss() / 2**30:.2f} GiB",
              flush=True)
    report = engine.memory_report()
    engine.close(restore_model=False)  # a model larger than the RAM is not gathered back

    disk = bench_swap.measure(args.nvme_path, 1 << 30, AioSettings(**cfg["aio"]))
    for s in steps:
        s["disk_seconds"] = s["bytes_read"] / (disk["read_gbps"] * 1e9) + s["bytes_written"] / (disk["write_gbps"] * 1e9)
    median = {key: statistics.median(s[key] for s in steps) for key in ("seconds", "disk_seconds", "bytes_read",
                                                                         "bytes_written")}
    result = {"arch": args.arch, "config": vars(c), "params": params, "compute": args.compute,
              "emulated_bf16_matmul": args.emulate_bf16_matmul,
              "state_dtype": args.state_dtype, "master_dtype": args.master_dtype,
              "state_gib": 16 * params / 2**30, "ram_gib": ram / 2**30, "build_seconds": build_s,
              "estimated_bytes_read": expected.disk_read_per_step,
              "estimated_bytes_written": expected.disk_written_per_step, "estimated_disk_bytes": expected.node["nvme"],
              "disk_used_bytes": disk_used, "disk_read_gbps": disk["read_gbps"], "disk_write_gbps": disk["write_gbps"],
              "peak_rss_gib": _peak_rss() / 2**30, "median": median, "steps": steps}
    print(report)
    print(f"\nmedian step {median['seconds']:.1f} s against {median['disk_seconds']:.1f} s of disk time for its "
          f"{median['bytes_read'] / 1e9:.1f} GB read and {median['bytes_written'] / 1e9:.1f} GB written "
          f"({median['disk_seconds'] / median['seconds']:.0%} of the disk-bound limit); estimate "
          f"{expected.disk_read_per_step / 1e9:.1f} / {expected.disk_written_per_step / 1e9:.1f} GB; disk used "
          f"{disk_used / 1e9:.1f} GB (estimate {expected.node['nvme'] / 1e9:.1f}); peak RSS "
          f"{result['peak_rss_gib']:.2f} GiB; loss {steps[0]['loss']:.3f} -> {steps[-1]['loss']:.3f}")
    print(json.dumps(result, indent=2))


def _bytes_under(path: str) -> int:
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            try:
                total += os.stat(os.path.join(root, name)).st_blocks * 512  # allocated, not apparent, size
            except FileNotFoundError:
                pass  # removed between listing and stat
    return total


def _peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


if __name__ == "__main__":
    main()
