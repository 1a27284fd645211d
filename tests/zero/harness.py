"""A small GPT-like model, its data, and plain-PyTorch reference training, for
comparing the engine with torch.optim.AdamW on an unpartitioned copy."""

from __future__ import annotations

import copy
import datetime
import json
import math
import os
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.multiprocessing as mp
import torch.utils.checkpoint

import offload
from offload.zero.overlap import OverlappedStep

VOCAB, DIM, SEQ, BATCH = 61, 24, 12, 3
Groups = Callable[[nn.Module], list[dict]]  # a model's parameter groups, as torch optimizers take them
# How long a rank waits in a collective for the other: ranks that disagree fail the test in minutes, where the
# engine's default comm_timeout_s (1800) would hang it for half an hour.
RANK_WAIT_S = 300


class TinyLM(nn.Module):
    """Embedding tied to the output head, narrow layers (little arithmetic per
    byte moved, so races between copies and updates would show), LayerNorm, a
    parameter registered on the root module, the first block called twice, and
    optionally activation checkpointing (non-reentrant) around every block."""

    def __init__(self, layers: int = 3, checkpoint: bool = False) -> None:
        super().__init__()
        self.checkpoint = checkpoint
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(DIM, DIM), nn.GELU()) for _ in range(layers))
        self.gain = nn.Parameter(torch.ones(DIM))
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.head.weight = self.embed.weight

    def _block(self, block: nn.Module, x: torch.Tensor) -> torch.Tensor:
        if self.checkpoint:
            return x + torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
        return x + block(x)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:  # (B, T) -> scalar loss
        x = self.embed(tokens[:, :-1])  # (B, T-1, C)
        x = self._block(self.blocks[0], x)
        for block in self.blocks:
            x = self._block(block, x)
        logits = self.head(self.norm(x * self.gain))  # (B, T-1, V)
        return F.cross_entropy(logits.float().reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))


def make_model(seed: int = 0, checkpoint: bool = False) -> TinyLM:
    torch.manual_seed(seed)
    return TinyLM(checkpoint=checkpoint)


def batch(step: int, micro: int, rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1_000_003 * step + 1009 * micro + rank)
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)


def config(stage: int, device: str, accumulation: int, nvme_path: str | None = None, param_device: str | None = None,
           **extra) -> dict:
    offload_optimizer = {"device": device, **({"nvme_path": nvme_path} if nvme_path else {})}
    offload_optimizer.update(extra.pop("offload_optimizer", {}))
    cfg = {
        "train_micro_batch_size_per_gpu": BATCH,
        "gradient_accumulation_steps": accumulation,
        "gradient_clipping": 0.5,
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "betas": [0.9, 0.99], "eps": 1e-8, "weight_decay": 0.01}},
        "zero_optimization": {"stage": stage, "sub_group_size": 700, "reduce_bucket_size": 1500,
                              "offload_optimizer": offload_optimizer},
        "aio": {"block_size": 8192, "queue_depth": 4},
        "comm_timeout_s": RANK_WAIT_S,
    }
    if param_device is not None:
        cfg["zero_optimization"]["offload_param"] = {"device": param_device, **({"nvme_path": nvme_path, "max_in_cpu": 0} if param_device == "nvme" else {})}
        cfg["zero_optimization"]["stage3_param_persistence_threshold"] = 30  # LayerNorm and biases stay gathered
    cfg.update(extra)
    return cfg


def train_reference(model: nn.Module, steps: int, world: int, accumulation: int, cfg: dict,
                    moment_dtype: torch.dtype = torch.float32, groups: Groups | None = None) -> nn.Module:
    """``groups(model)``: the optimizer's parameter groups (default: one).
    AdamW, or Adam with L2 decay when the config's ``adam_w_mode`` is false."""
    ref = copy.deepcopy(model)
    p = cfg["optimizer"]["params"]
    cls = torch.optim.AdamW if p.get("adam_w_mode", True) else torch.optim.Adam
    opt = cls(groups(ref) if groups else ref.parameters(), lr=p["lr"], betas=tuple(p["betas"]), eps=p["eps"],
              weight_decay=p["weight_decay"], foreach=False)
    ref.grad_norms = []  # before clipping, as the engine's last_grad_norm
    for step in range(steps):
        opt.zero_grad()
        for rank in range(world):
            for micro in range(accumulation):
                (ref(batch(step, micro, rank)) / (world * accumulation)).backward()
        ref.grad_norms.append(torch.nn.utils.clip_grad_norm_(ref.parameters(), cfg["gradient_clipping"] or math.inf).item())
        opt.step()
        if moment_dtype != torch.float32:
            _round_moments(opt, moment_dtype)
    return ref


