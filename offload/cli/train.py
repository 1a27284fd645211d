"""``offload train``: train the bundled GPT on the bundled text, end to end.

With no arguments: a 4.8M-parameter byte-level GPT (``--model 5M``) learns
to write Python from the standard library's own sources (nothing is
downloaded), with the config ``configs/train_default.json``: ZeRO stage 2 and
the optimizer state on NVMe, in a temporary directory that is removed
afterwards. ``--config`` takes any engine config (``configs/`` has ready
ones); the options below override its batch size and NVMe paths. The default
config sets no precision: the run computes in bf16 where CUDA is available,
else in fp32; a config given with --config is taken as it is. The first line
of output names the config, the swap directory and the output directory.

The learning rate warms up linearly over the first tenth of the steps, then
decays along a cosine to a tenth of the config's ``optimizer.params.lr``,
unless the config has a ``scheduler`` section: then that schedule sets it.
The config's weight decay applies to the weight matrices only, as in GPT-2
recipes: biases and norm gains take none.
The progress bar shows the loss, tokens/s, the step time split into compute
(forward and backward), optimizer (``step()``: the CPU Adam, the gradient's
norm, handing the weights over, and waiting for a worker, whatever the
worker waited for), swap (``step()`` waiting for the disk itself) and the rest
(the loss's all-reduce, the report), and the bytes held per tier; the
optimizer work a worker did beside compute (``overlap_step``,
``delayed_update``) is given apart, as it is not in the step's time. At the end, a summary JSON and a
loss-curve PNG are written to --out. The summary's figures are the median
step's, its disk bytes those of a step; steps skipped for an fp16 overflow
are counted and said, and left out of both. Under ``torchrun --nproc_per_node N -m
offload train`` every rank trains on different batches (gloo on CPU, NCCL on
GPUs); rank 0 reports.

``--save DIR`` writes checkpoints (at the end; every ``--save-interval``
steps too), and ``--resume`` continues a run from one: ``train_checkpoints``.

Ctrl-C stops the run: the swap files go, and so does an --out directory the
run made and left empty; one line says so, naming the newest checkpoint, and
the exit status is 130.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import signal
import statistics
import sys
import tempfile
import time
import warnings

import torch

import offload
from offload.cli.args import gpt_config, model_name, positive_int, seed
from offload.cli.interrupt import Sigint
from offload.cli.progress import Progress
from offload.cli.train_checkpoints import Resumed, changed_options, client_state, resumed, save_steps, tag
from offload.config import nvme_sections, read_json
from offload.data import ByteBatches, stdlib_corpus
from offload.errors import UsageError
from offload.models.gpt import GPT, SIZES, GPTConfig
from offload.report import human_bytes, process_memory
from offload.zero import comm

EVAL_BATCHES = 4
DEFAULT_CONFIG = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                              "configs", "train_default.json")


def add_parser(commands: argparse._SubParsersAction) -> None:
    p = commands.add_parser("train", help="train the bundled GPT on the bundled text (the main job)",
                            description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=None, help="engine config, DeepSpeed-style JSON "
                   f"(default {_shown(DEFAULT_CONFIG)}: stage 2, optimizer on NVMe)")
    p.add_argument("--model", type=model_name, default="5M",
                   help=f"bundled size ({', '.join(SIZES)}; any case) or a JSON file of "
                   f"{', '.join(f.name for f in dataclasses.fields(GPTConfig))} (default 5M)")
    p.add_argument("--steps", type=positive_int, default=200, help="optimizer steps (default 200)")
    p.add_argument("--seq-len", type=positive_int, default=None, help="tokens per sequence (default: the model's block size)")
    p.add_argument("--batch-size", type=positive_int, default=None,
                   help="sequences per micro-batch per rank (default: the config's, else 8); a config's "
                        "train_batch_size stands, and the accumulation steps follow from it")
    p.add_argument("--nvme-path", default=None, help="directory for swap files (default: the config's nvme_path, else "
                   f"a directory of their own in {tempfile.gettempdir()}, removed after)")
    p.add_argument("--seed", type=seed, default=0, help="seed for the weights and the batches (default 0)")
    p.add_argument("--out", default=None, help="directory for summary.json and loss.png (default runs/train-<time>)")
    p.add_argument("--save", metavar="DIR", default=None,
                   help="save a checkpoint under DIR at the end (tag global_step<N>), for --resume and offload export")
    p.add_argument("--save-interval", metavar="N", type=positive_int, default=None,
                   help="with --save: a checkpoint every N steps too")
    p.add_argument("--resume", metavar="CHECKPOINT", default=None,
                   help="continue a run from a checkpoint it saved (a checkpoint directory, or a --save DIR whose "
                        "latest names one) up to --steps; with the options it was saved with, the steps taken are "
                        "those of the run uninterrupted")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """Everything the user gave is checked before anything is created or trained.
    What the run makes goes again when it fails or is interrupted: Note [Ctrl-C]."""
    model_config = gpt_config(args.model)
    seq_len = args.seq_len or model_config.block_size
    if seq_len > model_config.block_size:
        raise UsageError(f"--seq-len {seq_len} exceeds the model's block_size {model_config.block_size}; lower it")
    if model_config.vocab_size < 256:
        raise UsageError(f"--model: vocab_size {model_config.vocab_size} is below 256; the bundled text is bytes, "
                        f"so the model needs a vocabulary of at least 256")
    raw = _raw_config(args)
    resume = resumed(args.resume, model_config, args.steps)
    saves = save_steps(args.save, args.save_interval, resume.step if resume else 0, args.steps)
    made = _Made(reporting=int(os.environ.get("RANK", "0")) == 0)
    sigint = Sigint()
    try:
        try:
            summary = _run(args, model_config, seq_len, raw, made, resume, saves)
        finally:
            sigint.armed = False  # first, before any call: Note [Ctrl-C]
            made.remove()
    except BaseException:
        status = sigint.finish()
        if status is None:
            raise
        if made.reporting:  # one line for the run, not one per rank
            if made.bar is not None:
                made.bar.end_line()
            print(f"offload train: {made.interrupted()}{_sent_by_torchrun(status)}", file=sys.stderr, flush=True)
        return status
    sigint.finish()
    if made.reporting:
        print(_report(summary, made.out))
    return 0


@dataclasses.dataclass
class _Made:
    """What a run has made so far, removed again at its end (finished, failed or interrupted)."""

    reporting: bool  # rank 0: it makes --out, writes the results, and speaks
    out: str | None = None
    swap_dir: str | None = None  # where the swap files go, in a directory of their own
    out_dirs: list[str] = dataclasses.field(default_factory=list)  # --out and the parents made for it, innermost first
    temporary: bool = False  # the swap files' run directory is in the temporary directory
    engine: offload.Engine | None = None  # its close() removes its swap files
    process_group: bool = False
    bar: Progress | None = None
    checkpoints: list[str] = dataclasses.field(default_factory=list)  # --save's, oldest first: they stay
    first_step: int = 0  # where a resumed run took up
    resumed_from: str | None = None  # the checkpoint it took up from
    saving: bool = False  # --save given

    def remove(self) -> None:
        with contextlib.ExitStack() as stack:  # last in, first out; each runs even if one before it raised
            if self.process_group:
                stack.callback(torch.distributed.destroy_process_group)
            stack.callback(_remove_if_empty, self.out_dirs)
            if self.engine is not None:
                # No rank-wide gathering of the model back: nothing uses it after
                # the run, and after a failure or Ctrl-C other ranks may be gone.
                stack.callback(self.engine.close, restore_model=False)

    def interrupted(self) -> str:
        at = (f"after step {self.first_step + self.bar.done} of {self.first_step + self.bar.total}"
              if self.bar is not None else "before training")
        gone = ["its swap files"] if self.swap_dir is not None else []
        gone += [f"the empty {self.out_dirs[0]}"] if self.out_dirs and not os.path.exists(self.out_dirs[0]) else []
        if self.checkpoints:
            kept = f"; the last checkpoint, {self.checkpoints[-1]}, takes --resume"
        elif self.resumed_from is not None:
            kept = f"; nothing saved since {self.resumed_from}" + ("" if self.saving else " (--save DIR keeps a run's steps)")
        else:
            kept = ""
        return f"interrupted {at}; " + (f"removed {' and '.join(gone)}" if gone else "nothing to remove") + kept


def _sent_by_torchrun(status: int) -> str:
    """torchrun sends SIGTERM to every rank when one has failed, and so a
    rank waiting on a dead one is interrupted before its collective fails:
    say where the failure is told (a SIGTERM sent to the ranks themselves,
    by a scheduler, reads alike: hence no claim of where it came from)."""
    if status != 128 + signal.SIGTERM or "TORCHELASTIC_RUN_ID" not in os.environ:
        return ""
    return ("; under torchrun a SIGTERM is what it sends every rank when one has failed (its report names the "
            "rank and its exit status), or when it is stopped itself")


def _remove_if_empty(dirs: list[str]) -> None:
    for d in dirs:
        try:
            os.rmdir(d)
        except OSError:  # not empty (it holds the results), or gone
            return


def _run(args, model_config: GPTConfig, seq_len: int, raw: dict, made: _Made, resume: Resumed | None,
         saves: list[int]) -> dict:
    made.swap_dir = _place_swap_files(args, raw, made)
    config = offload.Config.load(raw)
    made.out = args.out or os.path.join("runs", time.strftime("train-%Y%m%d-%H%M%S"))
    if made.reporting:
        made.out_dirs = _make_out_dir(made.out)  # now, not after the run
        print(_header(args, config, made), file=sys.stderr, flush=True)
    made.process_group = comm.join_the_launch(config.comm_timeout_s)
    rank, world = comm.world()
    data = ByteBatches(stdlib_corpus(), seq_len, config.batch(world).micro, args.seed)
    summary = _train(args, model_config, config, data, rank, world, made, resume, saves)
    if made.reporting:
        _write_outputs(made.out, summary)
    return summary


def _make_out_dir(out_dir: str) -> list[str]:
    """Makes --out (and its missing parents); those it made, innermost first."""
    made, d = [], os.path.abspath(out_dir)
    while not os.path.exists(d):
        made.append(d)
        d = os.path.dirname(d)
    try:
        os.makedirs(out_dir, exist_ok=True)
    except OSError as exc:
        raise UsageError(f"--out {out_dir}: cannot create it ({exc.strerror}); choose another directory") from None
    return [_shown(d) for d in made]


def _raw_config(args: argparse.Namespace) -> dict:
    """The config file with --batch-size applied, its precision chosen, and its NVMe paths checked."""
    path = args.config or DEFAULT_CONFIG
    raw = read_json(path)
    if not isinstance(raw, dict):  # checked here: the overrides below need a dict
        raise UsageError(f"--config {path}: must hold a JSON object of config keys, not a {type(raw).__name__}")
    if args.batch_size is not None:
        raw["train_micro_batch_size_per_gpu"] = args.batch_size
        if "train_batch_size" in raw:  # the config's global batch stands; the accumulation follows from it
            raw.pop("gradient_accumulation_steps", None)
    if "train_batch_size" not in raw:  # else it gives the micro batch, or the accumulation (Note [batch sizes])
        raw.setdefault("train_micro_batch_size_per_gpu", 8)
    if args.config is None:  # the default config: bf16 where CUDA can compute in it
        raw["bf16"] = {"enabled": torch.cuda.is_available()}
    if args.nvme_path is not None and not os.path.isdir(args.nvme_path):
        raise UsageError(f"--nvme-path {args.nvme_path!r} is not a directory; create it first")
    for key, section in nvme_sections(raw):
        if args.nvme_path is None and section.get("nvme_path") and not os.path.isdir(section["nvme_path"]):
            raise UsageError(f"zero_optimization.{key}.nvme_path {section['nvme_path']!r} is not a directory; "
                            f"create it, edit the config, or pass --nvme-path DIR")
    return raw


def _place_swap_files(args: argparse.Namespace, raw: dict, made: _Made) -> str | None:
    """Fills in the NVMe sections' paths: --nvme-path, else the config's (a section
    without one shares the other's disk), else the temporary directory, where the store's run directory is found by the next
    store's warning and by offload clean as anywhere (Note [run directory
    ownership]); the directory the swap files go under, if any."""
    sections = [section for _, section in nvme_sections(raw)]
    if args.nvme_path is not None:
        for section in sections:
            section["nvme_path"] = args.nvme_path
    elif any(not section.get("nvme_path") for section in sections):
        given = next((section["nvme_path"] for section in sections if section.get("nvme_path")), None)
        made.temporary = given is None  # else the section without a path shares the other's disk
        for section in sections:
            section["nvme_path"] = section.get("nvme_path") or given or tempfile.gettempdir()
    return next((section["nvme_path"] for section in sections), None)


def _header(args: argparse.Namespace, config: offload.Config, made: _Made) -> str:
    """The first line: which config, where the swap files and the results go."""
    if made.swap_dir is None:
        swap = "no swap files (nothing on NVMe)"
    elif made.temporary:
        ranks = "; each rank has its own" if int(os.environ.get("WORLD_SIZE", "1")) > 1 else ""
        swap = (f"swap files in a directory of their own in {made.swap_dir} (temporary, removed at the end{ranks}; "
                f"a killed run's: offload clean --nvme-path {made.swap_dir})")
    else:
        swap = f"swap files under {made.swap_dir} (in a directory of their own, removed at the end)"
    z = config.zero_optimization
    return (f"offload train: config {_shown(args.config or DEFAULT_CONFIG)} (ZeRO stage {z.stage}, optimizer on "
            f"{_tier(z.offload_optimizer.device)}, {config.compute_dtype_name} compute); {swap}; results in {made.out}")


def _tier(device: str) -> str:
    """offload_*.device as a place: "none" keeps the state on the accelerator."""
    return "the accelerator" if device == "none" else device


def _shown(path: str) -> str:
    """``path`` relative to the working directory when it lies below it, else absolute."""
    path = os.path.abspath(path)
    return os.path.relpath(path) if path.startswith(os.getcwd() + os.sep) else path


def _train(args, model_config: GPTConfig, config: offload.Config, data: ByteBatches, rank: int, world: int,
           made: _Made, resume: Resumed | None, saves: list[int]) -> dict:
    torch.manual_seed(args.seed)
    with offload.init(config):
        model = GPT(model_config)
    # As GPT-2 recipes do: weight decay on the matrices, none on biases and norm gains.
    groups = [{"params": [p for p in model.parameters() if p.dim() >= 2]},
              {"params": [p for p in model.parameters() if p.dim() < 2], "weight_decay": 0.0}]
    engine = made.engine = offload.initialize(model, config, init_fn=model.init_module, param_groups=groups)
    accumulation = engine.accumulation
    tokens_per_step = data.batch_size * data.seq_len * accumulation * world
    evals = data.eval_batches(EVAL_BATCHES)
    rows, losses, checkpoints = [], [], made.checkpoints
    options = {"steps": args.steps, "seed": args.seed, "seq_len": data.seq_len, "micro_batch": data.batch_size,
               "accumulation": accumulation, "world_size": world, "lr": config.optimizer.params.lr,
               "weight_decay": config.optimizer.params.weight_decay}
    start_step = 0
    if resume is None:
        eval_start = _evaluate(engine, evals)
    else:
        with warnings.catch_warnings():  # the rate is set before each step below, from the step
            warnings.filterwarnings("ignore", "load_checkpoint: the learning rate resumes")
            engine.load_checkpoint(os.path.dirname(resume.directory), os.path.basename(resume.directory))
        start_step, losses, eval_start = resume.step, list(resume.losses), resume.eval_loss_start
        changed = changed_options(resume.options, options)
        if changed and made.reporting:
            warnings.warn(changed, UserWarning, stacklevel=1)
    bar = made.bar = Progress(args.steps - start_step, "train", enabled=rank == 0)
    made.first_step, made.resumed_from, made.saving = start_step, resume and resume.directory, bool(saves)
    engine.synchronize()  # the initial state's writes are initialize's, not a step's
    disk_from = engine.disk_traffic()
    for step in range(start_step, args.steps):
        if engine.schedule is None:
            engine.lr = learning_rate(step, args.steps, config.optimizer.params.lr)
        start = time.perf_counter()
        compute, loss_sum = 0.0, 0.0
        for micro in range(accumulation):
            t0 = time.perf_counter()
            loss = engine(data.batch(step, micro, rank).to(engine.device))
            engine.backward(loss)
            compute += time.perf_counter() - t0
            loss_sum += loss.item()
        t0 = time.perf_counter()
        engine.step()
        step_s = time.perf_counter() - t0
        mean = torch.tensor([loss_sum / accumulation], dtype=torch.float64, device=engine.device)  # NCCL: on the GPU
        mean_loss = comm.all_reduce(mean).item() / world
        wall = time.perf_counter() - start
        row = {"wall": wall, "compute": compute, **_step_split(engine, step_s), "other": wall - compute - step_s,
               "applied": engine.was_step_applied()}  # not skipped for an fp16 overflow
        rows.append(row)
        losses.append(mean_loss)
        if step == start_step:  # the tiers' sizes are set by then; a report waits for a delayed update in flight
            tiers = engine.memory_report().by_tier()
        beside = f" (+{1e3 * row['optimizer_hidden']:.0f}ms beside)" if row["optimizer_hidden"] else ""
        bar.advance(f"loss {mean_loss:.3f} | {tokens_per_step / wall:,.0f} tok/s | compute {1e3 * compute:.0f}ms "
                    f"optim {1e3 * row['optimizer']:.0f}ms{beside} swap {1e3 * row['swap']:.0f}ms | "
                    + " ".join(f"{t} {human_bytes(b)}" for t, b in tiers.items()))
        if step + 1 in saves:  # after the step's figures: a save is no step's work, nor are its reads
            engine.synchronize()  # the step's own write-backs count as the step's
            before = engine.disk_traffic()
            checkpoints.append(engine.save_checkpoint(args.save, tag(step + 1),
                                                      client_state(model_config, losses, eval_start, options)))
            disk_from += engine.disk_traffic() - before
    engine.synchronize()  # the last step's write-backs, so that they count
    disk = engine.disk_traffic() - disk_from
    eval_end = _evaluate(engine, evals)
    report = engine.memory_report()
    # As the disk's figures: a step skipped for an fp16 overflow steps no state.
    after_first = rows[1:] or rows
    measured = [r for r in after_first if r["applied"]] or after_first
    applied = max(1, sum(r["applied"] for r in rows))
    median = sorted(measured, key=lambda r: r["wall"])[len(measured) // 2]  # one step's split, so its parts add up
    return {
        "model": args.model, "model_config": dataclasses.asdict(model_config), "params": model_config.params(),
        "world_size": world, "steps": args.steps, "seq_len": data.seq_len, "micro_batch": data.batch_size,
        "accumulation": accumulation, "tokens_per_step": tokens_per_step, "seed": args.seed,
        "config": dataclasses.asdict(config), "losses": losses,
        "resumed_from": None if resume is None else {"checkpoint": resume.directory, "step": start_step},
        "checkpoints": checkpoints,
        "lr_schedule": f"the config's scheduler, {config.scheduler.type}" if engine.schedule else
                       "linear warm-up over the first tenth of the steps, cosine decay to a tenth of optimizer.params.lr",
        "weight_decay": f"{config.optimizer.params.weight_decay} on weight matrices, none on biases and norm gains",
        "eval_loss_start": eval_start, "eval_loss_end": eval_end,
        "tokens_per_s": tokens_per_step / median["wall"],
        "seconds_per_step": {k: median[k] for k in ("wall", "compute", "optimizer", "swap", "other", "optimizer_hidden")},
        # This rank's, per step applied, over all steps (each step's write-backs finish during the next).
        # bytes_kept: what a read would have brought that a write-back still held, so it was not read; how much
        # depends on how far write-backs had got, so read + kept is what a step needs, not read alone.
        "disk_bytes_per_step": {"bytes_read": disk.bytes_read / applied, "bytes_written": disk.bytes_written / applied,
                                "bytes_kept": disk.bytes_kept / applied},
        "skipped_steps": engine.skipped_steps, "loss_scale": engine.loss_scale,  # a resumed run's too
        "memory": {f"{kind} | {tier}": v for (kind, tier), v in report.items()},
        "bytes_per_tier": report.by_tier(),
        "peak_bytes_per_tier": report.by_tier("peak_bytes"),
        # All this process held at once, torch and activations and what glibc kept included (offload plan's figure).
        "peak_rss_bytes": process_memory()[1],
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
    where = f"optimizer on {_tier(z['offload_optimizer']['device'])}"
    if z["stage"] == 3:
        where += f", weights on {_tier(z['offload_param']['device'])}"
    ax.set_title(f"offload train: GPT {summary['model']} ({summary['params'] / 1e6:.1f}M), "
                 f"ZeRO stage {z['stage']}, {where}, {summary['world_size']} rank(s)", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _step_split(engine, step_s: float) -> dict:
    """``step()``'s seconds split into its waits for the disk (``swap``) and the
    rest (``optimizer``, waiting for a worker included), and the optimizer's
    work a worker did beside compute instead (``optimizer_hidden``: the
    overlapped step's during backward, the delayed update's during the next
    forward and backward)."""
    detail = engine.times.optimizer_detail
    # A delayed update's detail is its worker's, whose disk waits were beside compute (or in the wait for it).
    swap = 0.0 if engine.update.ahead else detail.get("swap_wait", 0.0) + detail.get("write_back_wait", 0.0)
    return {"optimizer": step_s - swap, "swap": swap, "optimizer_hidden": engine.times.hidden}


def _report(s: dict, out_dir: str) -> str:
    t = s["seconds_per_step"]
    split = ", ".join(f"{k} {t[k]:.3f}s ({t[k] / t['wall']:.0%})" for k in ("compute", "optimizer", "swap", "other"))
    if t["optimizer_hidden"]:
        split += f"; beside compute, {t['optimizer_hidden']:.3f}s more of optimizer work"
    disk = s["disk_bytes_per_step"]
    kept = f" (and {human_bytes(disk['bytes_kept'])} found still in write-back buffers)" if disk["bytes_kept"] else ""
    peaks = ", ".join(f"{tier} {human_bytes(b)}" for tier, b in s["peak_bytes_per_tier"].items())
    of_rank_0 = " (rank 0)" if s["world_size"] > 1 else ""  # each rank holds and moves as much
    process = "the whole process" if s["world_size"] == 1 else "rank 0's whole process"
    resumed = s["resumed_from"]
    steps = f"{s['steps']} steps" if resumed is None else \
        f"steps {resumed['step'] + 1}-{s['steps']} (resumed from {resumed['checkpoint']})"
    return "\n".join([
        f"trained GPT {s['model']} ({s['params'] / 1e6:.2f}M parameters) for {steps} on "
        f"{s['world_size']} rank(s), {s['tokens_per_step']:,} tokens per step",
        f"loss {s['losses'][0]:.3f} -> {s['losses'][-1]:.3f}; held-out {s['eval_loss_start']:.3f} -> {s['eval_loss_end']:.3f}",
        f"{s['tokens_per_s']:,.0f} tokens/s; median step {t['wall']:.3f}s: {split}",
        *([f"{s['skipped_steps']} of {s['steps']} steps skipped for an fp16 overflow (not in the figures above); "
           f"loss scale now {s['loss_scale']:g}"] if s["skipped_steps"] else []),
        f"disk per step{of_rank_0}: {human_bytes(disk['bytes_read'])} read{kept}, "
        f"{human_bytes(disk['bytes_written'])} written; peak per tier{of_rank_0}: "
        f"{peaks}; {process} at most {human_bytes(s['peak_rss_bytes'])} (RSS)",
        f"summary: {os.path.join(out_dir, 'summary.json')}",
        f"loss curve: {os.path.join(out_dir, 'loss.png')}",
        *([f"checkpoint: {s['checkpoints'][-1]} (offload train --resume it; offload export it --out FILE.safetensors)"]
          if s["checkpoints"] else []),
    ])
