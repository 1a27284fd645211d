"""The Adam step (native kernel and fallback): equal to torch's Adam/AdamW over
200 steps, bitwise equal across kernels, thread counts and the fallback, exact
low-precision copy-out, and clear errors for bad input."""

import math
import warnings

import pytest
import torch

import offload
from offload import _native
from offload.optim import AdamHyper, adam_step, grad_stats
from offload.optim import adam as adam_module
from offload.errors import UsageError
from offload.optim.adam_fallback import adam_step_torch
from offload.optim.group_runs import GroupHyper, GroupRuns
from offload.optim.moment_codec import BlockCodes, blocks
from offload.optim.stochastic import round_to_bf16, step_key

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


def _fallback_step(param, grad, m, v, hyper, step):
    adam_step_torch(param, grad, m, v, hyper, step, 1.0, None)


IMPLEMENTATIONS = [pytest.param(adam_step, marks=requires_native, id="native"), pytest.param(_fallback_step, id="fallback")]


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("grad_dtype", GRAD_DTYPES, ids=str)
@pytest.mark.parametrize("torch_cls,weight_decay,decoupled", MODES, ids=["plain", "adamw", "adam_l2"])
def test_matches_torch_over_200_steps(impl, n, grad_dtype, torch_cls, weight_decay, decoupled):
    init = torch.randn(n)
    ref = init.clone().requires_grad_()
    ref_opt = torch_cls([ref], lr=LR, betas=BETAS, eps=EPS, weight_decay=weight_decay, foreach=False)
    param, m, v = init.clone(), torch.zeros(n), torch.zeros(n)
    hyper = AdamHyper(lr=LR, beta1=BETAS[0], beta2=BETAS[1], eps=EPS, weight_decay=weight_decay, decoupled=decoupled)
    for step in range(1, 201):
        grad = torch.randn(n).to(grad_dtype)
        ref.grad = grad.float()
        ref_opt.step()
        impl(param, grad, m, v, hyper, step)
    torch.testing.assert_close(param, ref.detach())
    torch.testing.assert_close(m, ref_opt.state[ref]["exp_avg"])
    torch.testing.assert_close(v, ref_opt.state[ref]["exp_avg_sq"])


@requires_native
def test_grad_scale_equals_scaled_gradient():
    n = 1000
    a = torch.randn(n)
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
@pytest.mark.parametrize("moment_dtype", [torch.float32, torch.bfloat16, "int8"], ids=str)
@pytest.mark.parametrize("master_dtype", [torch.float32, torch.bfloat16], ids=str)
def test_every_kernel_is_bitwise_equal_to_fallback(isa, grad_dtype, out_dtype, decoupled, moment_dtype, master_dtype,
                                                   restore_isa):
    _native.set_adam_isa(isa)
    n = 100_003
    hyper = AdamHyper(lr=1e-2, weight_decay=0.1, decoupled=decoupled, bias_correction=not decoupled)
    native = [torch.randn(n).to(master_dtype), _zero_moment(n, moment_dtype), _zero_moment(n, moment_dtype)]
    fallback = [_clone(t) for t in native]
    outs = [torch.empty(n, dtype=out_dtype) if out_dtype else None for _ in range(2)]
    for step in range(1, 6):
        # Magnitudes over 8 decades, so 8-bit codes flush, clamp and round up.
        grad = (torch.randn(n) * 10 ** (-8 * torch.rand(n))).to(grad_dtype)
        key = step_key(step, 3) if master_dtype == torch.bfloat16 else None
        adam_step(native[0], grad, native[1], native[2], hyper, step, grad_scale=0.5, out=outs[0], sr_key=key,
                  runs=RUNS)
        adam_step_torch(fallback[0], grad, fallback[1], fallback[2], hyper, step, 0.5, outs[1], key, RUNS)
    for a, b in zip(native + outs, fallback + outs[1:] + [None]):
        if b is not None:
            assert all(torch.equal(x, y) for x, y in zip(_tensors(a), _tensors(b)))


