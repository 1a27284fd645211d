"""The Adam step (native kernel and fallback): equal to torch's Adam/AdamW over
200 steps, bitwise equal across kernels, thread counts and the fallback, exact
low-precision copy-out, and clear errors for bad input."""

import ctypes

import pytest
import torch

from offload import _native
from offload.optim import AdamHyper, adam_step
from offload.optim.adam_fallback import adam_step_torch

SIZES = [1, 7, 31, 1000003]  # none a multiple of the SIMD width but 1
GRAD_DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# (torch class, weight decay, decoupled): no decay, AdamW decay, classic L2 decay
MODES = [
    (torch.optim.AdamW, 0.0, True),
    (torch.optim.AdamW, 0.1, True),
    (torch.optim.Adam, 0.1, False),
]
LR, BETAS, EPS = 1e-3, (0.9, 0.999), 1e-8

requires_native = pytest.mark.skipif(not _native.status().available, reason="native library not built")


def _supported_isas():
    if not _native.status().available:
        return []
    order = ["scalar", "avx2", "avx512"]
    return order[: order.index(_native.cpu_isa()) + 1]


@pytest.fixture
def restore_isa():
    yield
    if _native.status().available:
        _native.set_adam_isa(None)


@requires_native
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("grad_dtype", GRAD_DTYPES, ids=str)
@pytest.mark.parametrize("torch_cls,weight_decay,decoupled", MODES, ids=["plain", "adamw", "adam_l2"])
def test_matches_torch_over_200_steps(n, grad_dtype, torch_cls, weight_decay, decoupled):
    init = torch.randn(n)
    ref = init.clone().requires_grad_()
    ref_opt = torch_cls([ref], lr=LR, betas=BETAS, eps=EPS, weight_decay=weight_decay, foreach=False)
    param, m, v = init.clone(), torch.zeros(n), torch.zeros(n)
    hyper = AdamHyper(lr=LR, beta1=BETAS[0], beta2=BETAS[1], eps=EPS, weight_decay=weight_decay, decoupled=decoupled)
    for step in range(1, 201):
        grad = torch.randn(n).to(grad_dtype)
        ref.grad = grad.float()
        ref_opt.step()
        adam_step(param, grad, m, v, hyper, step)
    torch.testing.assert_close(param, ref.detach())
    torch.testing.assert_close(m, ref_opt.state[ref]["exp_avg"])
    torch.testing.assert_close(v, ref_opt.state[ref]["exp_avg_sq"])


@requires_native
def test_grad_scale_equals_scaled_gradient():
    n = 1000
    a, b = torch.randn(n), None
    b = a.clone()
    ma, va, mb, vb = (torch.zeros(n) for _ in range(4))
    hyper = AdamHyper(weight_decay=0.01)
    for step in range(1, 11):
        grad = torch.randn(n) * 1024
        adam_step(a, grad, ma, va, hyper, step, grad_scale=1 / 1024)
        adam_step(b, grad / 1024, mb, vb, hyper, step)
    assert torch.equal(a, b) and torch.equal(ma, mb) and torch.equal(va, vb)


