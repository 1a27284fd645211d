"""offload against DeepSpeed ZeRO-Offload, in the same process, step by step.

    DS_ACCELERATOR=cpu python benchmarks/vs_deepspeed.py --reps 6

Both engines train copies of one Hugging Face GPT-2 built from its config
(2 layers, width 384, GPT-2's vocabulary: 23M parameters) on the same
batches (4 x 256 tokens), fp32, ZeRO stage 2 with the optimizer state in CPU
memory, AdamW, gradient clipping at 1.0. Their steps alternate, so both see
the same machine. Printed: each engine's median forward, backward and
optimizer-phase (``step()``) seconds, the ratios offload / DeepSpeed, and the
largest relative difference between their losses.

Needs ``deepspeed`` and ``transformers`` importable (neither is a dependency
of offload); without them it says which is missing and exits 0. DeepSpeed
JIT-builds its CPU Adam on first use (minutes; cached afterwards). On this
project's CPU machines: ``pip install --no-deps --no-build-isolation
deepspeed`` plus hjson, ninja, py-cpuinfo, pydantic, msgpack, einops,
packaging, tqdm; and ``DS_ACCELERATOR=cpu``.
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import os
import statistics
import sys
import time

import torch

import offload


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=6, help="timed steps per engine, after 2 warm-up steps")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--width", type=int, default=384)
    parser.add_argument("--clip", type=float, default=1.0, help="gradient_clipping for both (0: off)")
    args = parser.parse_args()
    missing = [name for name in ("deepspeed", "transformers") if importlib.util.find_spec(name) is None]
    if missing:
        print(f"vs_deepspeed: {' and '.join(missing)} not importable; nothing to compare (see this script's help)")
        return 0
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29611")
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    import deepspeed
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=args.layers, n_embd=args.width, n_head=args.width // 64,
                                       resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
    params = sum(p.numel() for p in model.parameters())
    config = {"train_micro_batch_size_per_gpu": 4, "gradient_clipping": args.clip,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "betas": [0.9, 0.999], "eps": 1e-8,
                                                        "weight_decay": 0.01}},
              "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}
    ds_engine, *_ = deepspeed.initialize(model=copy.deepcopy(model), model_parameters=None, config=copy.deepcopy(config))
    ours = offload.initialize(copy.deepcopy(model), config)
    engines = {"deepspeed": ds_engine, "offload": ours}
    generator = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, 50257, (4, 256), generator=generator) for _ in range(args.reps + 2)]
    times = {name: [] for name in engines}
    losses = {name: [] for name in engines}
    for i, ids in enumerate(batches):
        for name, engine in engines.items():
            t0 = time.perf_counter()
            out = engine(input_ids=ids, labels=ids)
            t1 = time.perf_counter()
            engine.backward(out.loss)
            t2 = time.perf_counter()
            engine.step()
            t3 = time.perf_counter()
            losses[name].append(out.loss.item())
            if i >= 2:
                times[name].append({"forward": t1 - t0, "backward": t2 - t1, "optimizer phase": t3 - t2, "step": t3 - t0})
        print(f"step {i + 1}/{len(batches)}", file=sys.stderr, flush=True)
    ours.close(restore_model=False)
    print(f"\nHF GPT-2, {args.layers} layers, width {args.width}: {params / 1e6:.1f}M parameters; batch 4 x 256, fp32, "
          f"ZeRO-2, optimizer on cpu, clipping {args.clip}; medians of {args.reps} steps after 2 warm-up, alternating")
    print(f"{'seconds':18}{'DeepSpeed':>12}{'offload':>12}{'offload / DeepSpeed':>22}")
    for phase in ("forward", "backward", "optimizer phase", "step"):
        ds = statistics.median(t[phase] for t in times["deepspeed"])
        of = statistics.median(t[phase] for t in times["offload"])
        print(f"{phase:18}{ds:12.4f}{of:12.4f}{of / ds:21.2f}x")
    worst = max(abs(a - b) / abs(b) for a, b in zip(losses["offload"], losses["deepspeed"]))
    print(f"largest relative loss difference over {len(batches)} steps: {worst:.1e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
