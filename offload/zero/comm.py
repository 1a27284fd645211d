"""The collectives the engine uses, on a group of all ranks of its own.

With no process group (world size 1) each is the local identity, so a single
process needs no ``init_process_group``. gloo on CPU and NCCL on GPUs both
implement the tensor forms used here.

Note [dying ranks]
The engine's group (``use_timeout``) has the timeout ``comm_timeout_s``
gives, whatever the default group was made with: a collective waits that
long for a rank that stalls (stopped, swapping, hung), and a rank that dies
closes its connections, which fails the collective at once. Either way the
failure is a ``CommError`` naming this rank and the collective, so the
survivor unwinds (closing its engine, removing its swap files) instead of
hanging or printing a backend's stack; checkpoints complete before stay
loadable (Note [checkpoint atomicity]).
"""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist

from offload.errors import CommError

# torch 2.13 renamed the flat-tensor collectives (the old names warn); older torch has only the old ones.
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


_group = None  # the engine's group (Note [dying ranks]); None: the default group
_made_in = None  # the default group it was made in: a new init_process_group makes it stale
_timeout_s: float | None = None


def use_timeout(seconds: float) -> None:
    """Every rank calls it (a collective): the engine's collectives run on a
    group of all ranks whose collectives give up after ``seconds``."""
    global _group, _made_in, _timeout_s
    if world()[1] > 1 and (seconds != _timeout_s or _made_in is not dist.group.WORLD):
        _group = dist.new_group(timeout=datetime.timedelta(seconds=seconds))
        _made_in, _timeout_s = dist.group.WORLD, seconds


def _run(name: str, collective, *args, **kwargs) -> None:
    try:
        collective(*args, group=_group if _made_in is dist.group.WORLD else None, **kwargs)
    except RuntimeError as exc:  # gloo and NCCL raise DistBackendError, a RuntimeError
        detail = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else type(exc).__name__
        raise CommError(f"rank {dist.get_rank()}: {name} failed ({detail}): another rank died, stalled longer "
                        f"than comm_timeout_s={_timeout_s}, or issued another collective (at stage 3, ranks that "
                        f"run different modules or compute gradients for different parameters)") from exc


def world() -> tuple[int, int]:
    """(rank, world size) of the default group, or (0, 1) without one."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def accelerator(first_param: torch.Tensor) -> torch.device:
    """The device the engine computes on. A model built on the meta device
    (``offload.init``), or any model in an NCCL group, runs on the CUDA device
    of this process's ``LOCAL_RANK`` (torchrun sets it), which also becomes the
    current device, so NCCL and ``all_gather_object`` use it; otherwise the
    model's own device."""
    nccl = dist.is_available() and dist.is_initialized() and dist.get_backend() == "nccl"
    if (first_param.is_meta or nccl) and torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
        torch.cuda.set_device(device)
        return device
    if first_param.is_meta:
        return torch.device("cpu")
    return first_param.device


def reduce_scatter_sum(out: torch.Tensor, full: torch.Tensor) -> None:
    """out (numel = full.numel() / world) <- this rank's slice of the sum over ranks of full."""
    if world()[1] == 1:
        out.copy_(full)
    else:
        _run("reduce_scatter", _reduce_scatter, out, full, op=dist.ReduceOp.SUM)


def all_gather(full: torch.Tensor, part: torch.Tensor) -> None:
    """full <- the concatenation over ranks of part."""
    if world()[1] == 1:
        full.copy_(part)
    else:
        _run("all_gather", _all_gather, full, part)


def broadcast(t: torch.Tensor, src: int) -> None:
    """t <- rank src's t."""
    if world()[1] > 1:
        _run("broadcast", dist.broadcast, t, src)


def all_reduce(t: torch.Tensor, op: str = "sum") -> torch.Tensor:
    if world()[1] > 1:
        _run("all_reduce", dist.all_reduce, t, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX)
    return t


def all_gather_object(obj) -> list:
    """Every rank's ``obj`` (picklable), in rank order; how ranks agree on success or failure."""
    if world()[1] == 1:
        return [obj]
    out = [None] * world()[1]
    _run("all_gather_object", dist.all_gather_object, out, obj)
    return out
