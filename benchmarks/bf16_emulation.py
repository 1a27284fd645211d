"""bf16 compute at fp32 speed, for CPUs without bf16 instructions.

There torch multiplies bf16 matrices about 80 times slower than fp32 ones
(1.2-1.3 GFLOPS against 75-130 on a 2-core AMD EPYC, torch 2.13), which
puts long bf16 runs out of reach. Under ``EmulatedBf16Matmul`` each linear
layer and attention on bf16 inputs is computed in fp32 from its bf16
operands and rounded back to bf16: what a bf16 GEMM with fp32 accumulation
gives, up to the order of summation. Every other operation, the weights,
activations and gradients stay bf16, so the engine's bf16 paths (weights,
gradients, master) run as they would on a GPU.
"""

from __future__ import annotations

import contextlib
import copy
import time

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode


def add_argument(parser) -> None:
    """The ``--emulate-bf16-matmul`` flag of the benchmarks that run bf16 compute."""
    parser.add_argument("--emulate-bf16-matmul", action="store_true",
                        help="bf16 compute: linear layers and attention in fp32 from bf16 operands, rounded to bf16")


def bf16_matmuls(emulated: bool):
    """What bf16 compute runs under: the emulation, or torch's own kernels."""
    return EmulatedBf16Matmul() if emulated else contextlib.nullcontext()


class EmulatedBf16Matmul(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (F.linear, torch._C._nn.linear) and args[0].dtype == torch.bfloat16:
            x, weight, bias = (*args, *kwargs.values(), None)[:3]
            return _Bf16Linear.apply(bias, x, weight)
        if func is F.scaled_dot_product_attention and args[0].dtype == torch.bfloat16:
            return func(*map(_fp32, args), **{k: _fp32(v) for k, v in kwargs.items()}).to(torch.bfloat16)
        return func(*args, **kwargs)


class _Bf16Linear(torch.autograd.Function):
    """Saves its bf16 operands, as torch's bf16 linear does: an fp32 copy of
    the weight kept for backward would hold every layer's weights in fp32
    until backward reaches it (12.9 GB of host memory at 3.23B parameters).
    The bias comes first, as in torch's ``addmm``, so its gradient is
    accumulated before the weight's, as torch's linear does: the engine
    fills gradient sub-groups in that order (the other order wrote 20% more
    gradient bytes to NVMe)."""

    @staticmethod
    def forward(ctx, bias: torch.Tensor | None, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.bias_dtype = None if bias is None else bias.dtype
        return F.linear(x.float(), _weight_fp32(weight), _fp32(bias)).to(torch.bfloat16)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight = ctx.saved_tensors
        g = grad.float()
        rows = g.reshape(-1, g.shape[-1])
        grad_b = rows.sum(0).to(ctx.bias_dtype) if ctx.bias_dtype is not None and ctx.needs_input_grad[0] else None
        grad_x = (g @ _weight_fp32(weight)).to(x.dtype) if ctx.needs_input_grad[1] else None
        grad_w = None
        if ctx.needs_input_grad[2]:
            out = _scratch("grad_w", weight.shape)
            grad_w = torch.mm(rows.T, x.reshape(-1, x.shape[-1]).float(), out=out).to(weight.dtype)
        return grad_b, grad_x, grad_w


_scratches: dict[tuple[str, torch.Size], torch.Tensor] = {}


def _scratch(use: str, shape: torch.Size) -> torch.Tensor:
    """An fp32 buffer per use and weight shape, reused: a fresh one per call
    was new memory each time, whose page faults cost more than the
    conversion (bf16 hardware converts nothing). It never leaves the call
    that fills it."""
    if (use, shape) not in _scratches:
        _scratches[use, shape] = torch.empty(shape)
    return _scratches[use, shape]


def _weight_fp32(weight: torch.Tensor) -> torch.Tensor:
    return _scratch("weight", weight.shape).copy_(weight)


def _fp32(a):
    return a.float() if isinstance(a, torch.Tensor) else a


def _compare() -> None:
    from offload.models.gpt import GPT, SIZES

    torch.manual_seed(0)
    tokens = torch.randint(0, 256, (8, SIZES["5M"].block_size + 1))
    fp32 = GPT(SIZES["5M"])
    bf16 = copy.deepcopy(fp32).to(torch.bfloat16)

    def run(model: torch.nn.Module, mode) -> tuple[float, float, torch.Tensor]:
        times = []
        for _ in range(3):
            model.zero_grad()
            start = time.perf_counter()
            with mode():
                loss = model(tokens)
                loss.backward()
            times.append(time.perf_counter() - start)
        return min(times), loss.item(), torch.cat([p.grad.float().flatten() for p in model.parameters()])

    results = {"fp32": run(fp32, contextlib.nullcontext), "bf16 (torch)": run(bf16, contextlib.nullcontext),
               "bf16 (emulated)": run(bf16, EmulatedBf16Matmul)}
    reference = results["bf16 (torch)"][2]
    print(f"{'':16}{'seconds':>9}{'loss':>11}{'gradient vs bf16 (torch), relative':>37}")
    for name, (seconds, loss, grad) in results.items():
        print(f"{name:16}{seconds:>9.3f}{loss:>11.6f}{((grad - reference).norm() / reference.norm()).item():>37.4f}")


if __name__ == "__main__":
    _compare()
