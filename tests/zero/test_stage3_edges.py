"""Stage 3 edge cases found in review: meta-built models train; checkpointing
that stops its recomputation inside a module; read-ahead within the pool;
0-dim buffers in export; memory reports during a delayed update; empty
parameters; kwargs inputs; modules a meta build cannot initialise;
parameters read from a ParameterList or ParameterDict."""

import copy
import warnings

import pytest
import torch
import torch.nn as nn
import torch.utils.checkpoint as cp

import offload
from offload import _native
from offload.errors import UsageError
from offload.zero.stage3 import ParamState
from offload.models.gpt import GPT, SIZES
from offload.safetensors_file import read_safetensors

from .harness import batch, config, make_model, max_difference, train_engine

pytestmark = pytest.mark.skipif(not _native.status().available, reason="native library not built")

ADAMW = dict(lr=3e-3, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.01, foreach=False)


def _reference(model, data, loss_fn):
    opt = torch.optim.AdamW(model.parameters(), **ADAMW)
    for x in data:
        opt.zero_grad()
        loss_fn(model, x).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
    return model


def _engine(model, cfg, data, loss_fn, init_fn=None):
    engine = offload.initialize(model, cfg, init_fn=init_fn)
    for x in data:
        engine.backward(loss_fn(engine, x))
        engine.step()
    return engine


@pytest.mark.parametrize("stage", [2, 3])
def test_a_model_built_under_offload_init_trains_like_an_eager_one(tmp_path, stage):
    cfg = config(stage, "nvme", 1, str(tmp_path), param_device="nvme" if stage == 3 else None)
    data = [torch.randint(0, 256, (2, 33)) for _ in range(3)]
    torch.manual_seed(3)
    eager = _engine(GPT(SIZES["tiny"]), cfg, data, lambda m, x: m(x))
    torch.manual_seed(3)
    with offload.init(cfg):
        meta = GPT(SIZES["tiny"])
    built = _engine(meta, cfg, data, lambda m, x: m(x), init_fn=meta.init_module)
    a, b = eager.state_dict(), built.state_dict()
    torch.manual_seed(3)
    initial = GPT(SIZES["tiny"]).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["blocks.0.fc.weight"], initial["blocks.0.fc.weight"])  # it did train
    eager.close()
    built.close()


class EndsInLinear(nn.Module):
    """Checkpointed blocks whose last op is a Linear, called with keyword inputs:
    recomputation stops inside the Linear's forward, before its post-hook."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(16, 16), nn.GELU(), nn.Linear(16, 16)) for _ in range(2))
        self.head = nn.Linear(16, 1)

    def forward(self, x):
        for block in self.blocks:
            x = x + cp.checkpoint(lambda y, b=block: b(input=y), x, use_reentrant=False)
        return self.head(x).square().mean()


def test_checkpoint_stopping_inside_a_module_and_kwargs_inputs(tmp_path):
    cfg = config(3, "cpu", 1, str(tmp_path), param_device="nvme")
    cfg["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    data = [torch.randn(4, 16) for _ in range(4)]
    ref = _reference(EndsInLinear(), data, lambda m, x: m(x))
    with _engine(EndsInLinear(), cfg, data, lambda m, x: m(x)) as engine:
        assert max_difference(engine.state_dict(), ref) < 1e-5


def test_read_ahead_leaves_room_in_the_pool(tmp_path):
    """Read-ahead takes at most buffer_count - 2 pool buffers, so the parameter
    gathered next and a write-back always find one (before, it took them all
    and the next read raised PoolExhausted)."""
    def model():
        torch.manual_seed(0)
        return nn.Sequential(*[nn.Linear(32, 32) for _ in range(8)])

    data = [torch.randn(4, 32) for _ in range(3)]
    loss = lambda m, x: m(x).square().mean()  # noqa: E731
    ref = _reference(model(), data, loss)
    cfg = {"gradient_clipping": 0.5, "optimizer": {"params": {k: v for k, v in ADAMW.items() if k != "foreach"}},
           "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                                 "offload_param": {"device": "nvme", "nvme_path": str(tmp_path), "max_in_cpu": 0}}}
    with _engine(model(), cfg, data, loss) as engine:
        w = engine.weights
        io = w.store.stats()["io"]
        assert io["reads"] - io["demand_reads"] > 0  # it did read ahead
        assert w.peak_ahead_elements <= 3 * 32 * 32  # buffer_count 5: three buffers, each one weight at most
        assert max_difference(engine.state_dict(), ref) < 1e-5


def test_export_with_a_0_dim_buffer(tmp_path):
    model = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8))
    with offload.initialize(model, {"zero_optimization": {"stage": 3}}) as engine:
        engine.backward(engine(torch.randn(4, 8)).square().mean())
        engine.step()
        engine.export(str(tmp_path / "m.safetensors"))
        state = engine.state_dict()
    exported = read_safetensors(str(tmp_path / "m.safetensors"))
    assert exported["1.num_batches_tracked"].shape == () and torch.equal(exported["1.num_batches_tracked"], state["1.num_batches_tracked"])


def test_memory_report_during_delayed_updates():
    cfg = config(2, "cpu", 1, offload_optimizer={"delayed_update": True, "delayed_update_warmup": 0})
    engine = offload.initialize(make_model(), cfg)
    for step in range(10):
        engine.backward(engine(batch(step, 0, 0)))
        engine.step()
        assert engine.memory_report()[("optimizer state", "host")]["bytes"] > 0
    engine.close()


def test_an_empty_parameter_in_stage_3():
    model = nn.Linear(4, 4)
    model.nothing = nn.Parameter(torch.zeros(0))
    with offload.initialize(model, {"zero_optimization": {"stage": 3}}) as engine:
        engine.backward(engine(torch.randn(2, 4)).sum())
        engine.step()
        assert engine.state_dict()["nothing"].shape == (0,)


class NoReset(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.zeros(3))

    def forward(self, x):
        return x * self.w


def test_a_meta_module_without_reset_parameters_is_refused():
    with offload.init():
        model = NoReset()
    with pytest.raises(ValueError, match="NoReset has its own parameters or buffers but no reset_parameters"):
        offload.initialize(model, {"zero_optimization": {"stage": 3}})


class InPlace(nn.Module):
    """ReLU(inplace=True) right after a Linear, and an in-place add into a Linear's output."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Linear(16, 16), nn.ReLU(inplace=True), nn.Linear(16, 16), nn.ReLU(inplace=True))
        self.bias_in = nn.Linear(16, 16)
        self.head = nn.Linear(16, 1)

    def forward(self, x):
        h = self.body(x * 1.0)
        y = self.bias_in(h)
        y += h
        return self.head(y).square().mean()


