"""Adam's moments in fp32 against bf16 (``offload_optimizer.state_dtype``):
the same training, the same data and seed, one run per format.

Each run is ``offload train`` (the bundled GPT on the bundled text, optimizer
state on NVMe in a temporary directory) with the default config plus the
format. Prints each format's held-out loss, its ratio to fp32's (the issue's
bound: within 2%), and the bytes of optimizer state per parameter, and plots
the training curves side by side.

    python benchmarks/state_formats.py --steps 1000 --out runs/state_formats
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from offload.cli import main as offload_main
from offload.optim.state_format import STATE_DTYPES, StateFormat

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_CONFIG = os.path.join(HERE, "..", "configs", "train_default.json")
BOUND = 0.02


def run(state_dtype: str, args: argparse.Namespace) -> dict:
    with open(DEFAULT_CONFIG) as f:
        config = json.load(f)
    config["zero_optimization"]["offload_optimizer"]["state_dtype"] = state_dtype
    out = os.path.join(args.out, state_dtype)
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, "config.json")
    with open(path, "w") as f:
        json.dump(config, f, indent=2)
    argv = ["train", "--config", path, "--model", args.model, "--steps", str(args.steps), "--out", out]
    if args.nvme_path:
        argv += ["--nvme-path", args.nvme_path]
    if offload_main(argv) != 0:
        sys.exit(f"state_formats: offload train failed for {state_dtype}")
    with open(os.path.join(out, "summary.json")) as f:
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
        ax.plot(range(1, len(losses) + 1), smooth, label=f"{name} moments (held-out {s['eval_loss_end']:.3f})")
    ax.set_xlabel("step")
    ax.set_ylabel(f"training loss, nats/byte (moving mean of {window})")
    ax.set_title("Adam moments in fp32 and bf16, same seed and data")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--model", default="5M")
    p.add_argument("--nvme-path", default=None, help="where the swap files go (default: a temporary directory)")
    p.add_argument("--out", default="runs/state_formats")
    args = p.parse_args()
    runs = {name: run(name, args) for name in STATE_DTYPES}
    base = runs["float32"]["eval_loss_end"]
    print(f"\nstate formats: {args.model} GPT, {args.steps} steps, same seed and data")
    print(f"{'moments':10}{'bytes/param':>12}{'held-out loss':>15}{'/ fp32':>9}{'final train loss':>18}")
    for name, s in runs.items():
        ratio = s["eval_loss_end"] / base
        print(f"{name:10}{StateFormat.named(name).bytes_per_element:>12}{s['eval_loss_end']:>15.4f}{ratio:>9.4f}"
              f"{s['losses'][-1]:>18.4f}  {'within' if abs(ratio - 1) <= BOUND else 'OUTSIDE'} {BOUND:.0%}")
    path = os.path.join(args.out, "state_formats.png")
    plot(runs, path)
    print(f"curves: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