@pytest.mark.parametrize("isa", [*_supported_isas(), "fallback"])
@pytest.mark.parametrize("moment_dtype", [torch.float32, torch.bfloat16, "int8"], ids=str)
@pytest.mark.parametrize("master_dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("keep_master", [True, False], ids=["master-kept", "moments-only"])
def test_the_backup_is_the_state_before_the_step(isa, moment_dtype, master_dtype, keep_master, monkeypatch,
                                                 restore_isa):
    """Note [the old state kept in the pass]: over several tiles and two threads,
    the backup receives the state as the call found it, bitwise, and the step
    is bitwise the one without a backup."""
    if isa == "fallback":
        monkeypatch.setattr(_native, "status", lambda: _native.NativeStatus(False, "simulated: library missing"))
        monkeypatch.setattr(adam_module, "_warned", True)
    else:
        _native.set_adam_isa(isa)
    n = 100_003
    hyper = AdamHyper(lr=1e-2, weight_decay=0.1)
    state = [torch.randn(n).to(master_dtype), _zero_moment(n, moment_dtype), _zero_moment(n, moment_dtype)]
    key = step_key(1, 3) if master_dtype == torch.bfloat16 else None
    adam_step(*state[:1], torch.randn(n), *state[1:], hyper, 1, sr_key=key)  # moments no longer zero
    before, plain = [_clone(t) for t in state], [_clone(t) for t in state]
    backup = [_clone(t) for t in state]
    for t in backup:
        for part in _tensors(t):
            part.fill_(7)
    if not keep_master:
        backup[0] = None
    grad, key = torch.randn(n), step_key(2, 3) if master_dtype == torch.bfloat16 else None
    adam_step(state[0], grad, state[1], state[2], hyper, 2, sr_key=key, threads=2, backup=tuple(backup))
    adam_step(plain[0], grad, plain[1], plain[2], hyper, 2, sr_key=key, threads=2)
    for kept, was in zip(backup, before):
        if kept is not None:
            assert all(torch.equal(x, y) for x, y in zip(_tensors(kept), _tensors(was)))
    for a, b in zip(state, plain):
        assert all(torch.equal(x, y) for x, y in zip(_tensors(a), _tensors(b)))
    assert not torch.equal(state[0], before[0])


def test_a_backup_unlike_the_state_is_refused():
    n = 16
    good = _good(n)
    m = torch.zeros(n)
    with pytest.raises(ValueError, match="backup exp_avg must be a torch.float32 tensor like exp_avg"):
        adam_step(*good.values(), AdamHyper(), 1, backup=(None, m.bfloat16(), m.clone()))
    with pytest.raises(ValueError, match="backup exp_avg_sq has 15 elements but exp_avg_sq has 16"):
        adam_step(*good.values(), AdamHyper(), 1, backup=(None, m.clone(), torch.zeros(n - 1)))
    with pytest.raises(ValueError, match="exp_avg and backup param overlap"):
        adam_step(*good.values(), AdamHyper(), 1, backup=(good["exp_avg"], m.clone(), m.clone()))


# Cut at no vector, block or thread boundary; three of them meet, two others too; the call's own values
# between. Decay alone, rate alone (a third of the call's: not exact in binary), both, betas, eps.
RUNS = GroupRuns(((5, 1000, GroupHyper(0.0)), (1000, 40_001, GroupHyper(0.3)),
                  (40_001, 50_000, GroupHyper(0.1, 1 / 3)), (52_003, 60_000, GroupHyper(0.1, 1.0, (0.8, 0.95))),
                  (60_000, 64_001, GroupHyper(0.1, 1.0, None, 1e-2)), (70_001, 100_003, GroupHyper(0.0, 4.0))))


@pytest.mark.parametrize("impl", [pytest.param(adam_step, marks=requires_native, id="native"),
                                  pytest.param(lambda *a, **kw: adam_step_torch(*a, 1.0, None, None, kw["runs"]),
                                               id="fallback")])
@pytest.mark.parametrize("isa", _supported_isas() or [None])
@pytest.mark.parametrize("decoupled", [True, False])
def test_runs_step_as_calls_of_their_own_hyper_parameters(impl, isa, decoupled, restore_isa):
    """Note [hyper-parameters by run]: each span of a call with runs is bitwise
    what a call of its own on that span, with its weight decay and its rate
    (the call's times its scale), makes of it."""
    if isa is not None:
        _native.set_adam_isa(isa)
    n = 100_003
    hyper = AdamHyper(lr=1e-2, weight_decay=0.1, decoupled=decoupled)
    whole = [torch.randn(n), torch.zeros(n), torch.zeros(n)]
    parts = [t.clone() for t in whole]
    spans = list(RUNS.spans(n, GroupHyper(hyper.weight_decay)))
    call = GroupHyper(0.1)
    assert [g for *_, g in spans] == [call, GroupHyper(0.0), GroupHyper(0.3), GroupHyper(0.1, 1 / 3), call,
                                      GroupHyper(0.1, 1.0, (0.8, 0.95)), GroupHyper(0.1, 1.0, None, 1e-2), call,
                                      GroupHyper(0.0, 4.0)]
    for step in range(1, 4):
        grad = torch.randn(n)
        impl(*whole[:1], grad, *whole[1:], hyper, step, runs=RUNS)
        for lo, hi, group in spans:
            adam_step_torch(*(t[lo:hi] for t in parts[:1]), grad[lo:hi], *(t[lo:hi] for t in parts[1:]),
                            group.of(hyper), step, 1.0, None)
    assert all(torch.equal(a, b) for a, b in zip(whole, parts))
    untouched = torch.randn(n)
    moved = _two_steps(untouched, hyper, RUNS) != _two_steps(untouched, hyper, GroupRuns())
    assert [bool(moved[lo:hi].all()) for lo, hi, _ in RUNS.runs] == [True] * 6  # every run's values tell


def _two_steps(param, hyper, runs):
    """Two, as classic L2 decay changes no first step from zero moments much: Adam normalises it away."""
    param, moments = param.clone(), (torch.zeros_like(param), torch.zeros_like(param))
    for step, grad in enumerate((1.0, -0.5), start=1):
        adam_step(param, torch.full_like(param, grad), *moments, hyper, step, runs=runs)
    return param


def test_runs_are_checked():
    with pytest.raises(UsageError, match="increasing and disjoint"):
        GroupRuns(((0, 4, GroupHyper(0.0)), (2, 6, GroupHyper(0.1))))
    with pytest.raises(UsageError, match="weight_decay must be finite"):
        GroupHyper(-1.0)
    with pytest.raises(UsageError, match="lr_scale must be finite"):
        GroupHyper(0.0, math.inf)
    with pytest.raises(UsageError, match=r"beta2 \(betas\[1\]\) must be in \[0, 1\), got 1.0"):
        GroupHyper(0.0, 1.0, (0.9, 1.0))
    with pytest.raises(UsageError, match="eps must be finite and >= 0, got -1"):
        GroupHyper(0.0, 1.0, None, -1.0)
    with pytest.raises(UsageError, match="runs end at element 9, past param's 8"):
        adam_step(*_good(8).values(), AdamHyper(), 1, runs=GroupRuns(((0, 9, GroupHyper(0.0)),)))
    none, some = GroupHyper(0.0), GroupHyper(0.1, 2.0)
    assert GroupRuns.merged([(4, 6, none), (0, 4, none), (6, 8, some)]).runs == ((0, 6, none), (6, 8, some))
    assert GroupRuns(((0, 6, none), (6, 8, some))).within(5, 7).runs == ((0, 1, none), (1, 2, some))


def _zero_moment(n, dtype):
    if dtype == "int8":
        return BlockCodes(torch.zeros(n, dtype=torch.uint8), torch.zeros(blocks(n)))
    return torch.zeros(n, dtype=dtype)


def _clone(t):
    return BlockCodes(t.codes.clone(), t.scales.clone()) if isinstance(t, BlockCodes) else t.clone()


def _tensors(t):
    return list(t) if isinstance(t, BlockCodes) else [t]


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_bf16_moments_are_the_fp32_ones_rounded_and_the_weights_use_fp32(impl):
    """From zero moments, one step with bf16 moments gives the fp32 step's
    weights bit for bit (the update reads m and v before they are rounded) and
    stores m and v rounded to nearest even."""
    n = 10_007
    hyper = AdamHyper(lr=1e-2, weight_decay=0.1)
    grad, init = torch.randn(n) * 3, torch.randn(n)
    wide = [init.clone(), torch.zeros(n), torch.zeros(n)]
    narrow = [init.clone(), torch.zeros(n, dtype=torch.bfloat16), torch.zeros(n, dtype=torch.bfloat16)]
    impl(wide[0], grad, wide[1], wide[2], hyper, 1)
    impl(narrow[0], grad, narrow[1], narrow[2], hyper, 1)
    assert torch.equal(narrow[0], wide[0])
    assert torch.equal(narrow[1], wide[1].bfloat16()) and torch.equal(narrow[2], wide[2].bfloat16())
    assert not torch.equal(narrow[1].float(), wide[1])  # the rounding is real


def test_stochastic_rounding_is_unbiased_and_keyed():
    """Note [stochastic rounding]: a value 30% of the way from one bf16 to the
    next rounds up 30% of the time, the mean stays the value, the same key
    draws the same bits and another key others."""
    low = torch.tensor(1.0).bfloat16()
    gap = torch.tensor(1.0078125)  # the next bf16 above 1
    x = torch.full((1_000_000,), 1.0 + 0.3 * (gap.item() - 1.0))
    rounded = round_to_bf16(x, step_key(7, 0))
    assert set(rounded.unique().tolist()) == {low.item(), gap.item()}
    up = (rounded == gap.bfloat16()).double().mean().item()
    assert abs(up - 0.3) < 0.003 and abs(rounded.double().mean().item() - x[0].item()) < 1e-5
    assert torch.equal(rounded, round_to_bf16(x, step_key(7, 0)))
    assert not torch.equal(rounded, round_to_bf16(x, step_key(8, 0)))
    assert not torch.equal(rounded, round_to_bf16(x, step_key(7, 1)))
    negative = round_to_bf16(-x, step_key(7, 0))
    assert torch.equal(negative, -rounded)  # magnitudes round alike whatever the sign
    special = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0, -0.0])
    out = round_to_bf16(special, 5)
    assert out[0].isnan() and torch.equal(out[1:].float().view(torch.int32), special[1:].view(torch.int32))


