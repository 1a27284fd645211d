"""The owned gradient in bf16 (the engine's choice without accumulation, Note
[owned gradient dtype]) against the same engine forced to keep it in fp32.

    python benchmarks/grad_dtype.py --model 25M --steps 6 --rounds 5

Both engines train the bundled GPT in bf16 with the optimizer state in host
memory (stage 2, offload_optimizer cpu), on the same batch; rounds alternate
between them in one process, and each round times their steps' phases. Printed:
the medians of the gradient copy (reduce-scatter into the owned gradient),
the CPU Adam and the whole step, and their ratios (fp32 time / bf16 time:
above 1 means bf16 is faster). Both train bitwise alike (tests/zero/test_owned_grad.py).
"""

from __future__ import annotations

import argparse
import statistics
import time
from contextlib import contextmanager

import torch

import offload
from offload import engine as engine_module
from offload.cli.args import model_name, positive_int
from offload.models.gpt import GPT, SIZES


@contextmanager
def owned_gradient_in(dtype: torch.dtype | None):
    real = engine_module.gradient_dtype
    if dtype is not None:
        engine_module.gradient_dtype = lambda *args: dtype
    try:
        yield
    finally:
        engine_module.gradient_dtype = real


def phases(engine, tokens: torch.Tensor, steps: int) -> dict[str, float]:
    rows = []
    for _ in range(steps):
        copy_before = engine.reducer.seconds
        start = time.perf_counter()
        engine.backward(engine(tokens))
        engine.step()
        rows.append({"gradient copy": engine.reducer.seconds - copy_before,
                     "adam": engine.times.optimizer_detail["adam"], "step": time.perf_counter() - start})
    return {k: statistics.median(r[k] for r in rows) for k in rows[0]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=model_name, choices=sorted(SIZES), default="25M")
    parser.add_argument("--steps", type=positive_int, default=6, help="timed steps per round (after one warm-up step)")
    parser.add_argument("--rounds", type=positive_int, default=5)
    parser.add_argument("--batch-size", type=positive_int, default=4)
    args = parser.parse_args()
    c = SIZES[args.model]
    cfg = {"optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "bf16": {"enabled": True},
           "zero_optimization": {"stage": 2, "sub_group_size": 4_000_000, "offload_optimizer": {"device": "cpu"}}}
    tokens = torch.randint(0, c.vocab_size, (args.batch_size, c.block_size + 1), generator=torch.Generator().manual_seed(0))
    engines = {}
    for name, dtype in (("bf16", None), ("fp32", torch.float32)):
        torch.manual_seed(0)
        with owned_gradient_in(dtype):
            engines[name] = offload.initialize(GPT(c), cfg)
        assert engines[name].gradient.dtype == (dtype or torch.bfloat16)
        phases(engines[name], tokens, 1)
    results = {name: [] for name in engines}
    for r in range(args.rounds):
        for name, engine in engines.items():
            results[name].append(phases(engine, tokens, args.steps))
        print(f"round {r + 1}/{args.rounds} done", flush=True)
    for engine in engines.values():
        engine.close(restore_model=False)
    print(f"\nGPT {args.model} ({c.params() / 1e6:.1f}M parameters), bf16 compute, stage 2, optimizer on cpu, "
          f"{args.rounds} rounds x {args.steps} steps, medians in ms")
    print(f"{'phase':16}{'bf16 owned':>12}{'fp32 owned':>12}{'fp32 / bf16':>14}")
    for phase in ("gradient copy", "adam", "step"):
        bf16 = statistics.median(r[phase] for r in results["bf16"])
        fp32 = statistics.median(r[phase] for r in results["fp32"])
        print(f"{phase:16}{1e3 * bf16:12.1f}{1e3 * fp32:12.1f}{fp32 / bf16:13.2f}x")


if __name__ == "__main__":
    main()
