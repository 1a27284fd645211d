"""What glibc's malloc keeps after freeing, and what making it give that back costs.

    python benchmarks/host_allocator.py --model 25M --rounds 3

Trains the bundled GPT at stage 3 with the optimizer, the gradients and the
weights on NVMe (ZeRO-Infinity, where host memory is what runs out) in a
fresh process per run, one run per glibc setting in turn, --rounds times,
and reports for each setting the median step time and the process's peak RSS
above what it held once torch and offload were imported, beside the engine's
own report of what it holds (device + host peak): the difference is what the
process holds besides (Note [a process's own RAM] in offload/cli/plan.py).
Ratios are to glibc's defaults, measured in the same rounds:

  glibc         its defaults: a freed mapped block raises the mmap threshold
                (up to 32 MiB), so later tensors below it come from the heap,
                where a freed block stays while any block above it lives
  trim 0        MALLOC_TRIM_THRESHOLD_=0: the threshold stays at 128 KiB, so
                every larger tensor is mapped and given back when freed, and
                the heap's top is trimmed
  mmap 4 MiB    MALLOC_MMAP_THRESHOLD_=4194304: tensors above 4 MiB mapped
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

SETTINGS = {
    "glibc": {},
    "trim 0": {"MALLOC_TRIM_THRESHOLD_": "0"},
    "mmap 4 MiB": {"MALLOC_MMAP_THRESHOLD_": str(4 << 20)},
}


def child(model_name: str, steps: int, nvme: str) -> dict:
    import torch

    import offload
    from offload.models.gpt import GPT, SIZES
    from offload.report import process_memory

    imported, _ = process_memory()
    c = SIZES[model_name]
    config = {"train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
              "zero_optimization": {"stage": 3, "sub_group_size": 5_000_000,
                                    "offload_optimizer": {"device": "nvme", "nvme_path": nvme, "gradients_on_nvme": True},
                                    "offload_param": {"device": "nvme", "nvme_path": nvme, "max_in_cpu": 0}}}
    torch.manual_seed(0)
    with offload.init(config):
        model = GPT(c)
    tokens = torch.randint(0, c.vocab_size, (4, c.block_size + 1), generator=torch.Generator().manual_seed(0))
    times = []
    with offload.initialize(model, config, init_fn=model.init_module) as engine:
        for step in range(steps + 1):
            start = time.perf_counter()
            engine.backward(engine(tokens))
            engine.step()
            if step:  # the first allocates what steps keep
                times.append(time.perf_counter() - start)
        engine.synchronize()
        report = engine.memory_report().by_tier("peak_bytes")
    return {"step_s": statistics.median(times), "peak_rss": process_memory()[1] - imported,
            "report": report.get("device", 0) + report.get("host", 0)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="25M", help="a bundled GPT size (default 25M)")
    p.add_argument("--steps", type=int, default=5, help="measured steps per run (default 5)")
    p.add_argument("--rounds", type=int, default=2, help="runs of each setting, taking turns (default 2)")
    p.add_argument("--nvme-path", default=None, help="directory for the swap files (default: the temporary one)")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(child(args.model, args.steps, args.nvme_path)))
        return
    runs: dict[str, list[dict]] = {name: [] for name in SETTINGS}
    with tempfile.TemporaryDirectory(prefix="offload-bench-malloc-", dir=args.nvme_path) as nvme:
        for round_ in range(args.rounds):
            for name, env in SETTINGS.items():
                command = [sys.executable, __file__, "--child", "--model", args.model, "--steps", str(args.steps),
                           "--nvme-path", nvme]
                environment = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
                out = subprocess.run(command, env={**environment, **env}, capture_output=True, text=True, check=True)
                runs[name].append(json.loads(out.stdout.strip().splitlines()[-1]))
                print(f"round {round_ + 1}/{args.rounds} {name}: {runs[name][-1]}", file=sys.stderr)
    base = {k: statistics.median(r[k] for r in runs["glibc"]) for k in ("step_s", "peak_rss")}
    print(f"GPT {args.model}, stage 3, everything on NVMe, medians of {args.rounds} runs of {args.steps} steps")
    print(f"{'setting':12}{'step s':>9}{'x glibc':>9}{'peak RSS MB':>13}{'report MB':>11}{'beside MB':>11}{'x glibc':>9}")
    for name, got in runs.items():
        step = statistics.median(r["step_s"] for r in got)
        rss = statistics.median(r["peak_rss"] for r in got)
        report = statistics.median(r["report"] for r in got)
        beside = rss - report
        base_beside = base["peak_rss"] - statistics.median(r["report"] for r in runs["glibc"])
        print(f"{name:12}{step:9.3f}{step / base['step_s']:9.2f}{rss / 1e6:13.0f}{report / 1e6:11.0f}"
              f"{beside / 1e6:11.0f}{beside / base_beside:9.2f}")


if __name__ == "__main__":
    main()