@requires_native
def test_bf16_master_copy_out_is_the_stored_master():
    n = 10_007
    master = torch.randn(n).bfloat16()
    out = torch.empty(n, dtype=torch.bfloat16)
    adam_step(master, torch.randn(n), torch.zeros(n), torch.zeros(n), AdamHyper(lr=1e-2), 1, out=out,
              sr_key=step_key(1, 0))
    assert torch.equal(out.view(torch.int16), master.view(torch.int16))


def _awkward_floats(n: int) -> torch.Tensor:
    """Every class of fp32 value a conversion can get wrong: signed zeros,
    subnormals, values at and around the bf16/fp16 rounding ties, fp16's
    overflow edge (65504, 65520), infinities, NaN, and random bit patterns."""
    special = torch.tensor([
        0.0, -0.0, 1e-45, -1e-45, 1e-40, 5.9604645e-08, 2.9802322e-08, 6.1035156e-05, 6.097555e-05,
        65504.0, 65519.996, 65520.0, -65520.0, 1e30, float("inf"), float("-inf"), float("nan"),
        1.00390625, 1.01171875, 1.0009765625, 1.0029296875, 3.4028235e38,
    ])
    random_bits = torch.randint(-(2**31), 2**31 - 1, (n - special.numel(),), dtype=torch.int32).view(torch.float32)
    return torch.cat([special, random_bits])


