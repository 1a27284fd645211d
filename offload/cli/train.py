"""``offload train``: train the bundled GPT on the bundled text, end to end.

With no arguments: a 4.8M-parameter byte-level GPT (``--model 5M``) learns
to write Python from the standard library's own sources (nothing is
downloaded), with ZeRO stage 2 and the optimizer state on NVMe in a temporary
directory that is removed afterwards. ``--config`` takes any engine config
(``configs/`` has ready ones); the options below override its batch size and
NVMe paths.

The learning rate warms up linearly over the first tenth of the steps, then
decays along a cosine to a tenth of the config's ``optimizer.params.lr``.
The progress bar shows the loss, tokens/s, the step time split into compute
(forward and backward), optimizer (CPU Adam), swap (waiting for the disk) and
the rest, and the bytes held per tier. At the end, a summary JSON and a
loss-curve PNG are written to --out. Under ``torchrun --nproc_per_node N -m
offload train`` every rank trains on different batches (gloo on CPU, NCCL on
GPUs); rank 0 reports.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import shutil
import statistics
import tempfile
import time

import torch

import offload
from offload.cli.args import gpt_config, model_name, positive_int, seed
from offload.cli.progress import Progress
from offload.config import read_json
from offload.data import ByteBatches, stdlib_corpus
from offload.engine import human_bytes
from offload.errors import UsageError
from offload.models.gpt import GPT, SIZES, GPTConfig
from offload.zero import comm

EVAL_BATCHES = 4


def add_parser(commands: argparse._SubParsersAction) -> None:
    p = commands.add_parser("train", help="train the bundled GPT on the bundled text (the main job)",
                            description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=None, help="engine config, DeepSpeed-style JSON (default: stage 2, optimizer on NVMe)")
    p.add_argument("--model", type=model_name, default="5M", help=f"bundled size ({', '.join(SIZES)}; any case) or a JSON file of "
                   f"{', '.join(f.name for f in dataclasses.fields(GPTConfig))} (default 5M)")
    p.add_argument("--steps", type=positive_int, default=200, help="optimizer steps (default 200)")
    p.add_argument("--seq-len", type=positive_int, default=None, help="tokens per sequence (default: the model's block size)")
    p.add_argument("--batch-size", type=positive_int, default=None,
                   help="sequences per micro-batch per rank (default: the config's, else 8)")
    p.add_argument("--nvme-path", default=None, help="directory for swap files (default: a temporary directory, removed after)")
    p.add_argument("--seed", type=seed, default=0, help="seed for the weights and the batches (default 0)")
    p.add_argument("--out", default=None, help="directory for summary.json and loss.png (default runs/train-<time>)")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """Everything the user gave is checked before anything is created or trained."""
    model_config = gpt_config(args.model)
    seq_len = args.seq_len or model_config.block_size
    if seq_len > model_config.block_size:
        raise UsageError(f"--seq-len {seq_len} exceeds the model's block_size {model_config.block_size}; lower it")
    if model_config.vocab_size < 256:
        raise UsageError(f"--model: vocab_size {model_config.vocab_size} is below 256; the bundled text is bytes, "
                        f"so the model needs a vocabulary of at least 256")
    scratch = tempfile.mkdtemp(prefix="offload-train-") if args.nvme_path is None else None
    distributed = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    try:
        config = _engine_config(args, scratch)
        out_dir = args.out or os.path.join("runs", time.strftime("train-%Y%m%d-%H%M%S"))
        reporting = int(os.environ.get("RANK", "0")) == 0
        if reporting:
            _make_out_dir(out_dir)
        if distributed and not torch.distributed.is_initialized():
            _init_distributed()
        rank, world = comm.world()
        data = ByteBatches(stdlib_corpus(), seq_len, config.train_micro_batch_size_per_gpu, args.seed)
        summary = _train(args, model_config, config, data, rank, world)
        if reporting:
            _write_outputs(out_dir, summary)
            print(_report(summary, out_dir))
    finally:
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)
        if distributed and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    return 0


def _make_out_dir(out_dir: str) -> None:
    try:
        os.makedirs(out_dir, exist_ok=True)  # now, not after the run
    except OSError as exc:
        raise UsageError(f"--out {out_dir}: cannot create it ({exc.strerror}); choose another directory") from None


def _init_distributed() -> None:
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        torch.distributed.init_process_group("nccl")
    else:
        torch.distributed.init_process_group("gloo")


def default_config(nvme_path: str) -> dict:
    """ZeRO-Offload on one node: stage 2, the optimizer state on NVMe."""
    return {
        "train_micro_batch_size_per_gpu": 8,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 2e-3, "betas": [0.9, 0.95], "weight_decay": 0.01}},
        "bf16": {"enabled": torch.cuda.is_available()},
        "zero_optimization": {"stage": 2, "sub_group_size": 1_000_000,
                              "offload_optimizer": {"device": "nvme", "nvme_path": nvme_path}},
    }


def _engine_config(args: argparse.Namespace, scratch: str | None) -> offload.Config:
    """The config file (or the default) with --batch-size and --nvme-path applied, validated."""
    nvme = args.nvme_path or scratch
    if args.config is None:
        raw = default_config(nvme)
    else:
        raw = read_json(args.config)
        if not isinstance(raw, dict):  # checked here: the overrides below need a dict
            raise UsageError(f"--config {args.config}: must hold a JSON object of config keys, not a {type(raw).__name__}")
    if args.batch_size is not None:
        raw["train_micro_batch_size_per_gpu"] = args.batch_size
        raw.pop("train_batch_size", None)  # recomputed from the micro batch
    raw.setdefault("train_micro_batch_size_per_gpu", 8)
    zero = raw.get("zero_optimization", {})
    for key in ("offload_optimizer", "offload_param"):
        section = zero.get(key) if isinstance(zero, dict) else None
        if not isinstance(section, dict) or section.get("device") != "nvme":
            continue
        if args.nvme_path is not None or not section.get("nvme_path"):
            section["nvme_path"] = nvme
        elif not os.path.isdir(section["nvme_path"]):
            raise UsageError(f"zero_optimization.{key}.nvme_path {section['nvme_path']!r} is not a directory; "
                            f"create it, edit the config, or pass --nvme-path DIR")
    if args.nvme_path is not None and not os.path.isdir(args.nvme_path):
        raise UsageError(f"--nvme-path {args.nvme_path!r} is not a directory; create it first")
    return offload.Config.load(raw)


def _train(args, model_config: GPTConfig, config: offload.Config, data: ByteBatches, rank: int, world: int) -> dict:
    torch.manual_seed(args.seed)
    with offload.init(config):
        model = GPT(model_config)
    engine = offload.initialize(model, config, init_fn=model.init_module)
    accumulation = config.gradient_accumulation_steps
    tokens_per_step = data.batch_size * data.seq_len * accumulation * world
    evals = data.eval_batches(EVAL_BATCHES)
    rows, losses = [], []
    bar = Progress(args.steps, "train", enabled=rank == 0)
    try:
        eval_start = _evaluate(engine, evals)
        for step in range(args.steps):
            engine.lr = learning_rate(step, args.steps, config.optimizer.params.lr)
            start = time.perf_counter()
            read0, written0 = engine.disk_traffic()
            compute, loss_sum = 0.0, 0.0
            for micro in range(accumulation):
                t0 = time.perf_counter()
                loss = engine(data.batch(step, micro, rank).to(engine.device))
                engine.backward(loss)
                compute += time.perf_counter() - t0
                loss_sum += loss.item()
            engine.step()
            wall = time.perf_counter() - start
            detail = engine.times.optimizer_detail
            read1, written1 = engine.disk_traffic()
            mean = torch.tensor([loss_sum / accumulation], dtype=torch.float64, device=engine.device)  # NCCL: on the GPU
            mean_loss = comm.all_reduce(mean).item() / world
            row = {"wall": wall, "compute": compute, "optimizer": detail.get("adam", 0.0),
                   "swap": detail.get("swap_wait", 0.0) + detail.get("write_back_wait", 0.0),
                   "bytes_read": read1 - read0, "bytes_written": written1 - written0}
            row["other"] = max(0.0, wall - row["compute"] - row["optimizer"] - row["swap"])
            rows.append(row)
            losses.append(mean_loss)
            if step == 0:  # the tiers' sizes are set by then; a report waits for a delayed update in flight
                tiers = engine.memory_report().by_tier()
            bar.advance(f"loss {mean_loss:.3f} | {tokens_per_step / wall:,.0f} tok/s | compute {1e3 * compute:.0f}ms "
                        f"optim {1e3 * row['optimizer']:.0f}ms swap {1e3 * row['swap']:.0f}ms | "
                        + " ".join(f"{t} {human_bytes(b)}" for t, b in tiers.items()))
        eval_end = _evaluate(engine, evals)
        report = engine.memory_report()
    finally:
        engine.close()
    measured = rows[1:] or rows  # the first step also pays one-time costs
    return {
        "model": args.model, "model_config": dataclasses.asdict(model_config), "params": model_config.params(),
        "world_size": world, "steps": args.steps, "seq_len": data.seq_len, "micro_batch": data.batch_size,
        "accumulation": accumulation, "tokens_per_step": tokens_per_step, "seed": args.seed,
        "config": dataclasses.asdict(config), "losses": losses,
        "lr_schedule": "linear warm-up over the first tenth of the steps, cosine decay to a tenth of optimizer.params.lr",
        "eval_loss_start": eval_start, "eval_loss_end": eval_end,
        "tokens_per_s": tokens_per_step / statistics.median(r["wall"] for r in measured),
        "seconds_per_step": {k: statistics.median(r[k] for r in measured)
                             for k in ("wall", "compute", "optimizer", "swap", "other")},
        "disk_bytes_per_step": {k: statistics.median(r[k] for r in measured) for k in ("bytes_read", "bytes_written")},
        "memory": {f"{kind} | {tier}": v for (kind, tier), v in report.items()},
        "bytes_per_tier": report.by_tier(),
        "peak_bytes_per_tier": report.by_tier("peak_bytes"),
    }


def learning_rate(step: int, steps: int, peak: float) -> float:
    """Linear warm-up over the first tenth of the steps, then cosine decay to a tenth of the peak."""
    warmup = steps // 10
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def _evaluate(engine, batches: list[torch.Tensor]) -> float:
    with torch.no_grad():
        return statistics.fmean(engine(b.to(engine.device)).item() for b in batches)


def _write_outputs(out_dir: str, summary: dict) -> None:
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    _plot(summary, os.path.join(out_dir, "loss.png"))


def _plot(summary: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    losses = summary["losses"]
    steps = range(1, len(losses) + 1)
    fig, ax = plt.subplots(figsize=(7, 4.2))
    ax.plot(steps, losses, color="tab:blue", linewidth=1, alpha=0.45, label="training loss (per step)")
    window = max(1, len(losses) // 20)
    if window > 1:
        smooth = [statistics.fmean(losses[max(0, i - window + 1) : i + 1]) for i in range(len(losses))]
        ax.plot(steps, smooth, color="tab:blue", linewidth=2, label=f"training loss ({window}-step mean)")
    ax.scatter([0, len(losses)], [summary["eval_loss_start"], summary["eval_loss_end"]], color="tab:red",
               zorder=3, label="held-out loss")
    ax.set_xlabel(f"step ({summary['tokens_per_step']:,} tokens each)")
    ax.set_ylabel("cross-entropy (nats per byte)")
    z = summary["config"]["zero_optimization"]
    where = f"optimizer on {z['offload_optimizer']['device']}"
    if z["stage"] == 3:
        where += f", weights on {z['offload_param']['device']}"
    ax.set_title(f"offload train: GPT {summary['model']} ({summary['params'] / 1e6:.1f}M), "
                 f"ZeRO stage {z['stage']}, {where}, {summary['world_size']} rank(s)", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _report(s: dict, out_dir: str) -> str:
    t = s["seconds_per_step"]
    split = ", ".join(f"{k} {t[k]:.3f}s ({t[k] / t['wall']:.0%})" for k in ("compute", "optimizer", "swap", "other"))
    disk = s["disk_bytes_per_step"]
    peaks = ", ".join(f"{tier} {human_bytes(b)}" for tier, b in s["peak_bytes_per_tier"].items())
    return "\n".join([
        f"trained GPT {s['model']} ({s['params'] / 1e6:.2f}M parameters) for {s['steps']} steps on "
        f"{s['world_size']} rank(s), {s['tokens_per_step']:,} tokens per step",
        f"loss {s['losses'][0]:.3f} -> {s['losses'][-1]:.3f}; held-out {s['eval_loss_start']:.3f} -> {s['eval_loss_end']:.3f}",
        f"{s['tokens_per_s']:,.0f} tokens/s; median step {t['wall']:.3f}s: {split}",
        f"disk per step: {human_bytes(disk['bytes_read'])} read, {human_bytes(disk['bytes_written'])} written; "
        f"peak per tier (rank 0): {peaks}",
        f"summary: {os.path.join(out_dir, 'summary.json')}",
        f"loss curve: {os.path.join(out_dir, 'loss.png')}",
    ])
