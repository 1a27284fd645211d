"""Optimizer state formats (Note [state format]) against fp32: the same
training, the same data and seed, one run per format.

Each run is ``offload train`` (the bundled GPT on the bundled text, optimizer
state on NVMe in a temporary directory) with the default config plus the
format:
  fp32          fp32 master and moments, fp32 compute (the baseline of bf16-moments)
  bf16-moments  bf16 moments (offload_optimizer.state_dtype)
  int8-moments  8-bit block-scaled moments (state_dtype int8, Note [8-bit moments])
  bf16-compute  fp32 master and moments, bf16 compute (the baseline of bf16-master)
  bf16-master   bf16 master and moments (master_dtype, stochastic rounding), bf16 compute
  bf16-master-int8  bf16 master and 8-bit moments, bf16 compute: the most compact
Prints each format's held-out loss, its ratio to its baseline's (the bound:
within 2%), and the bytes of optimizer state per parameter, and plots the
training curves side by side.

    python benchmarks/state_formats.py --steps 1000 --out runs/state_formats

On a CPU without bf16 instructions, ``--emulate-bf16-matmul`` runs the bf16
formats' linear layers and attention in fp32 from bf16 operands
(``bf16_emulation.py``); without it 1,000 steps of bf16 compute take hours.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import bf16_emulation

from offload.cli import main as offload_main
from offload.optim.state_format import StateFormat

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_CONFIG = os.path.join(HERE, "..", "configs", "train_default.json")
BOUND = 0.02


# name -> (bf16 compute, state_dtype, master_dtype, baseline)
FORMATS = {
    "fp32": (False, "float32", "float32", "fp32"),
    "bf16-moments": (False, "bfloat16", "float32", "fp32"),
    "int8-moments": (False, "int8", "float32", "fp32"),
    "bf16-compute": (True, "float32", "float32", "bf16-compute"),
    "bf16-master": (True, "bfloat16", "bfloat16", "bf16-compute"),
    "bf16-master-int8": (True, "int8", "bfloat16", "bf16-compute"),
}


def run(name: str, args: argparse.Namespace) -> dict:
    bf16, state_dtype, master_dtype, _ = FORMATS[name]
    with open(DEFAULT_CONFIG) as f:
        config = json.load(f)
    config["bf16"] = {"enabled": bf16}
    config["zero_optimization"]["offload_optimizer"].update(state_dtype=state_dtype, master_dtype=master_dtype)
    out = os.path.join(args.out, name)
    os.makedirs(out, exist_ok=True)
    path, summary = os.path.join(out, "config.json"), os.path.join(out, "summary.json")
    if args.reuse and os.path.exists(summary):
        with open(path) as f, open(summary) as g:
            done = json.load(f) == config and json.load(g)
        if done and done["steps"] == args.steps and done["model"] == args.model:
            print(f"state_formats: {name}: reusing {summary}")
            return done
    with open(path, "w") as f:
        json.dump(config, f, indent=2)
    argv = ["train", "--config", path, "--model", args.model, "--steps", str(args.steps), "--out", out]
    if args.nvme_path:
        argv += ["--nvme-path", args.nvme_path]
    with bf16_emulation.bf16_matmuls(bf16 and args.emulate_bf16_matmul):
        code = offload_main(argv)
    if code != 0:
        sys.exit(f"state_formats: offload train failed for {name}")
    with open(summary) as f:
        return json.load(f)


def plot(runs: dict[str, dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for name, s in runs.items():
        losses = s["losses"]
        window = max(1, len(losses) // 50)
        smooth = [sum(losses[max(0, i - window + 1) : i + 1]) / len(losses[max(0, i - window + 1) : i + 1])
                  for i in range(len(losses))]
        ax.plot(range(1, len(losses) + 1), smooth, label=f"{name} (held-out {s['eval_loss_end']:.3f})")
    ax.set_xlabel("step")
    ax.set_ylabel(f"training loss, nats/byte (moving mean of {window})")
    ax.set_title("Optimizer state formats, same seed and data")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--model", default="5M")
    p.add_argument("--nvme-path", default=None, help="where the swap files go (default: a temporary directory)")
    p.add_argument("--out", default="runs/state_formats")
    p.add_argument("--formats", default=",".join(FORMATS), help=f"some of {', '.join(FORMATS)}")
    bf16_emulation.add_argument(p)
    p.add_argument("--reuse", action="store_true",
                   help="read, not rerun, the formats whose run in --out had this config, model and --steps")
    args = p.parse_args()
    names = [n for n in args.formats.split(",") if n]
    unknown = [n for n in names if n not in FORMATS]
    if unknown:
        sys.exit(f"state_formats: unknown --formats {unknown}; choose among {', '.join(FORMATS)}")
    runs = {name: run(name, args) for name in names}
    emulated = ", bf16 matmuls emulated in fp32" if args.emulate_bf16_matmul else ""
    print(f"\nstate formats: {args.model} GPT, {args.steps} steps, same seed and data{emulated}")
    print(f"{'format':18}{'bytes/param':>12}{'held-out loss':>15}{'/ baseline':>12}{'/ fp32':>9}{'final train loss':>18}")

    def held_out_over(name: str, other: str) -> float:
        return runs[name]["eval_loss_end"] / runs[other]["eval_loss_end"] if other in runs else float("nan")

    for name, s in runs.items():
        _, state_dtype, master_dtype, baseline = FORMATS[name]
        ratio = held_out_over(name, baseline)
        verdict = f"{'within' if abs(ratio - 1) <= BOUND else 'OUTSIDE'} {BOUND:.0%} of {baseline}" if baseline != name else "baseline"
        print(f"{name:18}{StateFormat.named(state_dtype, master_dtype).bytes_per_element:>12.3g}"
              f"{s['eval_loss_end']:>15.4f}{ratio:>12.4f}{held_out_over(name, 'fp32'):>9.4f}{s['losses'][-1]:>18.4f}  {verdict}")
    path = os.path.join(args.out, "state_formats.png")
    plot(runs, path)
    print(f"curves: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