def test_in_place_operations_on_module_outputs(tmp_path):
    cfg = config(3, "cpu", 1, str(tmp_path), param_device="cpu")
    cfg["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    data = [torch.randn(4, 16) for _ in range(4)]
    ref = _reference(InPlace(), data, lambda m, x: m(x))
    with _engine(InPlace(), cfg, data, lambda m, x: m(x)) as engine:
        assert max_difference(engine.state_dict(), ref) < 1e-5
        assert engine.weights.live_elements == 0


class Mixture(nn.Module):
    """Parameters in a ParameterList and a ParameterDict that the module reads
    itself (such containers have no forward), one of them frozen."""

    def __init__(self):
        super().__init__()
        self.scales = nn.ParameterList([nn.Parameter(torch.randn(64)) for _ in range(3)])
        self.shifts = nn.ParameterDict({"a": nn.Parameter(torch.randn(64)),
                                        "frozen": nn.Parameter(torch.randn(64), requires_grad=False)})

    def forward(self, x):
        for scale in self.scales:
            x = torch.tanh(x * scale + self.shifts["a"] + self.shifts["frozen"])
        return x.pow(2).mean()


def test_parameters_a_module_reads_from_a_parameter_list_or_dict(tmp_path):
    """Gathered with the module that reads them (they used to stay without
    storage: the containers are never called), at threshold 0 so none stays
    gathered, equal to AdamW on the trainable ones."""
    cfg = config(3, "cpu", 1, str(tmp_path), param_device="nvme")
    cfg["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    data = [torch.randn(8, 64, generator=torch.Generator().manual_seed(i)) for i in range(4)]
    torch.manual_seed(0)
    model = Mixture()
    ref = copy.deepcopy(model)
    opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], **ADAMW)
    for x in data:
        opt.zero_grad()
        ref(x).backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
        opt.step()
    with _engine(model, cfg, data, lambda m, x: m(x)) as engine:
        state = engine.state_dict()
        own = engine.module.state_dict()  # the containers' parameters gathered too (Note [the model's own copies])
    assert max((state[k] - v).abs().max().item() for k, v in ref.state_dict().items()) < 1e-5
    assert own.keys() == state.keys() and all(torch.equal(own[k], state[k]) for k in state)


