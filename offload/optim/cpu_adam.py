"""``CPUAdam``: a torch.optim.Optimizer for fp32 CPU parameters, on the native kernel.

Stands in for ``torch.optim.AdamW`` (``adamw_mode=True``) or ``torch.optim.Adam``
(``adamw_mode=False``) on contiguous fp32 CPU parameters: same param groups,
same state layout (``step``, ``exp_avg``, ``exp_avg_sq``), so state dicts move
between them and LR schedulers work unchanged. Defaults follow DeepSpeed's
CPU Adam (``weight_decay=0``); torch's AdamW defaults to 0.01, so pass it when
switching.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from offload.errors import UsageError
from offload.optim.adam import MAX_THREADS, adam_step, default_threads
from offload.optim.hyper import AdamHyper


class CPUAdam(torch.optim.Optimizer):
    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        *,
        adamw_mode: bool = True,
        bias_correction: bool = True,
        threads: int | None = None,
    ) -> None:
        defaults = dict(
            lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
            adamw_mode=adamw_mode, bias_correction=bias_correction,
        )
        _hyper(defaults)  # fail at construction, not at the first step
        if threads is not None and not (isinstance(threads, int) and 1 <= threads <= MAX_THREADS):
            raise UsageError(f"threads must be an int in [1, {MAX_THREADS}], got {threads!r}")
        self.threads = threads or default_threads()
        super().__init__(params, defaults)

    def __setstate__(self, state: dict[str, Any]) -> None:
        # A state dict saved by torch's Adam/AdamW lacks our keys; its own
        # decoupled_weight_decay says which of the two it was.
        super().__setstate__(state)
        for group in self.param_groups:
            group.setdefault("adamw_mode", group.get("decoupled_weight_decay", self.defaults["adamw_mode"]))
            group.setdefault("bias_correction", self.defaults["bias_correction"])

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None, *, grad_scale: float = 1.0) -> float | None:
        """One Adam step for every parameter that has a gradient. Gradients are
        multiplied by ``grad_scale`` first (unscaling and clipping in the same pass)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            hyper = _hyper(group)
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise UsageError("CPUAdam does not support sparse gradients")
                state = self.state[p]
                if not state:
                    state["step"] = torch.tensor(0.0, dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.contiguous_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.contiguous_format)
                state["step"] += 1
                adam_step(
                    p, p.grad, state["exp_avg"], state["exp_avg_sq"], hyper, int(state["step"].item()),
                    grad_scale=grad_scale, threads=self.threads,
                )
        return loss


def _hyper(group: dict[str, Any]) -> AdamHyper:
    for unsupported in ("amsgrad", "maximize"):
        if group.get(unsupported):
            raise UsageError(f"CPUAdam does not implement {unsupported}=True (found in a param group); set it to False")
    beta1, beta2 = group["betas"]
    return AdamHyper(
        lr=float(group["lr"]), beta1=float(beta1), beta2=float(beta2), eps=float(group["eps"]),
        weight_decay=float(group["weight_decay"]), decoupled=bool(group["adamw_mode"]),
        bias_correction=bool(group["bias_correction"]),
    )