def _round_moments(opt: torch.optim.Optimizer, dtype: torch.dtype) -> None:
    """Moments stored in ``dtype`` after each step, the step itself in fp32 (Note [state format])."""
    for state in opt.state.values():
        for key in ("exp_avg", "exp_avg_sq"):
            state[key].copy_(state[key].to(dtype))


def train_engine(model: nn.Module, steps: int, accumulation: int, cfg: dict, rank: int = 0,
                 groups: Groups | None = None) -> offload.Engine:
    engine = offload.initialize(model, cfg, param_groups=groups(model) if groups else None)
    for step in range(steps):
        for micro in range(accumulation):
            engine.backward(engine(batch(step, micro, rank)))
            engine.step()
    return engine


def max_difference(engine_state: dict, ref: nn.Module) -> float:
    ref_state = ref.state_dict()
    return max((engine_state[k].float() - ref_state[k].float()).abs().max().item() for k in ref_state)


def let_the_worker_finish(patch: Callable[[Any, str, Any], None] = setattr) -> None:
    """Note [what the worker has not started]: joining the overlapped step's
    worker takes back the sub-groups it has not started, so how many it
    stepped depends on timing. Tests that count them (kept, rollbacks) have
    every join wait for the worker to work through its queue first.
    ``patch``: a monkeypatch's setattr, or setattr itself in a spawned rank."""
    join = OverlappedStep._join

    def after_the_queue(self) -> None:
        self._worker.submit(lambda: None).result()  # one worker thread: its queue, in order
        join(self)

    patch(OverlappedStep, "_join", after_the_queue)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_gloo(rank: int, world: int, port: int) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                         timeout=datetime.timedelta(seconds=RANK_WAIT_S))


def spawn_ranks(worker: Callable[[int, int, str], None], out_dir: Path, world: int = 2) -> list[Any]:
    """Run ``worker(rank, port, out_dir)`` on ``world`` gloo ranks; each rank's ``finish_rank`` result, by rank."""
    mp.spawn(worker, args=(free_port(), str(out_dir)), nprocs=world)
    return [json.loads((Path(out_dir) / f"rank{rank}.json").read_text()) for rank in range(world)]


def each_tier(rank: int, port: int, out_dir: str, tiers: tuple[str, ...], check: Callable[[str, str], Any]) -> NoReturn:
    """A two-rank ``spawn_ranks`` worker's body: ``check(tier, nvme_dir)`` for
    each tier, with a swap directory of this rank's own, results by tier."""
    init_gloo(rank, 2, port)
    results = {}
    for tier in tiers:
        nvme = os.path.join(out_dir, f"nvme{rank}-{tier}")
        os.makedirs(nvme)
        results[tier] = check(tier, nvme)
    finish_rank(out_dir, rank, results)


def finish_rank(out_dir: str, rank: int, result: Any) -> NoReturn:
    """Hand ``result`` to ``spawn_ranks`` and leave. Interpreter teardown is
    skipped: gloo's background threads occasionally abort the process there
    ("terminate called without an active exception") after all work is done;
    every engine is closed by then and the result is on disk."""
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    torch.distributed.destroy_process_group()
    os._exit(0)


TWO_RANK_ADAMW = {"lr": 1e-2, "betas": [0.9, 0.99], "eps": 1e-8, "weight_decay": 0.01}


def two_rank_adamw(model: nn.Module, steps: int, backward: Callable[[nn.Module, int], None],
                   clip: float | None = None) -> nn.Module:
    """torch's AdamW (``TWO_RANK_ADAMW``) trained on a copy of ``model``, each step after
    ``backward(copy, step)`` has run every rank's micro-batches on it: a parameter
    no rank reached steps with a zero gradient (DeepSpeed's and DDP's meaning)."""
    ref = copy.deepcopy(model)
    p = TWO_RANK_ADAMW
    opt = torch.optim.AdamW(ref.parameters(), lr=p["lr"], betas=tuple(p["betas"]), eps=p["eps"],
                            weight_decay=p["weight_decay"], foreach=False)
    for step in range(steps):
        opt.zero_grad()
        backward(ref, step)
        for param in ref.parameters():
            if param.grad is None:
                param.grad = torch.zeros_like(param)
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(ref.parameters(), clip)
        opt.step()
    return ref