class RescalesInEval(nn.Module):
    """Halves its weight in place when run in eval mode, as RWKV's rescale_every does."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, x):
        if not self.training:
            with torch.no_grad():
                self.lin.weight.mul_(0.5)
        return self.lin(x).square().mean()


@pytest.mark.parametrize("tier", ["none", "cpu", "nvme"])
def test_an_in_place_change_to_a_gathered_weight_is_an_error_naming_it(tmp_path, tier):
    """Note [in-place changes]: the change would be lost when the weight is
    released; training without such changes is untouched by the check."""
    cfg = config(3, "cpu", 1, str(tmp_path), param_device=tier)
    cfg["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    torch.manual_seed(0)
    with _engine(RescalesInEval(), cfg, [torch.randn(4, 16) for _ in range(2)], lambda m, x: m(x)) as engine:
        engine.module.eval()
        with torch.no_grad(), pytest.raises(UsageError, match="lin.weight was changed in place while gathered"):
            engine(torch.randn(4, 16))


def test_calling_the_model_itself_begins_a_pass_as_generate_does(tmp_path):
    """generate calls the model, not the engine, once per decoding step: each
    call begins a pass, so the recorded order holds (no warning that it
    changed) and later calls read ahead; the losses are the engine's own."""
    cfg = config(3, "cpu", 1, str(tmp_path), param_device="cpu")
    cfg["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    tokens = batch(9, 0, 0)
    with train_engine(make_model(), 2, 1, cfg) as engine:
        with torch.no_grad():
            expected = engine(tokens).item()
            with warnings.catch_warnings():
                warnings.simplefilter("error")  # the order-changed RuntimeWarning fails the test
                losses, ahead = [], []
                for _ in range(4):
                    losses.append(engine.module(tokens).item())
                    ahead.append(engine.weights.uploads_ahead)
    assert losses == [expected] * 4
    assert ahead[3] - ahead[2] == ahead[2] - ahead[1] > 0  # every call after the first reads the same ahead


class Projections(nn.Module):
    """Two weights read by the module itself, then a checkpointed Linear whose
    recomputation during backward calls a module again."""

    def __init__(self, reentrant: bool):
        super().__init__()
        self.reentrant = reentrant
        self.p = nn.Parameter(torch.randn(16, 16) / 4)
        self.q = nn.Parameter(torch.randn(16, 16) / 4)
        self.block = nn.Linear(16, 16)

    def forward(self, x):
        a = (x @ self.p) @ self.q  # saves q for the gradient of x @ p
        return cp.checkpoint(self.block, a, use_reentrant=self.reentrant).square().mean()


@pytest.mark.parametrize("reentrant", [False, True])
def test_a_no_grad_call_between_forward_and_backward_keeps_the_pass(tmp_path, reentrant):
    """A reference forward of the model itself, without gradients, between the
    engine's forward and its backward (as DPO makes), joins the open pass: the
    checkpoint's recomputation in backward must not begin a new one, which
    would drop the weights the backward still needs."""
    cfg = config(3, "cpu", 1, str(tmp_path), param_device="cpu")
    cfg["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(0))
    states = []
    for interpose in (False, True):
        torch.manual_seed(0)
        with offload.initialize(Projections(reentrant), cfg) as engine:
            loss = engine(x)
            if interpose:
                with torch.no_grad():
                    engine.module(x)
            engine.backward(loss)
            engine.step()
            states.append(engine.state_dict())
    assert all(torch.equal(states[0][k], states[1][k]) for k in states[0])


def test_a_forward_that_raises_gives_back_its_weights_and_the_next_call_begins_a_pass(tmp_path):
    """The post-hooks run when a forward raises (always_call): nothing stays
    gathered, and the next call of the model itself begins a pass as before."""
    cfg = config(3, "cpu", 1, str(tmp_path), param_device="cpu")
    cfg["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 16))
    with offload.initialize(model, cfg) as engine, torch.no_grad():
        expected = [engine.module(torch.ones(4, 16)) for _ in range(2)][-1]
        with pytest.raises(RuntimeError):
            engine.module(torch.ones(4, 15))  # the first Linear's forward raises
        assert all(state is ParamState.PARTITIONED for state in engine.weights.states().values())
        ahead = engine.weights.uploads_ahead
        again = [engine.module(torch.ones(4, 16)) for _ in range(2)][-1]
        assert engine.weights.uploads_ahead > ahead  # the calls followed the recorded order
        assert torch.equal(again, expected)
        assert all(state is ParamState.PARTITIONED for state in engine.weights.states().values())


class _FrozenMiddle(nn.Module):
    """Frozen layers (a checkpoint carries them apart from the optimizer's
    state) before a trained head; ``stop`` ends the forward early."""

    def __init__(self, seed):
        super().__init__()
        torch.manual_seed(seed)
        self.f1, self.f2, self.f3 = (nn.Linear(16, 16) for _ in range(3))
        for layer in (self.f1, self.f2, self.f3):
            layer.requires_grad_(False)
        self.head = nn.Linear(16, 1)

    def forward(self, x, stop=False):
        x = self.f1(x)
        if stop:
            return x.sum()
        return self.head(self.f3(self.f2(x))).square().mean()


def test_weights_assigned_after_a_pass_that_ended_early_are_what_gathers_next():
    """A pass that stops early leaves the weights it uploaded ahead unused; a
    frozen weight assigned next (as loads assign a checkpoint's) replaces its
    upload, not the reverse."""
    cfg = config(3, "cpu", 1, None, param_device="cpu")
    cfg["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    with offload.initialize(_FrozenMiddle(seed=0), cfg) as engine, torch.no_grad():
        for _ in range(2):
            engine(torch.ones(4, 16))  # the order is recorded, then followed
        engine(torch.ones(4, 16), stop=True)
        new = torch.full((256,), 5.0)
        engine.assign_others({"f2.weight": lambda lo, hi: new[lo:hi]})
        assert torch.equal(engine.state_dict()["f2.weight"], new.view(16, 16))
        with engine.gathered([engine.module.f2.weight]):
            assert torch.equal(engine.module.f2.weight, new.view(16, 16))
