"""``offload bench step``: where a training step's time goes, on a GPT-style model.

Trains the bundled GPT of the chosen size with ZeRO stage 2 (or 3, with a
weight tier) and the chosen optimizer tier, and reports the median step's breakdown: forward, backward,
gradient copy (reduce-scatter into the owned gradient), optimizer (CPU
Adam), swap wait (waiting for NVMe reads and write-backs), upload (publishing
the new weights). Two efficiencies:
  overlap   = sum of the parts / step wall time (1.0: strictly one after the
              other; above 1: parts ran concurrently, as with --dpu)
  pipeline  = (nvme only) the time the disk needs for the optimizer's own
              reads and writes of one step, at the bandwidth measured in the
              same run with the same aio settings, over the time that I/O
              took: from the optimizer's first read to its last write-back's
              completion (measured in extra steps that start no read during
              backward and wait for the last write-back). It cannot exceed 1
              but by measurement noise; 1.0 means the disk never idled while
              the step's I/O was due.
With --dpu the plain and delayed-update engines run one after the other and
the share of the plain optimizer time the delay hides is reported, unclamped:
below 0, waiting for the delayed step cost more than the plain step did.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

import torch

import offload
from offload import _native
from offload.cli import bench_swap
from offload.cli.args import model_name, positive_int
from offload.cli.progress import Progress
from offload.errors import UsageError
from offload.models.gpt import GPT, SIZES
from offload.store import AioSettings

PARTS = ("forward", "backward", "gradient_copy", "optimizer", "swap_wait", "upload")


def add_parser(benchmarks: argparse._SubParsersAction) -> None:
    p = benchmarks.add_parser("step", help="training step time breakdown and offload efficiencies",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=model_name, choices=sorted(SIZES), default="25M",
                   help="bundled GPT size, in any case (default 25M)")
    p.add_argument("--offload", choices=("none", "cpu", "nvme"), default="nvme", help="optimizer state tier (default nvme)")
    p.add_argument("--stage", type=int, choices=(2, 3), default=2, help="ZeRO stage (default 2)")
    p.add_argument("--offload-param", choices=("none", "cpu", "nvme"), default="none",
                   help="stage 3: weight partition tier (default none)")
    p.add_argument("--nvme-path", default=None, help="directory for swap files (default: a temporary directory)")
    p.add_argument("--dpu", action="store_true", help="also run with the one-step delayed update and compare")
    p.add_argument("--steps", type=positive_int, default=5, help="measured steps after 2 warm-up steps (default 5)")
    p.add_argument("--batch-size", type=positive_int, default=4)
    p.add_argument("--sub-group-size", type=positive_int, default=2_000_000, help="elements per optimizer sub-group")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    if not _native.status().available:
        raise UsageError(f"the native library is unavailable: {_native.status().reason}")
    if args.dpu and args.offload == "none":
        raise UsageError("--dpu needs --offload cpu or nvme: the delayed update overlaps the CPU step")
    if args.offload_param != "none" and args.stage != 3:
        raise UsageError("--offload-param needs --stage 3 (only stage 3 partitions the weights)")
    with tempfile.TemporaryDirectory(prefix="offload-bench-step-", dir=args.nvme_path) as nvme:
        result = {"model": args.model, "params": SIZES[args.model].params(), "offload": args.offload,
                  "stage": args.stage, "offload_param": args.offload_param}
        result["plain"] = measure(args, nvme, delayed=False)
        if args.offload == "nvme":
            state = 12 * SIZES[args.model].params()
            disk = bench_swap.measure(nvme, min(state, 1 << 30), _aio())
            result["disk_read_gbps"], result["disk_write_gbps"] = disk["read_gbps"], disk["write_gbps"]
            io = result["plain"]["io"]
            result["disk_seconds"] = (io["bytes_read"] / (disk["read_gbps"] * 1e9)
                                      + io["bytes_written"] / (disk["write_gbps"] * 1e9))
            result["pipeline_efficiency"] = result["disk_seconds"] / io["window"]
        if args.dpu:
            result["dpu"] = measure(args, nvme, delayed=True)
            result["dpu_hidden_fraction"] = hidden_fraction(result["plain"], result["dpu"])
            result["dpu_speedup"] = result["plain"]["wall"] / result["dpu"]["wall"]
    print(json.dumps(result, indent=2) if args.json else report(result))
    return 0


def hidden_fraction(plain: dict, delayed: dict) -> float:
    """The share of the plain step's optimizer time (Adam and swap waits) the
    delayed update no longer waits for; unclamped: below 0 it waited longer."""
    spent = plain["breakdown"]["optimizer"] + plain["breakdown"]["swap_wait"]
    return 1 - delayed["dpu_wait"] / spent


def _aio() -> AioSettings:
    return AioSettings(block_size=8 << 20, queue_depth=32, thread_count=1)


def _config(args: argparse.Namespace, nvme: str, delayed: bool) -> dict:
    a = _aio()
    offload_optimizer = {"device": args.offload}
    if args.offload == "nvme":
        offload_optimizer.update(nvme_path=nvme, buffer_count=4)
    if delayed:
        offload_optimizer.update(delayed_update=True, delayed_update_warmup=1)
    zero = {"stage": args.stage, "sub_group_size": args.sub_group_size, "offload_optimizer": offload_optimizer}
    if args.stage == 3:
        zero["offload_param"] = {"device": args.offload_param}
        if args.offload_param == "nvme":
            zero["offload_param"].update(nvme_path=nvme, max_in_cpu=0)
    else:
        zero["reduce_bucket_size"] = 50_000_000
    cfg = {"zero_optimization": zero}
    if "nvme" in (args.offload, args.offload_param):
        cfg["aio"] = {"block_size": a.block_size, "queue_depth": a.queue_depth, "thread_count": a.thread_count}
    return cfg


def measure(args: argparse.Namespace, nvme: str, delayed: bool) -> dict:
    torch.manual_seed(0)
    c = SIZES[args.model]
    model = GPT(c)
    tokens = torch.randint(0, c.vocab_size, (args.batch_size, c.block_size + 1))
    rows, windows = [], []
    window_steps = args.steps if args.offload == "nvme" and not delayed else 0
    bar = Progress(args.steps + 2 + window_steps, f"bench step {args.offload}{' dpu' if delayed else ''}",
                   enabled=not args.json)
    with offload.initialize(model, _config(args, nvme, delayed)) as engine:
        for i in range(args.steps + 2):
            io_before = engine.disk_traffic()
            copy_before = engine.reducer.seconds
            t0 = time.perf_counter()
            loss = engine(tokens)
            t1 = time.perf_counter()
            engine.backward(loss)
            t2 = time.perf_counter()
            engine.step()
            t3 = time.perf_counter()
            copy = engine.reducer.seconds - copy_before
            detail = engine.times.optimizer_detail
            io = engine.disk_traffic()
            row = {
                "forward": t1 - t0,
                "backward": t2 - t1 - copy + engine.times.reduce,  # the reducer runs inside backward
                "gradient_copy": copy,
                "optimizer": detail.get("adam", 0.0),
                "swap_wait": detail.get("swap_wait", 0.0) + detail.get("write_back_wait", 0.0),
                "upload": engine.times.publish + detail.get("handover", 0.0),
                "wall": t3 - t0,
                "optimizer_phase": engine.times.optimizer,
                "dpu_wait": engine.times.dpu_wait,
                "bytes_read": io.bytes_read - io_before.bytes_read,
                "bytes_written": io.bytes_written - io_before.bytes_written,
            }
            if i >= 2:
                rows.append(row)
            bar.advance(f"{row['wall']:.2f}s/step")
        # The optimizer's own I/O, from its first read to its last write-back: in
        # these steps its first reads are not started during backward, so every
        # byte moves inside the window timed here.
        engine.optimizer.prefetch = lambda: None
        for _ in range(window_steps):
            engine.synchronize()
            engine.backward(engine(tokens))
            before = engine.optimizer.traffic()
            start = time.perf_counter()
            engine.step()
            engine.synchronize()  # waits for the last write-backs
            after = engine.optimizer.traffic()
            windows.append({"window": time.perf_counter() - start, "bytes_read": after.bytes_read - before.bytes_read,
                            "bytes_written": after.bytes_written - before.bytes_written})
            bar.advance(f"{windows[-1]['window']:.2f}s I/O window")
    med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    breakdown = {k: med[k] for k in PARTS}
    result = {"breakdown": breakdown, "wall": med["wall"], "overlap": sum(breakdown.values()) / med["wall"],
              "optimizer_phase": med["optimizer_phase"], "dpu_wait": med["dpu_wait"],
              "bytes_read": med["bytes_read"], "bytes_written": med["bytes_written"]}
    if windows:
        result["io"] = {k: statistics.median(w[k] for w in windows) for k in windows[0]}
    return result


def report(r: dict) -> str:
    weights = f", weights on {r['offload_param']}" if r["stage"] == 3 else ""
    lines = [f"offload bench step: GPT {r['model']} ({r['params'] / 1e6:.1f}M parameters), ZeRO stage {r['stage']}, "
             f"optimizer on {r['offload']}{weights}", ""]
    modes = [("plain", r["plain"])] + ([("dpu", r["dpu"])] if "dpu" in r else [])
    lines.append(f"{'seconds per step':18}" + "".join(f"{m:>10}" for m, _ in modes))
    for part in PARTS:
        lines.append(f"{part:18}" + "".join(f"{d['breakdown'][part]:>10.3f}" for _, d in modes))
    lines.append(f"{'wall':18}" + "".join(f"{d['wall']:>10.3f}" for _, d in modes))
    lines.append(f"{'overlap':18}" + "".join(f"{d['overlap']:>10.2f}" for _, d in modes))
    if "pipeline_efficiency" in r:
        p, io = r["plain"], r["plain"]["io"]
        lines += ["", f"nvme: {p['bytes_read'] / 1e9:.2f} GB read + {p['bytes_written'] / 1e9:.2f} GB written per step; "
                  f"disk measured now: read {r['disk_read_gbps']:.2f} GB/s, write {r['disk_write_gbps']:.2f} GB/s",
                  f"pipeline efficiency: {r['pipeline_efficiency']:.2f}: the optimizer's {io['bytes_read'] / 1e9:.2f} GB "
                  f"read and {io['bytes_written'] / 1e9:.2f} GB written need {r['disk_seconds']:.3f} s of disk, and took "
                  f"{io['window']:.3f} s from the first read to the last write-back"]
    if "dpu" in r:
        lines += ["", f"delayed update: hides {r['dpu_hidden_fraction']:.0%} of the optimizer time; "
                  f"step {r['dpu_speedup']:.2f}x the plain one (compute and CPU Adam share this machine's cores)"]
    return "\n".join(lines)