@requires_native
@pytest.mark.parametrize("isa", _supported_isas())
@pytest.mark.parametrize("grad_dtype", GRAD_DTYPES, ids=str)
@pytest.mark.parametrize("out_dtype", [None, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("decoupled", [True, False])
def test_every_kernel_is_bitwise_equal_to_fallback(isa, grad_dtype, out_dtype, decoupled, restore_isa):
    _native.set_adam_isa(isa)
    n = 100_003
    hyper = AdamHyper(lr=1e-2, weight_decay=0.1, decoupled=decoupled, bias_correction=not decoupled)
    native = [torch.randn(n), torch.zeros(n), torch.zeros(n)]
    fallback = [t.clone() for t in native]
    outs = [torch.empty(n, dtype=out_dtype) if out_dtype else None for _ in range(2)]
    for step in range(1, 6):
        grad = torch.randn(n).to(grad_dtype)
        adam_step(native[0], grad, native[1], native[2], hyper, step, grad_scale=0.5, out=outs[0])
        adam_step_torch(fallback[0], grad, fallback[1], fallback[2], hyper, step, 0.5, outs[1])
    for a, b in zip(native + outs, fallback + outs[1:] + [None]):
        if b is not None:
            assert torch.equal(a, b)


@requires_native
@pytest.mark.parametrize("isa", _supported_isas())
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("offset", [0, 1], ids=["aligned-streaming", "misaligned"])
def test_copy_out_equals_to_dtype(isa, out_dtype, offset, restore_isa):
    _native.set_adam_isa(isa)
    n = 65_537
    param = torch.randn(n) * torch.logspace(-30, 30, n)  # tiny, huge (fp16 overflow), and subnormal results
    out = torch.empty(n + offset, dtype=out_dtype)[offset:]
    adam_step(param, torch.randn(n), torch.zeros(n), torch.zeros(n), AdamHyper(), 1, out=out)
    assert torch.equal(out.view(torch.int16), param.to(out_dtype).view(torch.int16))


@requires_native
def test_one_and_two_threads_are_bitwise_identical():
    n = 1_000_003
    runs = []
    for threads in (1, 2):
        torch.manual_seed(1)
        tensors = [torch.randn(n), torch.zeros(n), torch.zeros(n)]
        out = torch.empty(n, dtype=torch.bfloat16)
        for step in range(1, 4):
            adam_step(*tensors[:1], torch.randn(n), *tensors[1:], AdamHyper(weight_decay=0.1), step, out=out, threads=threads)
        runs.append(tensors + [out])
    for a, b in zip(*runs):
        assert torch.equal(a, b)


def _good(n=16):
    return dict(param=torch.randn(n), grad=torch.randn(n), exp_avg=torch.zeros(n), exp_avg_sq=torch.zeros(n))


BAD_INPUTS = {
    "not contiguous": (dict(param=torch.randn(32)[::2]), "param is not contiguous"),
    "wrong param dtype": (dict(param=torch.randn(16, dtype=torch.float64)), "param must be float32"),
    "wrong grad dtype": (dict(grad=torch.randn(16, dtype=torch.float64)), "grad must be float32, bfloat16 or float16"),
    "length mismatch": (dict(exp_avg=torch.zeros(15)), "exp_avg has 15 elements but param has 16"),
    "meta tensor": (dict(grad=torch.randn(16, device="meta")), "grad is on meta"),
    "not a tensor": (dict(grad=[0.0] * 16), "grad must be a torch.Tensor"),
}


@pytest.mark.parametrize("case", BAD_INPUTS, ids=list(BAD_INPUTS))
def test_bad_tensors_raise_value_error(case):
    change, message = BAD_INPUTS[case]
    args = {**_good(), **change}
    with pytest.raises(ValueError, match=message):
        adam_step(args["param"], args["grad"], args["exp_avg"], args["exp_avg_sq"], AdamHyper(), 1)


def test_aliasing_buffers_raise_value_error():
    buf = torch.zeros(32)
    args = _good()
    with pytest.raises(ValueError, match="exp_avg and exp_avg_sq overlap"):
        adam_step(args["param"], args["grad"], buf[:16], buf[8:24], AdamHyper(), 1)
    with pytest.raises(ValueError, match="param and out overlap"):
        adam_step(args["param"], args["grad"], args["exp_avg"], args["exp_avg_sq"], AdamHyper(), 1,
                  out=args["param"].view(torch.bfloat16)[:16])


@pytest.mark.parametrize(
    "hyper,message",
    [
        (dict(lr=-1.0), "lr must be"),
        (dict(beta1=1.0), "beta1"),
        (dict(beta2=-0.1), "beta2"),
        (dict(eps=float("nan")), "eps"),
        (dict(weight_decay=-1.0), "weight_decay"),
    ],
)
def test_bad_hyper_parameters_raise_value_error(hyper, message):
    with pytest.raises(ValueError, match=message):
        AdamHyper(**hyper)


def test_bad_step_raises_value_error():
    with pytest.raises(ValueError, match="step must be an int >= 1"):
        adam_step(*_good().values(), AdamHyper(), 0)


@requires_native
def test_native_checks_what_it_is_given():
    """Called directly, past the Python checks, the library still refuses bad pointers."""
    step = _native.lib().offload_adam_step
    buf = torch.zeros(64)
    p = buf.data_ptr()
    common = (0.001, 0.9, 0.999, 1e-8, 0.0, 1, 1, 1, 1.0, 1)
    cases = {
        "overlap": ((p, p + 64, p + 128, p + 192, 0, None, 0, 32) + common, "param and exp_avg overlap"),
        "null": ((None, p, p + 64, p + 128, 0, None, 0, 8) + common, "param is a null pointer"),
        "misaligned": ((p + 1, p + 64, p + 128, p + 192, 0, None, 0, 8) + common, "param is not 4-byte aligned"),
        "dtype code": ((p, p + 64, p + 128, p + 192, 7, None, 0, 8) + common, "grad dtype code 7"),
        "negative n": ((p, p + 64, p + 128, p + 192, 0, None, 0, -1) + common, "n must be >= 0"),
    }
    for args, message in cases.values():
        with pytest.raises(_native.NativeError, match=message):
            _native.check(step(*args))
    assert isinstance(_native.NativeError("x"), ValueError)
    assert ctypes.sizeof(ctypes.c_void_p) == 8


def test_empty_tensors_are_a_no_op():
    empty = _good(0)
    adam_step(*empty.values(), AdamHyper(), 1)


@requires_native
def test_gil_is_released_during_the_step():
    """Another Python thread runs at nearly full speed while the kernel works.

    Were the GIL held for each call, the counter would only run in the gaps
    between calls, a small share of the time."""
    import threading
    import time

    n = 8_000_000
    tensors = [torch.randn(n), torch.randn(n), torch.zeros(n), torch.zeros(n)]
    ticks, stop = [0], threading.Event()

    def count():
        while not stop.is_set():
            ticks[0] += 1

    counter = threading.Thread(target=count)
    counter.start()
    try:
        start, t0 = ticks[0], time.perf_counter()
        time.sleep(0.2)
        free_rate = (ticks[0] - start) / (time.perf_counter() - t0)
        start, t0 = ticks[0], time.perf_counter()
        for step in range(1, 6):
            adam_step(tensors[0], tensors[1], tensors[2], tensors[3], AdamHyper(), step, threads=1)
        busy_rate = (ticks[0] - start) / (time.perf_counter() - t0)
    finally:
        stop.set()
        counter.join()
    assert busy_rate > 0.6 * free_rate  # measured: about 1.0 released, 0.3 held
