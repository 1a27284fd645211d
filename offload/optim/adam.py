"""One Adam step on contiguous CPU shards, by the native kernel or its fallback.

``adam_step`` is the single entry point the optimizer and the engine use. It
checks what only Python can see (device, dtype, contiguity, sizes, aliasing),
then runs the native kernel; when the native library is unavailable it runs
``adam_fallback.adam_step_torch``, which gives bitwise identical results (Note
[bit-identical Adam] in native/adam_args.h) at a fraction of the speed, and
warns once, loudly, saying why.
"""

from __future__ import annotations

import math
import os
import warnings

import torch

from offload import _native
from offload.errors import UsageError, outside_offload
from offload.optim.adam_fallback import adam_step_torch
from offload.optim.group_runs import GroupRuns
from offload.optim.hyper import AdamHyper, require
from offload.optim.moment_codec import BlockCodes, blocks
from offload.store.shard_file import ChunkCrcs

_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_BLOCK_CODES = 3  # moments as BlockCodes (Note [8-bit moments])
MAX_THREADS = 1024
_OUT_DTYPES = (torch.bfloat16, torch.float16)
MOMENT_DTYPES = MASTER_DTYPES = (torch.float32, torch.bfloat16)


def available_cores() -> int:
    """Cores this process may run on (its affinity mask)."""
    return len(os.sched_getaffinity(0))


def default_threads() -> int:
    """Threads a CPU Adam call uses unless told otherwise: ``OMP_NUM_THREADS``
    when set, else this process's cores shared among the ranks of its node
    (``LOCAL_WORLD_SIZE``, which torchrun sets), so ranks do not oversubscribe
    the cores they share."""
    given = os.environ.get("OMP_NUM_THREADS", "").strip()
    if given:
        try:
            threads = int(given.split(",")[0])
        except ValueError:
            raise UsageError(f"OMP_NUM_THREADS={given!r} is not a thread count; set it to a whole number >= 1") from None
        require(1 <= threads <= MAX_THREADS, f"OMP_NUM_THREADS={given!r} must be in [1, {MAX_THREADS}]")
        return threads
    return _cores_per_rank()


