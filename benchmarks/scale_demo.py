"""Train a GPT far larger than this machine's memory: weights, gradients and
optimizer state on NVMe (ZeRO-Infinity), built under offload.init.

    python benchmarks/scale_demo.py --nvme-path /work/scratch --layers 41 --width 2560 --steps 3

Reports the parameter count, the training state's size at 16 bytes per
parameter against this machine's RAM, seconds per step, the bytes each step
reads and writes against the disk bandwidth measured in the same run, and the
peak resident set size (the kernel's own high-water mark, ru_maxrss).
"""

from __future__ import annotations

import argparse
import json
import resource
import time

import psutil
import torch

import offload
from offload.cli import bench_swap
from offload.estimate import ModelShape, Setup, estimate
from offload.models.gpt import GPT, GPTConfig
from offload.store import AioSettings


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nvme-path", required=True)
    parser.add_argument("--layers", type=int, default=41)
    parser.add_argument("--width", type=int, default=2560)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--sub-group-size", type=int, default=20_000_000)
    parser.add_argument("--lr", type=float, default=1e-4, help="AdamW learning rate (1e-3 overshoots at this size)")
    args = parser.parse_args()

    c = GPTConfig(n_layer=args.layers, n_head=args.width // 128, n_embd=args.width, block_size=args.seq_len)
    params = c.params()
    ram = psutil.virtual_memory().total
    print(f"GPT: {params / 1e9:.2f}B parameters; training state at 16 B/param: {16 * params / 2**30:.1f} GiB "
          f"({16 * params / ram:.1f}x this machine's {ram / 2**30:.1f} GiB of RAM)", flush=True)
    aio = {"block_size": 8 << 20, "queue_depth": 32, "thread_count": 1}
    cfg = {"optimizer": {"type": "AdamW", "params": {"lr": args.lr}},
           "zero_optimization": {
        "stage": 3, "sub_group_size": args.sub_group_size, "stage3_param_persistence_threshold": 100_000,
        "offload_param": {"device": "nvme", "nvme_path": args.nvme_path, "buffer_count": 4, "max_in_cpu": 0},
        "offload_optimizer": {"device": "nvme", "nvme_path": args.nvme_path, "buffer_count": 4,
                              "gradients_on_nvme": True}},
        "bf16": {"enabled": True},
        "aio": aio}
    start = time.perf_counter()
    torch.manual_seed(0)
    with offload.init(cfg):
        model = GPT(c)
    engine = offload.initialize(model, cfg, init_fn=model.init_module)
    build_s = time.perf_counter() - start
    print(f"built and partitioned in {build_s:.0f} s; peak RSS so far {_peak_rss() / 2**30:.2f} GiB", flush=True)

    expected = estimate(ModelShape.from_gpt(c), Setup(3, "nvme", "nvme"), offload.Config.load(cfg), 1)
    print(f"offload estimate for this setup: {expected.disk_read_per_step / 1e9:.1f} GB read and "
          f"{expected.disk_written_per_step / 1e9:.1f} GB written per step", flush=True)
    tokens = torch.randint(0, c.vocab_size, (args.batch_size, c.block_size + 1))
    steps = []
    for step in range(args.steps):
        before = engine.disk_traffic()
        t0 = time.perf_counter()
        loss = engine(tokens)
        engine.backward(loss)
        engine.step()
        engine.synchronize()
        seconds = time.perf_counter() - t0
        after = engine.disk_traffic()
        read, written = after.bytes_read - before.bytes_read, after.bytes_written - before.bytes_written
        steps.append({"seconds": seconds, "loss": loss.item(), "bytes_read": read, "bytes_written": written})
        print(f"step {step + 1}: loss {loss.item():.4f}, {seconds:.0f} s, read {read / 1e9:.1f} GB, "
              f"written {written / 1e9:.1f} GB, peak RSS {_peak_rss() / 2**30:.2f} GiB", flush=True)
    report = engine.memory_report()
    engine.close(restore_model=False)  # a model twice the RAM is not gathered back

    disk = bench_swap.measure(args.nvme_path, 1 << 30, AioSettings(**aio))
    result = {"params": params, "state_gib": 16 * params / 2**30, "ram_gib": ram / 2**30,
              "build_seconds": build_s, "steps": steps,
              "estimated_bytes_read": expected.disk_read_per_step, "estimated_bytes_written": expected.disk_written_per_step, "disk_read_gbps": disk["read_gbps"],
              "disk_write_gbps": disk["write_gbps"], "peak_rss_gib": _peak_rss() / 2**30}
    for s in steps:
        s["disk_seconds"] = s["bytes_read"] / (disk["read_gbps"] * 1e9) + s["bytes_written"] / (disk["write_gbps"] * 1e9)
    print(report)
    print(json.dumps(result, indent=2))


def _peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


if __name__ == "__main__":
    main()
