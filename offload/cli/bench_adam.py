"""``offload bench adam``: the native CPU Adam against torch's, and against memory bandwidth.

On the same N fp32 parameters, in interleaved rounds (so drift on a shared
machine hits every contender alike), it times:
  - fp32 in, fp32 out: our kernel, torch AdamW(fused=True), torch AdamW(foreach=True);
  - the ZeRO-Offload step (bf16 gradient in, fp32 master/m/v, bf16 weights out):
    our kernel in one pass, and torch's grad.float() + fused AdamW + param.to(bf16)
    (into preallocated buffers, torch's best case);
  - our kernel with 8-bit moments (Note [8-bit moments]), fp32 otherwise,
    against itself with fp32 moments;
  - STREAM copy and triad with the same thread count.
Reported figures are medians over the rounds after one warm-up round.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable

import psutil
import torch

from offload import _native
from offload.cli.args import parameter_count, positive_int
from offload.errors import UsageError
from offload.optim.adam import adam_step, available_cores
from offload.optim.hyper import AdamHyper
from offload.optim.moment_codec import BlockCodes, blocks

# Bytes each element moves in one step (Note [bit-identical Adam] reads p, m, v, g and writes p, m, v).
FP32_BYTES = 4 * 4 + 3 * 4
MIXED_BYTES = 2 + 3 * 4 + 3 * 4 + 2  # bf16 grad in, bf16 weights out
CODES_BYTES = 4 + 4 + 2 + 4 + 2  # p, g and two one-byte moments in; p and the moments out
STREAM_COPY_BYTES = 2 * 4  # STREAM's own convention: one read, one write
STREAM_TRIAD_BYTES = 3 * 4

HYPER = AdamHyper(lr=1e-3, weight_decay=0.01)
# Peak bytes held per parameter while measuring: 26 arrays of 4 bytes (our
# state twice and once with 8-bit moments, three torch optimizers with their
# own params, grads and moments, the bf16 copies, three STREAM arrays).
BYTES_PER_PARAM_HELD = 104


def add_parser(benchmarks: argparse._SubParsersAction) -> None:
    p = benchmarks.add_parser(
        "adam",
        help="CPU Adam throughput against torch and memory bandwidth",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--params", type=parameter_count, default=64_000_000, help="parameters per step (e.g. 64M; default 64M)")
    p.add_argument("--threads", type=positive_int, default=None, help="threads for every contender (default: available cores)")
    p.add_argument("--rounds", type=positive_int, default=7, help="timed rounds after one warm-up (default 7)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    if not _native.status().available:
        raise UsageError(f"the native library is unavailable, nothing to benchmark: {_native.status().reason}")
    threads = args.threads or available_cores()
    needed = BYTES_PER_PARAM_HELD * args.params
    available = psutil.virtual_memory().available
    if needed > 0.9 * available:
        raise UsageError(f"--params {args.params:,} needs about {needed / 1e9:.1f} GB of RAM for every contender's "
                        f"buffers, {available / 1e9:.1f} GB is available; pass a smaller --params")
    result = measure(args.params, threads, args.rounds, progress=sys.stderr.isatty())
    print(json.dumps(result, indent=2) if args.json else report(result))
    return 0


def measure(n: int, threads: int, rounds: int, progress: bool = False) -> dict:
    previous_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return _measure(n, threads, rounds, progress)
    finally:
        torch.set_num_threads(previous_threads)


def _measure(n: int, threads: int, rounds: int, progress: bool) -> dict:
    torch.manual_seed(0)
    init = torch.randn(n)
    grad = torch.randn(n) * 1e-2
    max_abs, max_rel = _agreement_with_fused(init, grad, threads)  # first: its arrays are freed before the rest
    grad_bf16 = grad.to(torch.bfloat16)

    ours = [init.clone(), torch.zeros(n), torch.zeros(n)]
    ours_mixed = [init.clone(), torch.zeros(n), torch.zeros(n)]
    out_bf16 = torch.empty(n, dtype=torch.bfloat16)
    ours_codes = [init.clone(), *(BlockCodes(torch.zeros(n, dtype=torch.uint8), torch.zeros(blocks(n))) for _ in range(2))]
    fused_p = _torch_param(init, grad)
    foreach_p = _torch_param(init, grad)
    mixed_p = _torch_param(init, torch.empty(n))
    mixed_out = torch.empty(n, dtype=torch.bfloat16)
    fused = torch.optim.AdamW([fused_p], lr=HYPER.lr, weight_decay=HYPER.weight_decay, fused=True)
    foreach = torch.optim.AdamW([foreach_p], lr=HYPER.lr, weight_decay=HYPER.weight_decay, foreach=True)
    mixed = torch.optim.AdamW([mixed_p], lr=HYPER.lr, weight_decay=HYPER.weight_decay, fused=True)
    src, dst, third = torch.randn(n), torch.empty(n), torch.randn(n)
    native = _native.lib()
    steps = {"ours": 0, "ours_mixed": 0, "ours_codes": 0}

    def ours_step():
        steps["ours"] += 1
        adam_step(ours[0], grad, ours[1], ours[2], HYPER, steps["ours"], threads=threads)

    def ours_mixed_step():
        steps["ours_mixed"] += 1
        adam_step(ours_mixed[0], grad_bf16, ours_mixed[1], ours_mixed[2], HYPER, steps["ours_mixed"],
                  out=out_bf16, threads=threads)

    def ours_codes_step():
        steps["ours_codes"] += 1
        adam_step(ours_codes[0], grad, ours_codes[1], ours_codes[2], HYPER, steps["ours_codes"], threads=threads)

    def torch_mixed_step():
        mixed_p.grad.copy_(grad_bf16)
        mixed.step()
        mixed_out.copy_(mixed_p.detach())

    contenders: dict[str, Callable[[], None]] = {
        "offload": ours_step,
        "torch_fused": fused.step,
        "torch_foreach": foreach.step,
        "offload_mixed": ours_mixed_step,
        "torch_mixed": torch_mixed_step,
        "offload_codes": ours_codes_step,
        "stream_copy": lambda: _native.check(native.offload_stream_copy(dst.data_ptr(), src.data_ptr(), n, threads)),
        "stream_triad": lambda: _native.check(
            native.offload_stream_triad(dst.data_ptr(), src.data_ptr(), third.data_ptr(), 3.0, n, threads)),
    }
    times: dict[str, list[float]] = {name: [] for name in contenders}
    for r in range(rounds + 1):
        if progress:
            print(f"\rround {r}/{rounds}" + (" (warm-up)" if r == 0 else ""), end="", file=sys.stderr, flush=True)
        for name, fn in contenders.items():
            start = time.perf_counter()
            fn()
            if r > 0:
                times[name].append(time.perf_counter() - start)
    if progress:
        print("\r" + " " * 30 + "\r", end="", file=sys.stderr)

    t = {name: statistics.median(values) for name, values in times.items()}
    stream_copy = STREAM_COPY_BYTES * n / t["stream_copy"] / 1e9
    stream_triad = STREAM_TRIAD_BYTES * n / t["stream_triad"] / 1e9
    offload_gbps = FP32_BYTES * n / t["offload"] / 1e9
    return {
        "params": n,
        "threads": threads,
        "rounds": rounds,
        "isa": _native.adam_isa(),
        "offload_params_per_s": n / t["offload"],
        "torch_fused_params_per_s": n / t["torch_fused"],
        "torch_foreach_params_per_s": n / t["torch_foreach"],
        "offload_mixed_params_per_s": n / t["offload_mixed"],
        "torch_mixed_params_per_s": n / t["torch_mixed"],
        "offload_codes_params_per_s": n / t["offload_codes"],
        "offload_codes_gbps": CODES_BYTES * n / t["offload_codes"] / 1e9,
        "offload_codes_vs_offload": t["offload"] / t["offload_codes"],
        "stream_copy_gbps": stream_copy,
        "stream_triad_gbps": stream_triad,
        "offload_gbps": offload_gbps,
        "torch_fused_gbps": FP32_BYTES * n / t["torch_fused"] / 1e9,
        "offload_mixed_gbps": MIXED_BYTES * n / t["offload_mixed"] / 1e9,
        "offload_vs_fused": t["torch_fused"] / t["offload"],
        "offload_vs_foreach": t["torch_foreach"] / t["offload"],
        "offload_mixed_vs_torch_mixed": t["torch_mixed"] / t["offload_mixed"],
        "offload_fraction_of_stream": offload_gbps / max(stream_copy, stream_triad),
        "max_abs_err": max_abs,
        "max_rel_err": max_rel,
    }


def _torch_param(init: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    p = init.clone().requires_grad_()
    p.grad = grad.clone()
    return p


def _agreement_with_fused(init: torch.Tensor, grad: torch.Tensor, threads: int) -> tuple[float, float]:
    """One step from the same state by both; max |ours - fused|, and that over max |fused|."""
    ours = [init.clone(), torch.zeros_like(init), torch.zeros_like(init)]
    adam_step(ours[0], grad, ours[1], ours[2], HYPER, 1, threads=threads)
    ref = _torch_param(init, grad)
    torch.optim.AdamW([ref], lr=HYPER.lr, weight_decay=HYPER.weight_decay, fused=True).step()
    diff = (ours[0] - ref.detach()).abs().max().item()
    return diff, diff / ref.detach().abs().max().item()


def report(r: dict) -> str:
    rows = [
        ("offload, fp32", r["offload_params_per_s"], r["offload_gbps"], f"{r['offload_vs_fused']:.2f}x torch fused"),
        ("torch AdamW fused, fp32", r["torch_fused_params_per_s"], r["torch_fused_gbps"], ""),
        ("torch AdamW foreach, fp32", r["torch_foreach_params_per_s"], FP32_BYTES * r["torch_foreach_params_per_s"] / 1e9, ""),
        ("offload, bf16 grad -> bf16 weights", r["offload_mixed_params_per_s"], r["offload_mixed_gbps"],
         f"{r['offload_mixed_vs_torch_mixed']:.2f}x torch mixed"),
        ("torch .float() + fused + .to(bf16)", r["torch_mixed_params_per_s"], MIXED_BYTES * r["torch_mixed_params_per_s"] / 1e9, ""),
        ("offload, 8-bit moments", r["offload_codes_params_per_s"], r["offload_codes_gbps"],
         f"{r['offload_codes_vs_offload']:.2f}x offload fp32"),
    ]
    lines = [
        f"offload bench adam: {r['params']:,} parameters, {r['threads']} thread{'s' * (r['threads'] != 1)}, kernel {r['isa']}, "
        f"median of {r['rounds']} rounds",
        "",
        f"{'':38}{'Mparams/s':>10}{'GB/s':>8}   comparison",
    ]
    lines += [f"{name:38}{pps / 1e6:10.0f}{gbps:8.1f}   {cmp}" for name, pps, gbps, cmp in rows]
    lines += [
        f"{'STREAM copy':38}{'':10}{r['stream_copy_gbps']:8.1f}",
        f"{'STREAM triad':38}{'':10}{r['stream_triad_gbps']:8.1f}",
        "",
        f"offload fp32 moves {FP32_BYTES} B/param: {r['offload_fraction_of_stream']:.0%} of the best STREAM bandwidth.",
        f"GB/s counts the bytes each step must read and write ({FP32_BYTES} B/param fp32, {MIXED_BYTES} B/param mixed, "
        f"{CODES_BYTES} B/param with 8-bit moments)"
        " for every row, so rows compare as throughput.",
        f"Agreement with torch fused after one step: max abs {r['max_abs_err']:.2e}, relative to max |param| {r['max_rel_err']:.2e}.",
    ]
    return "\n".join(lines)