@requires_native
@pytest.mark.parametrize("isa", _supported_isas())
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("offset", [0, 1], ids=["aligned-streaming", "misaligned"])
def test_copy_out_equals_to_dtype(isa, out_dtype, offset, restore_isa):
    _native.set_adam_isa(isa)
    n = 1_000_003
    param = _awkward_floats(n)
    before = param.clone()
    out = torch.empty(n + offset, dtype=out_dtype)[offset:]
    # lr = 0 leaves param unchanged (but for signalling NaNs, which arithmetic
    # quiets), so the copy-out sees exactly these values.
    adam_step(param, torch.zeros(n), torch.zeros(n), torch.zeros(n), AdamHyper(lr=0.0), 1, out=out)
    numbers = ~before.isnan()
    assert torch.equal(param.isnan(), before.isnan())
    assert torch.equal(param[numbers].view(torch.int32), before[numbers].view(torch.int32))
    assert torch.equal(out.view(torch.int16), param.to(out_dtype).view(torch.int16))


@requires_native
def test_thread_counts_are_bitwise_identical():
    n = 1_000_003
    runs = []
    for threads in (1, 2, 3, 7):
        torch.manual_seed(1)
        tensors = [torch.randn(n), torch.zeros(n), torch.zeros(n)]
        out = torch.empty(n, dtype=torch.bfloat16)
        for step in range(1, 4):
            adam_step(*tensors[:1], torch.randn(n), *tensors[1:], AdamHyper(weight_decay=0.1), step, out=out, threads=threads)
        runs.append(tensors + [out])
    for run in runs[1:]:
        for a, b in zip(runs[0], run):
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
    "sparse grad": (dict(grad=torch.randn(16).to_sparse()), "grad has layout torch.sparse_coo"),
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


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(step=0), "step must be an int in"),
        (dict(step=2**64), "step must be an int in"),
        (dict(step=1.5), "step must be an int in"),
        (dict(threads=0), "threads must be an int in"),
        (dict(threads=2**40), "threads must be an int in"),
        (dict(grad_scale=float("inf")), "grad_scale must be finite"),
        (dict(out=torch.empty(16, dtype=torch.float32)), "out must be bfloat16 or float16"),
        (dict(out=torch.empty(15, dtype=torch.bfloat16)), "out has 15 elements"),
    ],
)
def test_bad_arguments_raise_value_error(kwargs, message):
    kwargs = {"step": 1, **kwargs}
    step = kwargs.pop("step")
    with pytest.raises(ValueError, match=message):
        adam_step(*_good().values(), AdamHyper(), step, **kwargs)


