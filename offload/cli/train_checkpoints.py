"""``offload train --save/--resume``: where a run's checkpoints go, and what a
run resumed from one must agree with.

A checkpoint of ``offload train`` keeps, beside the engine's state, the run's
own (``client_state["offload_train"]``): the model's shape, the losses so far
and the held-out loss it started from. The batches are a function of the
step, the seed, the sequence length and the micro batch (``ByteBatches``) and
the learning rate one of the step and ``--steps``, so a run resumed with the
options it was saved with takes the steps the run that saved it took after
the save, bit for bit (the same as a run that never saved, except with
``delayed_update``: a save applies the update in flight at once, as
DeepSpeed's does). Other options are taken as given (a longer ``--steps``
extends the schedule), with a warning naming each that differs from the
saved run's; a different model is refused.
"""

from __future__ import annotations

import dataclasses
import os

from offload import checkpoint
from offload.checkpoint.format import MANIFEST
from offload.destinations import directory_problem
from offload.errors import UsageError
from offload.models.gpt import GPTConfig

KEY = "offload_train"


@dataclasses.dataclass(frozen=True)
class Resumed:
    directory: str  # the checkpoint's own directory
    step: int  # steps taken before it
    losses: list[float]
    eval_loss_start: float
    options: dict  # the saved run's (``RUN_OPTIONS``)


def resumed(path: str | None, model: GPTConfig, steps: int) -> Resumed | None:
    """The checkpoint ``--resume`` names (a checkpoint, or a save directory whose
    ``latest`` names one), checked against this run before anything is built."""
    if path is None:
        return None
    try:
        directory = checkpoint.resolve(path)
        manifest = checkpoint.read_manifest(directory)
    except checkpoint.CheckpointError as exc:
        raise UsageError(f"--resume: {exc}") from None
    state = manifest.client_state.get(KEY)
    if not isinstance(state, dict):
        raise UsageError(f"--resume {path}: {directory} was not saved by offload train; start from its weights "
                         "in your own script instead (offload.initialize(model, config, weights=...) after "
                         "offload export)")
    if state["model_config"] != dataclasses.asdict(model):
        raise UsageError(f"--resume {path}: the checkpoint holds a GPT of {state['model_config']}, and --model gives "
                         f"{dataclasses.asdict(model)}; pass the --model it was trained with")
    step = manifest.training.global_steps
    if step >= steps:
        raise UsageError(f"--resume {path}: the checkpoint is at step {step}, so --steps {steps} leaves nothing to "
                         "train; raise --steps")
    return Resumed(directory, step, list(state["losses"]), state["eval_loss_start"], state.get("options", {}))


def save_steps(save_dir: str | None, interval: int | None, start: int, steps: int) -> list[int]:
    """The steps after which the run saves (every ``interval``, and the last),
    checked now: the directory can be written, and holds none of those tags
    (a run does not replace another run's checkpoints, as the engine would)."""
    if save_dir is None:
        if interval is not None:
            raise UsageError("--save-interval needs --save DIR, the directory its checkpoints go to")
        return []
    problem = directory_problem(save_dir, with_parents=True)
    if problem:
        raise UsageError(f"--save {save_dir}: {problem}")
    if os.path.isfile(os.path.join(save_dir, MANIFEST)):
        raise UsageError(f"--save {save_dir} is a checkpoint itself; name the directory checkpoints go in "
                         f"({os.path.dirname(os.path.abspath(save_dir))}, say)")
    at = sorted({*range(interval, steps + 1, interval), steps} if interval else {steps})
    at = [s for s in at if s > start]
    taken = [tag(s) for s in at if os.path.isfile(os.path.join(save_dir, tag(s), MANIFEST))]
    if taken:
        raise UsageError(f"--save {save_dir} holds {', '.join(taken)} already, which this run would write; "
                         "offload train does not replace another run's checkpoints: choose another directory or remove them")
    return at


def tag(step: int) -> str:
    """The engine's default tag, so the directory reads as DeepSpeed's."""
    return f"global_step{step}"


# What the steps taken depend on, beside the model, each with what a change does.
RUN_OPTIONS = {
    "steps": "--steps: the learning rate's warm-up and decay follow it",
    "seed": "--seed: other batches",
    "seq_len": "--seq-len: other batches",
    "micro_batch": "--batch-size or the config: other batches",
    "accumulation": "the config's batch sizes: other steps",
    "world_size": "the ranks: other batches",
    "lr": "the config's optimizer.params.lr",
    "weight_decay": "the config's optimizer.params.weight_decay",
}


def changed_options(saved: dict, now: dict) -> str | None:
    """The options of this run that differ from the saved run's, said; None if none."""
    changed = [f"{RUN_OPTIONS[k]} ({saved[k]} then, {now[k]} now)" for k in RUN_OPTIONS
               if k in saved and saved[k] != now[k]]
    if not changed:
        return None
    return ("offload train --resume: this run's options differ from those of the run it resumes, so its steps are "
            "not those that run would have taken: " + "; ".join(changed))


def client_state(model: GPTConfig, losses: list[float], eval_loss_start: float, options: dict) -> dict:
    return {KEY: {"model_config": dataclasses.asdict(model), "losses": losses, "eval_loss_start": eval_loss_start,
                  "options": options}}
