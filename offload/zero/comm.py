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

Note [same collectives]
Collectives pair up by their place in each rank's sequence, not by what they
carry: at stage 3, ranks that gather different parameters of one size (an
MoE whose tokens reach different per-expert modules on each rank) exchange
parts of different parameters, and train on the mixture without any error.
So each collective is noted with what it carries, and at stage 3 the ranks
compare digests of their notes once per backward, before anything steps on
them: on a difference, every rank gets an error naming the first collective
where the ranks' sequences part. Sequences that part in size fail earlier,
in the collective itself (a CommError).
"""

from __future__ import annotations

import atexit
import datetime
import hashlib
import os

import torch
import torch.distributed as dist

from offload.errors import CommError, UsageError

# torch 2.13 renamed the flat-tensor collectives (the old names warn); older torch has only the old ones.
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


_group = None  # the engine's group (Note [dying ranks]); None: the default group
_made_in = None  # the default group it was made in: a new init_process_group makes it stale
_timeout_s: float | None = None
# Note [same collectives]: since the last comparison, a digest of every (collective, what it carries), and the
# first NAMED of them, to name where ranks part (an evaluation loop may run many collectives between comparisons).
NAMED = 10_000
_digest = hashlib.sha1()
_noted: list[tuple[str, str]] = []


def use_timeout(seconds: float) -> None:
    """Every rank calls it (a collective): the engine's collectives run on a
    group of all ranks whose collectives give up after ``seconds``."""
    global _group, _made_in, _timeout_s
    if world()[1] > 1 and (seconds != _timeout_s or _made_in is not dist.group.WORLD):
        _group = dist.new_group(timeout=datetime.timedelta(seconds=seconds))
        _made_in, _timeout_s = dist.group.WORLD, seconds


def _run(name: str, collective, *args, what: str = "", **kwargs) -> None:
    _digest.update(f"{name}\0{what}\n".encode())
    if len(_noted) < NAMED:
        _noted.append((name, what))
    try:
        collective(*args, group=_group if _made_in is dist.group.WORLD else None, **kwargs)
    except RuntimeError as exc:  # gloo and NCCL raise DistBackendError, a RuntimeError
        detail = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else type(exc).__name__
        raise CommError(f"rank {dist.get_rank()}: {name} failed ({detail}): another rank died, stalled longer "
                        f"than comm_timeout_s={_timeout_s}, or issued another collective (at stage 3, ranks that "
                        f"run different modules or compute gradients for different parameters)") from exc


LAUNCH_ENV = ("RANK", "MASTER_ADDR", "MASTER_PORT")


def join_the_launch(timeout_s: float | None = None) -> bool:
    """Under a launcher (torchrun's WORLD_SIZE > 1) with no process group yet,
    make the default one from the launcher's environment, as
    ``deepspeed.initialize`` does: otherwise every rank would train a copy of
    its own, each believing itself alone. NCCL with CUDA (on the local rank's
    device), gloo without; ranks that do not all come within ``timeout_s``
    fail it. True if it made the group."""
    if not dist.is_available() or dist.is_initialized() or int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return False
    missing = [name for name in LAUNCH_ENV if name not in os.environ]
    if missing:
        raise UsageError(f"WORLD_SIZE={os.environ['WORLD_SIZE']} says this is one of several ranks, but "
                         f"{', '.join(missing)} {'is' if len(missing) == 1 else 'are'} not set: start it with "
                         "torchrun, which sets them all, or unset WORLD_SIZE to train alone")
    nccl = torch.cuda.is_available()
    if nccl:
        torch.cuda.set_device(_local_gpu())
    timeout = None if timeout_s is None else datetime.timedelta(seconds=timeout_s)
    dist.init_process_group("nccl" if nccl else "gloo", timeout=timeout)
    atexit.register(_leave, dist.group.WORLD)
    return True


def _leave(made) -> None:
    """At exit, the gloo group ``join_the_launch`` made, if the program has
    not left it itself: torch asks for that, and without it gloo's threads,
    torn down with the interpreter, abort a finished run now and then
    ("terminate called without an active exception", exit status -6, which
    torchrun reports as the job's failure). Not NCCL's: after a failure its
    teardown may wait on peers that are gone, and no abort was seen there."""
    if dist.is_initialized() and dist.group.WORLD is made and dist.get_backend() == "gloo":
        dist.destroy_process_group()


def _local_gpu() -> torch.device:
    """The CUDA device of this process's ``LOCAL_RANK`` (torchrun sets it), among those it sees."""
    return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())


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
        device = _local_gpu()
        torch.cuda.set_device(device)
        return device
    if first_param.is_meta:
        return torch.device("cpu")
    return first_param.device


def reduce_scatter_sum(out: torch.Tensor, full: torch.Tensor, what: str = "") -> None:
    """out (numel = full.numel() / world) <- this rank's slice of the sum over ranks of full."""
    if world()[1] == 1:
        out.copy_(full)
    else:
        _run("reduce_scatter", _reduce_scatter, out, full, op=dist.ReduceOp.SUM, what=what)


def all_gather(full: torch.Tensor, part: torch.Tensor, what: str = "") -> None:
    """full <- the concatenation over ranks of part."""
    if world()[1] == 1:
        full.copy_(part)
    else:
        _run("all_gather", _all_gather, full, part, what=what)


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


def same_call(name: str) -> None:
    """Every rank calls it as it starts the engine call ``name``, a collective:
    ranks in different calls would pair their collectives silently (rank 0's
    ``state_dict`` gathering with rank 1's ``close``, which gathers alike)."""
    calls = all_gather_object(name)
    if len(set(calls)) > 1:
        made = "; ".join(f"rank {rank}: engine.{call}" for rank, call in enumerate(calls))
        raise UsageError(f"the ranks made different engine calls at once ({made}): each is a collective, so every "
                         "rank must make the same ones in the same order (not some under `if rank == 0`)")


def check_same_collectives(where: str) -> None:
    """Note [same collectives]: every rank calls it at the same point; raises
    on every rank if their collectives since the last call differ."""
    global _digest, _noted
    digest, mine = _digest.hexdigest(), _noted
    _digest, _noted = hashlib.sha1(), []  # the comparison's own collectives are alike on every rank
    if world()[1] == 1:
        return
    digests = all_gather_object(digest)
    if len(set(digests)) > 1:
        sequences = all_gather_object(mine)
        first = next((i for i in range(max(map(len, sequences)))
                      if len({seq[i] if i < len(seq) else None for seq in sequences}) > 1), None)
        if first is None:
            said = f"after the first {NAMED:,}, which agree"
        else:
            said = f"collective {first + 1}: " + "; ".join(
                f"rank {r}: {' of '.join(filter(None, seq[first])) if first < len(seq) else 'none'}"
                for r, seq in enumerate(sequences))
        raise UsageError(f"{where}: the ranks' collectives since the last check differ ({said}): at stage 3 every rank "
                         f"must run the same modules in the same order and compute gradients for the same parameters "
                         f"(an MoE routing tokens to per-expert modules breaks it: use stage 2, or experts fused in "
                         f"one module)")