@requires_native
def test_native_checks_what_it_is_given():
    """Called directly, past the Python checks, the library still refuses bad pointers."""
    step = _native.lib().offload_adam_step
    buf = torch.zeros(256)  # four 64-float regions: p, p+256, p+512, p+768
    p = buf.data_ptr()
    common = (0.001, 0.9, 0.999, 1e-8, 0.0, 1, 1, 1, 1.0, 1)
    cases = {
        "overlap": ((p, 0, 0, p + 64, p + 512, 0, None, None, p + 768, 0, None, 0, 32) + common, "param and exp_avg overlap"),
        "null": ((None, 0, 0, p, p + 256, 0, None, None, p + 512, 0, None, 0, 8) + common, "param is a null pointer"),
        "misaligned": ((p + 1, 0, 0, p + 256, p + 512, 0, None, None, p + 768, 0, None, 0, 8) + common, "param is not 4-byte aligned"),
        "grad dtype code": ((p, 0, 0, p + 256, p + 512, 0, None, None, p + 768, 7, None, 0, 8) + common, "grad dtype code 7"),
        "out dtype code": ((p, 0, 0, p + 256, p + 512, 0, None, None, p + 768, 0, p + 900, 0, 8) + common, "out dtype code 0"),
        "negative n": ((p, 0, 0, p + 256, p + 512, 0, None, None, p + 768, 0, None, 0, -1) + common, "n must be in"),
        "bad beta": ((p, 0, 0, p + 256, p + 512, 0, None, None, p + 768, 0, None, 0, 8, 0.001, 1.5) + common[2:], "beta1 must be in"),
        "negative threads": ((p, 0, 0, p + 256, p + 512, 0, None, None, p + 768, 0, None, 0, 8) + common[:-1] + (-1,), "threads must be >= 0"),
        "moment dtype code": ((p, 0, 0, p + 256, p + 512, 2, None, None, p + 768, 0, None, 0, 8) + common, "moment dtype code 2"),
        "param dtype code": ((p, 2, 0, p + 256, p + 512, 0, None, None, p + 768, 0, None, 0, 8) + common, "param dtype code 2"),
        "null scales": ((p, 0, 0, p + 256, p + 320, 3, None, p + 384, p + 768, 0, None, 0, 8) + common,
                        "exp_avg_scale is a null pointer"),
        "scales overlap": ((p, 0, 0, p + 256, p + 320, 3, p + 384, p + 384, p + 768, 0, None, 0, 8) + common,
                           "exp_avg_scale and exp_avg_sq_scale overlap"),
    }
    no_checksum = (None, 0, 0, None)
    no_runs = (None, None, 0)
    no_backup = (None,) * 5
    crcs = torch.zeros(1, dtype=torch.int32)
    checksum_cases = {
        "no length": (p + 256, 0, 4096, crcs.data_ptr()),
        "no chunk": (p + 256, 1024, 0, crcs.data_ptr()),
        "no data": (None, 1024, 4096, crcs.data_ptr()),
    }
    args = (p, 0, 0, p + 256, p + 512, 0, None, None, p + 768, 0, None, 0, 8) + common
    for checksum in checksum_cases.values():
        with pytest.raises(_native.NativeError, match="checksummed data needs a pointer, a length and a chunk size"):
            _native.check(step(*args, *checksum, *no_runs, *no_backup))
    for bad, message in cases.values():
        with pytest.raises(_native.NativeError, match=message):
            _native.check(step(*bad, *no_checksum, *no_runs, *no_backup))
    backup_cases = {  # Note [the old state kept in the pass]: param, moments, their scales
        (None, p + 600, None, None, None): "a backup needs exp_avg and exp_avg_sq",
        (None, p + 272, p + 600, None, None): "exp_avg and backup exp_avg overlap",
        (p + 2, p + 600, p + 640, None, None): "backup param is not 4-byte aligned",
    }
    for backup, message in backup_cases.items():
        with pytest.raises(_native.NativeError, match=message):
            _native.check(step(*args, *no_checksum, *no_runs, *backup))
    good = [0.0, 1.0, 0.9, 0.999, 1e-8]  # a run's weight decay, lr scale, beta1, beta2, eps (native/adam_args.h)
    run_cases = [  # (message, bounds of two runs over the 8 elements, their hyper-parameters)
        ("run 1 is \\[2, 6\\)", [0, 4, 2, 6], [good, good]),
        ("run 0 is \\[3, 3\\)", [3, 3, 4, 5], [good, good]),
        ("run 1 is \\[6, 9\\)", [0, 2, 6, 9], [good, good]),
        ("run 1: weight_decay must be finite and >= 0, got -1", [0, 2, 4, 6], [good, [-1.0, *good[1:]]]),
        ("run 0 has lr scale nan", [0, 2, 4, 6], [[0.0, math.nan, *good[2:]], good]),
        ("run 1: beta1 must be in \\[0, 1\\), got 1", [0, 2, 4, 6], [good, [0.0, 1.0, 1.0, 0.999, 1e-8]]),
        ("run 0: beta2 must be in \\[0, 1\\), got -0.5", [0, 2, 4, 6], [[0.0, 1.0, 0.9, -0.5, 1e-8], good]),
        ("run 1: eps must be finite and >= 0, got inf", [0, 2, 4, 6], [good, [*good[:4], math.inf]]),
        ("2 runs need their bounds and hyper-parameters", None, [good, good]),
        ("2 runs need their bounds and hyper-parameters", [0, 2, 4, 6], None),
    ]
    for message, *values in run_cases:
        arrays = [None if v is None else torch.tensor(v, dtype=dtype)
                  for v, dtype in zip(values, (torch.int64, torch.float64))]
        with pytest.raises(_native.NativeError, match=message):
            _native.check(step(*args, *no_checksum, *(a if a is None else a.data_ptr() for a in arrays), 2, *no_backup))
    assert all(buf == 0)  # nothing was written