def _cores_per_rank() -> int:
    return max(1, available_cores() // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)))


def one_thread_from_torchrun() -> str | None:
    """What to do when torchrun chose the CPU Adam's threads: it sets
    ``OMP_NUM_THREADS=1`` for the processes it starts, when that is unset and
    it starts several on the node, which leaves each rank one core of its share."""
    share = _cores_per_rank()
    if os.environ.get("OMP_NUM_THREADS", "").strip() != "1" or "TORCHELASTIC_RUN_ID" not in os.environ or share == 1:
        return None
    return (f"OMP_NUM_THREADS is 1 (torchrun sets it so when it is unset), so each rank's CPU Adam uses 1 thread of "
            f"the {share} cores this node has per rank; set OMP_NUM_THREADS={share} for torchrun")


def adam_step(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor | BlockCodes,
    exp_avg_sq: torch.Tensor | BlockCodes,
    hyper: AdamHyper,
    step: int,
    *,
    grad_scale: float = 1.0,
    out: torch.Tensor | None = None,
    threads: int | None = None,
    sr_key: int | None = None,
    checksum: ChunkCrcs | None = None,
    runs: GroupRuns = GroupRuns(),
    backup: tuple[torch.Tensor | None, torch.Tensor | BlockCodes, torch.Tensor | BlockCodes] | None = None,
) -> None:
    """Update ``param``, ``exp_avg`` and ``exp_avg_sq`` in place for Adam step ``step`` (1-based).

    The gradient (fp32, bf16 or fp16) is multiplied by ``grad_scale`` first, so
    loss-scale unscaling and clipping cost no extra pass. If ``out`` (bf16 or
    fp16) is given, it receives ``param.to(out.dtype)`` in the same pass.
    The moments are both fp32, both bf16 (Note [bit-identical Adam]) or both
    ``BlockCodes`` (Note [8-bit moments]). ``param``
    is fp32, or bf16 rounded stochastically with the noise of ``sr_key``
    (Note [stochastic rounding]; ``stochastic.step_key``).
    ``checksum``: the swap data the state lives in, whose chunk CRCs the
    kernel computes as it writes it (Note [checksums in the Adam pass]); the
    fallback leaves it unfilled, and the write-back computes them.
    ``runs``: elements whose weight decay, learning rate, betas or eps are
    not ``hyper``'s (a parameter group's; Note [hyper-parameters by run]).
    ``backup``: (param, exp_avg, exp_avg_sq) like the state, receiving its values
    before the step (Note [the old state kept in the pass], native/adam_args.h);
    its param may be None, leaving the master uncopied.
    """
    _check_tensors(param, grad, exp_avg, exp_avg_sq, out, backup)
    require((sr_key is not None) == (param.dtype == torch.bfloat16) and (sr_key is None or 0 <= sr_key < 2**32),
            f"sr_key must be a 32-bit key exactly when param is bf16 (param {param.dtype}, sr_key {sr_key!r})")
    require(param.dtype == torch.float32 or param.numel() <= 2**32,
            f"bf16 master weights take at most 2**32 elements per call, got {param.numel()}")
    require(isinstance(step, int) and 1 <= step < 2**62, f"step must be an int in [1, 2**62) (the first step is 1), got {step!r}")
    require(math.isfinite(grad_scale), f"grad_scale must be finite, got {grad_scale}")
    require(threads is None or (isinstance(threads, int) and 1 <= threads <= MAX_THREADS),
             f"threads must be an int in [1, {MAX_THREADS}], got {threads!r}")
    require(checksum is None or checksum.valid(),
            "checksum must be a ChunkCrcs of contiguous uint8 data, a chunk > 0 and one int32 a chunk (ChunkCrcs.of)")
    require(not runs or runs.runs[-1][1] <= param.numel(),
            f"runs end at element {runs.runs[-1][1] if runs else 0}, past param's {param.numel()}")
    if not _native.status().available:
        warn_fallback_once()
        if backup is not None:
            for kept, now in zip(backup, (param, exp_avg, exp_avg_sq)):
                if kept is not None:
                    for a, b in zip(_parts(kept), _parts(now)):
                        a.copy_(b)
        adam_step_torch(param, grad, exp_avg, exp_avg_sq, hyper, step, grad_scale, out, sr_key, runs)
        return
    hypers = runs.hypers(hyper) if runs else None
    codes = isinstance(exp_avg, BlockCodes)
    _native.check(
        _native.lib().offload_adam_step(
            param.data_ptr(), _DTYPE_CODES[param.dtype], sr_key or 0,
            *((exp_avg.codes.data_ptr(), exp_avg_sq.codes.data_ptr(), _BLOCK_CODES,
               exp_avg.scales.data_ptr(), exp_avg_sq.scales.data_ptr()) if codes else
              (exp_avg.data_ptr(), exp_avg_sq.data_ptr(), _DTYPE_CODES[exp_avg.dtype], None, None)),
            grad.data_ptr(), _DTYPE_CODES[grad.dtype],
            out.data_ptr() if out is not None else None, _DTYPE_CODES[out.dtype] if out is not None else 0,
            param.numel(),
            hyper.lr, hyper.beta1, hyper.beta2, hyper.eps, hyper.weight_decay,
            int(hyper.decoupled), int(hyper.bias_correction), step, grad_scale,
            threads or default_threads(),
            *((checksum.data.data_ptr(), checksum.data.numel(), checksum.chunk, checksum.crcs.data_ptr())
              if checksum is not None else (None, 0, 0, None)),
            *((runs.bounds.data_ptr(), hypers.data_ptr()) if runs else (None, None)),
            len(runs.runs),
            *_backup_pointers(backup, codes),
        )
    )
    if checksum is not None:
        checksum.filled = True


def _parts(moment: torch.Tensor | BlockCodes) -> tuple[torch.Tensor, ...]:
    return (moment.codes, moment.scales) if isinstance(moment, BlockCodes) else (moment,)


def _backup_pointers(backup, codes: bool) -> tuple:
    """The kernel's five backup pointers: param, the moments, their scales."""
    if backup is None:
        return None, None, None, None, None
    param, exp_avg, exp_avg_sq = backup
    master = param.data_ptr() if param is not None else None
    if codes:
        return (master, exp_avg.codes.data_ptr(), exp_avg_sq.codes.data_ptr(), exp_avg.scales.data_ptr(),
                exp_avg_sq.scales.data_ptr())
    return master, exp_avg.data_ptr(), exp_avg_sq.data_ptr(), None, None


def _check_tensors(param, grad, exp_avg, exp_avg_sq, out, backup=None) -> None:
    codes = isinstance(exp_avg, BlockCodes)
    require(codes == isinstance(exp_avg_sq, BlockCodes), "exp_avg and exp_avg_sq must both be BlockCodes or both tensors")
    require(isinstance(param, torch.Tensor), f"param must be a torch.Tensor, got {type(param).__name__}")
    n = param.numel()
    per_element = f"param has {n}"
    per_block = f"param's {n} need {blocks(n)}, one a block"
    named = {"param": (param, n, per_element), "grad": (grad, n, per_element)}  # name -> (tensor, elements, why)
    if codes:
        named.update({"exp_avg": (exp_avg.codes, n, per_element), "exp_avg_sq": (exp_avg_sq.codes, n, per_element),
                      "exp_avg scales": (exp_avg.scales, blocks(n), per_block),
                      "exp_avg_sq scales": (exp_avg_sq.scales, blocks(n), per_block)})
    else:
        named.update({"exp_avg": (exp_avg, n, per_element), "exp_avg_sq": (exp_avg_sq, n, per_element)})
    if out is not None:
        named["out"] = (out, n, per_element)
    if backup is not None:
        require(isinstance(backup, tuple) and len(backup) == 3 and backup[1] is not None and backup[2] is not None,
                "backup must be a tuple (param or None, exp_avg, exp_avg_sq)")
        for name, kept, now in zip(("param", "exp_avg", "exp_avg_sq"), backup, (param, exp_avg, exp_avg_sq)):
            if kept is None:
                continue
            require(isinstance(kept, BlockCodes) == isinstance(now, BlockCodes),
                    f"backup {name} must be {type(now).__name__} like {name}")
            for part, (a, b) in zip(("", " scales"), zip(_parts(kept), _parts(now))):
                require(isinstance(a, torch.Tensor) and a.dtype == b.dtype,
                        f"backup {name}{part} must be a {b.dtype} tensor like {name}{part}")
                named[f"backup {name}{part}"] = (a, b.numel(), f"{name}{part} has {b.numel()}")
    for name, (t, numel, why) in named.items():
        require(isinstance(t, torch.Tensor), f"{name} must be a torch.Tensor, got {type(t).__name__}")
        require(t.device.type == "cpu", f"{name} is on {t.device}; the CPU Adam updates CPU tensors only")
        require(t.layout == torch.strided, f"{name} has layout {t.layout}; the CPU Adam takes dense tensors")
        require(t.is_contiguous(), f"{name} is not contiguous; pass a contiguous tensor (the kernel never works on a silent copy)")
        require(t.numel() == numel, f"{name} has {t.numel()} elements but {why}")
    require(param.dtype in MASTER_DTYPES, f"param must be float32 or bfloat16, got {param.dtype}")
    if codes:
        require(exp_avg.codes.dtype == exp_avg_sq.codes.dtype == torch.uint8
                and exp_avg.scales.dtype == exp_avg_sq.scales.dtype == torch.float32,
                "BlockCodes moments hold uint8 codes and float32 scales")
    else:
        require(exp_avg.dtype in MOMENT_DTYPES and exp_avg_sq.dtype == exp_avg.dtype,
                f"exp_avg and exp_avg_sq must both be float32 or both bfloat16, got {exp_avg.dtype} and {exp_avg_sq.dtype}")
    require(grad.dtype in _DTYPE_CODES, f"grad must be float32, bfloat16 or float16, got {grad.dtype}")
    require(out is None or out.dtype in _OUT_DTYPES, f"out must be bfloat16 or float16, got {getattr(out, 'dtype', None)}")
    spans = [(name, t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for name, (t, _, _) in named.items()]
    for i, (name_a, begin_a, end_a) in enumerate(spans):
        for name_b, begin_b, end_b in spans[i + 1:]:
            require(
                not (begin_a < end_b and begin_b < end_a) or param.numel() == 0,
                f"{name_a} and {name_b} overlap in memory; each needs its own buffer",
            )


_warned = False


def warn_fallback_once() -> None:
    global _warned
    if not _warned:
        _warned = True
        warnings.warn(
            "offload: the native library (the CPU Adam, the gradient's passes) is unavailable, using the "
            f"pure-PyTorch fallbacks (same results, several times slower). Reason: {_native.status().reason}",
            RuntimeWarning,
            stacklevel=outside_offload(),
        )
