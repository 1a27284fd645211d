"""Training throughput on one GPU: no offload against the offloaded setups.

    python benchmarks/gpu_bench.py --nvme-path /tmp/nvme            # on a GPU machine (gpu_check.sh runs it)
    python benchmarks/gpu_bench.py --model tiny --device cpu ...    # a smoke run of the script itself

A GPT of about 1.5B parameters (48 layers, width 1600, 1024 tokens, byte
vocabulary) in bf16, micro-batch 8, ``--accumulation`` micro-batches per
step (4: 32k tokens, where the GPU's forwards and backwards outlast the CPU's
Adam over 1.5B parameters), built under ``offload.init``. Each setup runs in
a process of its own, under its own timeout (and all within ``--budget``),
for one warm-up step (and the delayed update's warm-up, and its first
delayed step, which allocates its second gradient window) and ``--steps``
measured ones (``--nvme-steps`` and ``--nvme-timeout`` for nvme-infty, which
moves about 60 GB over the disk a step at 4 micro-batches):
  none         stage 2, everything on the GPU (the baseline, if it fits)
  cpu          stage 2, optimizer state in CPU memory (ZeRO-Offload)
  cpu-overlap  the same with overlap_step: sub-groups step during backward
  cpu-dpu      the same with the one-step delayed update
  nvme-infty   stage 3, weights and optimizer state on NVMe (ZeRO-Infinity)
Gradient clipping is off unless ``--clip`` is given: a few steps from
initialisation are where clipping binds on every step, which makes
overlap_step roll back and fall back to the plain step; the table counts
the rollbacks. Printed per setup: tokens/s, model TFLOPS (6 x parameters x
tokens / s), the fraction of the baseline's throughput, and the GPU idle
fraction: 1 - the baseline's time for the same forwards and backwards / this
setup's step time; then the engine's phases of the median step (seconds).
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

MIN_SECONDS = 20  # fewer cannot even start a setup's process and build its engine at 1.5B
SETUPS = {
    "none": {"stage": 2, "offload_optimizer": {"device": "none"}},
    "cpu": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
    "cpu-overlap": {"stage": 2, "offload_optimizer": {"device": "cpu", "overlap_step": True}},
    "cpu-dpu": {"stage": 2, "offload_optimizer": {"device": "cpu", "delayed_update": True, "delayed_update_warmup": 1}},
    "nvme-infty": {"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": None},
                   "offload_param": {"device": "nvme", "nvme_path": None, "max_in_cpu": 0}},
}
MODELS = {"1.5B": dict(n_layer=48, n_head=25, n_embd=1600, block_size=1024), "tiny": dict(n_layer=2, n_head=2, n_embd=64, block_size=64)}


def one(setup: str, model: str, device: str, steps: int, batch: int, accumulation: int, nvme_path: str,
        clip: float) -> dict:
    import torch

    import offload
    from offload.models.gpt import GPT, GPTConfig

    c = GPTConfig(**MODELS[model])
    zero = json.loads(json.dumps(SETUPS[setup]))
    for section in ("offload_optimizer", "offload_param"):
        if section in zero and "nvme_path" in zero[section]:
            zero[section]["nvme_path"] = nvme_path
    # Buckets the size of a sub-group reduce as backward goes, so sub-groups complete through it (the README's
    # advice for overlap_step); stage 3 reduces each parameter on its own.
    buckets = {"reduce_bucket_size": 50_000_000} if zero["stage"] < 3 else {}
    config = {"train_micro_batch_size_per_gpu": batch, "gradient_accumulation_steps": accumulation,
              "gradient_clipping": clip, "bf16": {"enabled": True}, "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
              "zero_optimization": {"sub_group_size": 50_000_000, **buckets, **zero}}
    began = time.perf_counter()
    torch.manual_seed(0)
    with offload.init(config):
        net = GPT(c)
    engine = offload.initialize(net, config, init_fn=net.init_module)
    tokens = torch.randint(0, c.vocab_size, (batch, c.block_size + 1), device=engine.device)
    cuda = engine.device.type == "cuda"
    _progress(f"{setup}: ready after {time.perf_counter() - began:.1f} s")
    # The delayed update's first delayed step allocates its second gradient window.
    warmup = 1 + zero["offload_optimizer"].get("delayed_update_warmup", 0)
    rows = []
    for i in range(warmup + steps):
        if cuda:
            torch.cuda.synchronize()
        start, hooks_before, landing_before = time.perf_counter(), engine.reducer.seconds, _landing(engine)
        for micro in range(accumulation):
            engine.backward(engine(tokens))
            if micro < accumulation - 1:
                engine.step()  # a no-op inside the window, as a training loop calls it
        if cuda:
            torch.cuda.synchronize()  # the forwards and backwards as the GPU ran them
        compute_end = time.perf_counter()
        engine.step()
        if cuda:
            torch.cuda.synchronize()
        end = time.perf_counter()
        _progress(f"{setup}: step {i} took {end - start:.2f} s, {compute_end - start:.2f} s of it forwards and backwards")
        if i >= warmup:
            # The gradient hooks' own time (reducing, sending a part out) holds up the thread that launches
            # backward's kernels; the landing thread's (waiting for copies, adding parts in) runs beside it.
            hooks = round(engine.reducer.seconds - hooks_before, 4)
            landing = round(_landing(engine) - landing_before, 4)  # beside backward, on the landing thread
            rows.append({"step": end - start, "forward_backward": compute_end - start,
                         "phases": _phases(engine) | {"gradient_hooks": hooks, "gradient_landing": landing}})
    rollbacks = getattr(engine.update, "rollbacks", None)  # the overlapped step's
    engine.close(restore_model=False)
    median = sorted(rows, key=lambda r: r["step"])[len(rows) // 2]
    return {"setup": setup, "params": c.params(), "tokens_per_step": accumulation * batch * c.block_size,
            "step_s": median["step"], "steps": warmup + steps, "rollbacks": rollbacks,
            "forward_backward_s": statistics.median(r["forward_backward"] for r in rows), "phases": median["phases"],
            "peak_gpu_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0}


def _phases(engine) -> dict[str, float]:
    """The engine's split of its last step (offload.report.PhaseTimes, the optimizer's own split flattened in),
    and the overlapped step's work on its worker during backward and step()'s wait for it, rounded."""
    times, update = engine.times, engine.update
    flat = {k: v for k, v in vars(times).items() if k != "optimizer_detail"} | times.optimizer_detail
    if hasattr(update, "worker_seconds"):
        flat |= {"overlap_worker": update.worker_seconds, "overlap_join": update.join_seconds}
    return {k: round(v, 4) for k, v in flat.items() if v}


def _landing(engine) -> float:
    """Note [landing off backward's thread]: the landing thread's time so far (none with gradients on NVMe)."""
    return getattr(engine.gradient, "landing_seconds", 0.0)


def _progress(line: str) -> None:
    """To stderr, which the parent shows when this setup runs out of time."""
    print(line, file=sys.stderr, flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=sorted(MODELS), default="1.5B")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cpu: a smoke run of the script")
    parser.add_argument("--steps", type=int, default=3, help="measured steps (the median is reported)")
    parser.add_argument("--nvme-steps", type=int, default=1, help="measured steps of nvme-infty")
    parser.add_argument("--batch", type=int, default=8, help="micro-batch")
    parser.add_argument("--accumulation", type=int, default=4, help="micro-batches per optimizer step")
    parser.add_argument("--nvme-path", default=tempfile.gettempdir())
    parser.add_argument("--setups", default=",".join(SETUPS))
    parser.add_argument("--timeout", type=int, default=75, help="seconds per setup")
    parser.add_argument("--nvme-timeout", type=int, default=150, help="seconds for nvme-infty")
    parser.add_argument("--budget", type=int, default=375, help="seconds for all setups together")
    parser.add_argument("--clip", type=float, default=0.0, help="gradient_clipping (0: off)")
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)  # run one setup, print its JSON
    args = parser.parse_args()
    if args.one:
        print(json.dumps(one(args.one, args.model, args.device, args.steps, args.batch, args.accumulation,
                             args.nvme_path, args.clip)))
        return 0
    env = dict(os.environ, **({"CUDA_VISIBLE_DEVICES": ""} if args.device == "cpu" else {}))
    results, failed = {}, []
    deadline = time.monotonic() + args.budget
    for setup in args.setups.split(","):
        nvme = setup == "nvme-infty"
        steps, timeout = (args.nvme_steps, args.nvme_timeout) if nvme else (args.steps, args.timeout)
        left = int(deadline - time.monotonic())
        if left < MIN_SECONDS:
            print(f"{setup}: not run, {MIN_SECONDS} s or more were needed and the budget has {max(left, 0)} s left",
                  flush=True)
            failed.append(setup)
            continue
        timeout = min(timeout, left)
        argv = [sys.executable, __file__, "--one", setup, "--model", args.model, "--device", args.device,
                "--steps", str(steps), "--batch", str(args.batch), "--accumulation", str(args.accumulation),
                "--nvme-path", args.nvme_path, "--clip", str(args.clip)]
        try:
            proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=env)
        except subprocess.TimeoutExpired as e:
            print(f"{setup}: no result within {timeout} s", flush=True)
            print(_text(e.stderr).rstrip()[-2000:], flush=True)
            failed.append(setup)
            continue
        if proc.returncode != 0:
            last = (proc.stderr.strip().splitlines() or ["?"])[-1]
            print(f"{setup}: failed with exit status {proc.returncode}: {last}", flush=True)
            failed.append(setup)
            continue
        results[setup] = json.loads(proc.stdout.strip().splitlines()[-1])
        phases = ", ".join(f"{k} {v:.2f}" for k, v in results[setup]["phases"].items())
        print(f"{setup}: {results[setup]['step_s']:.2f} s per step ({phases})", flush=True)
    base = results.get("none")
    print(f"\n{'setup':13}{'s/step':>8}{'tokens/s':>10}{'TFLOPS':>8}{'of none':>9}{'GPU idle':>10}{'GPU GiB':>9}"
          f"{'rollbacks':>11}")
    for setup, r in results.items():
        rate = r["tokens_per_step"] / r["step_s"]
        tflops = 6 * r["params"] * rate / 1e12
        share = f"{rate / (base['tokens_per_step'] / base['step_s']):.0%}" if base else "-"
        idle = f"{1 - base['forward_backward_s'] / r['step_s']:.0%}" if base else "-"
        rollbacks = "-" if r["rollbacks"] is None else f"{r['rollbacks']} of {r['steps']}"
        print(f"{setup:13}{r['step_s']:8.2f}{rate:10.0f}{tflops:8.1f}{share:>9}{idle:>10}{r['peak_gpu_gib']:9.1f}"
              f"{rollbacks:>11}")
    if failed:
        print(f"no result from {', '.join(failed)}")
    print(json.dumps(results))  # last: what a reader of the output parses
    return 1 if failed else 0


def _text(output: bytes | str | None) -> str:
    """What a timed-out child wrote: bytes there, even with text=True."""
    return output.decode(errors="replace") if isinstance(output, bytes) else output or ""


if __name__ == "__main__":
    sys.exit(main())