def test_empty_tensors_are_a_no_op():
    empty = _good(0)
    adam_step(*empty.values(), AdamHyper(), 1)


@requires_native
def test_gil_is_released_during_the_step():
    """This thread sees the kernel's moments half written: some of them
    (the first) changed from zero, others (the last) not yet. Were the GIL
    held for the call, this thread would run only before or after it, never
    see that. A busy machine may keep this thread off a core for one whole
    step: any of five steps will do."""
    import threading

    n = 16_000_000
    param, grad, exp_avg, exp_avg_sq = torch.randn(n), torch.randn(n), torch.zeros(n), torch.zeros(n)

    def half_written() -> bool:
        exp_avg.zero_()
        kernel = threading.Thread(target=adam_step, args=(param, grad, exp_avg, exp_avg_sq, AdamHyper(), 1),
                                  kwargs={"threads": 1})
        kernel.start()
        seen = False
        while kernel.is_alive() and not seen:
            seen = exp_avg[0].item() != 0 and exp_avg[-1].item() == 0
        kernel.join()
        assert exp_avg[-1].item() != 0  # the step ran to the end
        return seen

    assert any(half_written() for _ in range(5))


@pytest.mark.parametrize("env,cores,expected", [
    ({"OMP_NUM_THREADS": "3"}, 8, 3),
    ({"OMP_NUM_THREADS": "5,2"}, 8, 5),  # OpenMP's nested list: the outer level
    ({"LOCAL_WORLD_SIZE": "2"}, 8, 4),  # two ranks on this node share its cores
    ({"LOCAL_WORLD_SIZE": "4"}, 2, 1),
    ({}, 6, 6),
])
def test_each_rank_uses_the_threads_it_is_given(monkeypatch, env, cores, expected):
    for name in ("OMP_NUM_THREADS", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(adam_module, "available_cores", lambda: cores)
    assert adam_module.default_threads() == expected


@pytest.mark.parametrize("env,cores,said", [
    ({"OMP_NUM_THREADS": "1", "LOCAL_WORLD_SIZE": "2", "TORCHELASTIC_RUN_ID": "x"}, 8, True),
    ({"OMP_NUM_THREADS": "1", "LOCAL_WORLD_SIZE": "2"}, 8, False),  # not torchrun's: the user's own choice
    ({"OMP_NUM_THREADS": "1", "LOCAL_WORLD_SIZE": "2", "TORCHELASTIC_RUN_ID": "x"}, 2, False),  # a core each anyway
    ({"OMP_NUM_THREADS": "4", "LOCAL_WORLD_SIZE": "2", "TORCHELASTIC_RUN_ID": "x"}, 8, False),
])
def test_torchruns_one_thread_per_rank_is_said_with_what_to_set(monkeypatch, env, cores, said):
    """torchrun sets OMP_NUM_THREADS=1 when it is unset and it starts several
    processes: each rank's CPU Adam would use one of its cores."""
    for name in ("OMP_NUM_THREADS", "LOCAL_WORLD_SIZE", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(adam_module, "available_cores", lambda: cores)
    config = {"optimizer": {"type": "AdamW"}, "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        offload.initialize(torch.nn.Linear(4, 4), config).close()
        config["zero_optimization"]["offload_optimizer"]["device"] = "none"  # no CPU Adam: nothing to say
        offload.initialize(torch.nn.Linear(4, 4), config).close()
    told = [str(w.message) for w in caught if "OMP_NUM_THREADS" in str(w.message)]
    assert told == (["offload: OMP_NUM_THREADS is 1 (torchrun sets it so when it is unset), so each rank's CPU Adam "
                     "uses 1 thread of the 4 cores this node has per rank; set OMP_NUM_THREADS=4 for torchrun"]
                    if said else [])


def test_a_bad_thread_count_is_named(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "many")
    with pytest.raises(ValueError, match="OMP_NUM_THREADS='many' is not a thread count"):
        adam_module.default_threads()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n", [0, 1, 17, 65_536, 65_537, 300_001])
def test_the_gradient_sum_of_squares_is_one_order_everywhere(dtype, n):
    """Note [gradient statistics]: the native pass, at any thread count, and the
    PyTorch fallback add in one fixed order, so they agree bit for bit; on a
    range of magnitudes wide enough that another order would show."""
    torch.manual_seed(n)
    grad = (torch.randn(n) * torch.exp(torch.randn(n) * 4)).clamp(-6e4, 6e4).to(dtype)
    expected = grad_stats.sum_squares_torch(grad)
    assert grad_stats.sum_squares(grad, threads=1) == expected == grad_stats.sum_squares(grad, threads=2)
    assert expected == pytest.approx(grad.double().square().sum().item(), rel=1e-12)


def test_a_non_finite_gradient_makes_the_sum_non_finite():
    grad = torch.randn(200_000)
    grad[123_456] = float("inf")
    assert grad_stats.sum_squares(grad) == float("inf")
    grad[7] = float("nan")
    assert math.isnan(grad_stats.sum_squares(grad))
