"""``offload bench step``: where a training step's time goes, on a GPT-style model.

Trains the bundled GPT of the chosen size with ZeRO stage 2 (or 3, with a
weight tier) and the chosen optimizer tier, and reports the median step's breakdown: forward, backward,
gradient copy (reduce-scatter into the host fp32 gradient), optimizer (CPU
Adam), swap wait (waiting for NVMe reads and write-backs), upload (publishing
the new weights). Two efficiencies:
  overlap   = sum of the parts / step wall time (1.0: strictly one after the
              other; above 1: parts ran concurrently, as with --dpu)
  pipeline  = max(CPU Adam time, optimizer bytes moved / disk bandwidth) /
              optimizer-phase wall time (nvme only; the disk bandwidth is
              measured in the same run with the same aio settings). 1.0 means
              the phase costs no more than the slower of disk and Adam forces.
With --dpu the plain and delayed-update engines run one after the other and
the share of optimizer time the delay hides is reported.
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
            result["pipeline_efficiency"] = _pipeline_efficiency(result["plain"], disk)
        if args.dpu:
            result["dpu"] = measure(args, nvme, delayed=True)
            plain_opt = result["plain"]["breakdown"]["optimizer"] + result["plain"]["breakdown"]["swap_wait"]
            result["dpu_hidden_fraction"] = max(0.0, 1 - result["dpu"]["dpu_wait"] / max(plain_opt, 1e-9))
            result["dpu_speedup"] = result["plain"]["wall"] / result["dpu"]["wall"]
    print(json.dumps(result, indent=2) if args.json else report(result))
    return 0


def _aio() -> AioSettings:
    return AioSettings(block_size=8 << 20, queue_depth=32, thread_count=1)


def measure(args: argparse.Namespace, nvme: str, delayed: bool) -> dict:
    torch.manual_seed(0)
    c = SIZES[args.model]
    model = GPT(c)
    a = _aio()
    cfg = {"zero_optimization": {"stage": args.stage, "sub_group_size": args.sub_group_size, "reduce_bucket_size": 50_000_000,
                                 "offload_optimizer": {"device": args.offload, "nvme_path": nvme, "buffer_count": 4,
                                                       "delayed_update": delayed, "delayed_update_warmup": 1}},
           "aio": {"block_size": a.block_size, "queue_depth": a.queue_depth, "thread_count": a.thread_count}}
    if args.offload == "none":
        del cfg["zero_optimization"]["offload_optimizer"]["nvme_path"]
    if args.stage == 3:
        cfg["zero_optimization"]["offload_param"] = {"device": args.offload_param, "nvme_path": nvme}
        if args.offload_param != "nvme":
            del cfg["zero_optimization"]["offload_param"]["nvme_path"]
    tokens = torch.randint(0, c.vocab_size, (args.batch_size, c.block_size + 1))
    rows = []
    bar = Progress(args.steps + 2, f"bench step {args.offload}{' dpu' if delayed else ''}", enabled=not args.json)
    with offload.initialize(model, cfg) as engine:
        store = engine.optimizer.store
        for i in range(args.steps + 2):
            io_before = dict(store.stats()["io"]) if store else {}
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
            io = store.stats()["io"] if store else {}
            row = {
                "forward": t1 - t0,
                "backward": t2 - t1 - copy + engine.times.reduce,  # the reducer runs inside backward
                "gradient_copy": copy,
                "optimizer": detail.get("adam", 0.0),
                "swap_wait": detail.get("swap_wait", 0.0) + detail.get("write_back_wait", 0.0),
                "upload": engine.times.publish + detail.get("sink", 0.0),
                "wall": t3 - t0,
                "optimizer_phase": engine.times.optimizer,
                "dpu_wait": engine.times.dpu_wait,
                "bytes_read": io.get("bytes_read", 0) - io_before.get("bytes_read", 0),
                "bytes_written": io.get("bytes_written", 0) - io_before.get("bytes_written", 0),
            }
            if i >= 2:
                rows.append(row)
            bar.advance(f"{row['wall']:.2f}s/step")
    med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    breakdown = {k: med[k] for k in PARTS}
    return {"breakdown": breakdown, "wall": med["wall"], "overlap": sum(breakdown.values()) / med["wall"],
            "optimizer_phase": med["optimizer_phase"], "dpu_wait": med["dpu_wait"],
            "bytes_read": med["bytes_read"], "bytes_written": med["bytes_written"]}


def _pipeline_efficiency(plain: dict, disk: dict) -> float:
    disk_s = plain["bytes_read"] / (disk["read_gbps"] * 1e9) + plain["bytes_written"] / (disk["write_gbps"] * 1e9)
    return max(plain["breakdown"]["optimizer"], disk_s) / plain["optimizer_phase"]


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
        p = r["plain"]
        lines += ["", f"nvme: {p['bytes_read'] / 1e9:.2f} GB read + {p['bytes_written'] / 1e9:.2f} GB written per step; "
                  f"disk measured now: read {r['disk_read_gbps']:.2f} GB/s, write {r['disk_write_gbps']:.2f} GB/s",
                  f"pipeline efficiency: {r['pipeline_efficiency']:.2f} (optimizer phase {p['optimizer_phase']:.3f} s)"]
    if "dpu" in r:
        lines += ["", f"delayed update: hides {r['dpu_hidden_fraction']:.0%} of the optimizer time; "
                  f"step {r['dpu_speedup']:.2f}x the plain one (compute and CPU Adam share this machine's cores)"]
    return "\n".join(lines)
