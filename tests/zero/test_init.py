"""offload.init: a model built on the meta device becomes partitions in its
tiers one module at a time; same weights as eager construction with the same
seed, host memory far below the model's size."""

import os
import subprocess
import sys

import pytest
import torch

import offload
from offload import _native
from offload.errors import UsageError
from offload.models.gpt import GPT, SIZES

pytestmark = pytest.mark.skipif(not _native.status().available, reason="native library not built")


def _cfg(tmp_path, **zero):
    return {"zero_optimization": {"stage": 3, "sub_group_size": 2_000_000,
                                  "offload_param": {"device": "nvme", "nvme_path": str(tmp_path), "max_in_cpu": 0},
                                  "offload_optimizer": {"device": "nvme", "nvme_path": str(tmp_path), "buffer_count": 2},
                                  **zero}}


@pytest.mark.parametrize("stage", [2, 3])
def test_same_weights_as_eager_construction(tmp_path, stage):
    torch.manual_seed(7)
    eager = {k: v.clone() for k, v in GPT(SIZES["tiny"]).state_dict().items()}
    cfg = _cfg(tmp_path)
    cfg["zero_optimization"]["stage"] = stage
    if stage == 2:
        del cfg["zero_optimization"]["offload_param"]
    torch.manual_seed(7)
    with offload.init(cfg):
        model = GPT(SIZES["tiny"])
    assert all(p.is_meta for p in model.parameters())
    with offload.initialize(model, cfg, init_fn=model.init_module) as engine:
        state = engine.state_dict()
        assert list(state) == list(eager)
        for key in eager:
            assert torch.equal(state[key], eager[key]), key
        loss = engine(torch.randint(0, 256, (2, 65)))
        engine.backward(loss)
        engine.step()
        assert torch.isfinite(loss)


_BUDGET_SCRIPT = """
import gc, sys, psutil, torch, offload
from offload.models.gpt import GPT, SIZES
path = sys.argv[1]
cfg = {"zero_optimization": {"stage": 3, "sub_group_size": 2_000_000,
       "offload_param": {"device": "nvme", "nvme_path": path, "max_in_cpu": 0},
       "offload_optimizer": {"device": "nvme", "nvme_path": path, "buffer_count": 2}}}
with offload.init():
    GPT(SIZES["tiny"])  # first use loads torch's meta kernels (about 80 MB, once per process)
gc.collect()
before = peak = psutil.Process().memory_info().rss
with offload.init(cfg):
    model = GPT(SIZES["85M"])
def sample(module):
    global peak
    model.init_module(module)
    peak = max(peak, psutil.Process().memory_info().rss)
engine = offload.initialize(model, cfg, init_fn=sample)
peak = max(peak, psutil.Process().memory_info().rss)
print(peak - before)
"""


def test_construction_stays_under_a_budget_the_model_exceeds(tmp_path):
    """In a fresh process with glibc's mmap threshold fixed: by default glibc
    raises it after large frees, so freed buffers stay in the heap and RSS
    would measure the allocator's history rather than what is held."""
    model_bytes = 4 * SIZES["85M"].params()  # 342 MB of fp32 weights
    budget = model_bytes // 2  # the two pools' caps (about 95 MB here) must fit, the model must not
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072"}
    out = subprocess.run([sys.executable, "-c", _BUDGET_SCRIPT, str(tmp_path)], capture_output=True, text=True,
                         env=env, timeout=300, check=True).stdout
    growth = int(out.split()[-1])
    assert growth < budget, (growth, budget)
    assert os.listdir(tmp_path) == []


def test_init_rejects_a_bad_config_before_building():
    with pytest.raises(offload.ConfigError, match="did you mean 'stage'"):
        with offload.init({"zero_optimization": {"stag": 3}}):
            pass


class _BodyAndHead(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.LayerNorm(32), torch.nn.Linear(32, 32))
        self.head = torch.nn.Linear(32, 3)

    def forward(self, x):
        return self.head(self.body(x)).square().mean()


@pytest.mark.parametrize("stage", [2, 3])
def test_a_meta_built_head_on_a_body_with_values_initialises_the_head_only(tmp_path, stage):
    """A pretrained body under a new head built on meta: the body keeps its
    values bit for bit (it was re-initialised, silently, before), and the head
    gets what its own initialiser gives from the seed."""
    torch.manual_seed(1)
    body = {k: v.clone() for k, v in _BodyAndHead().body.state_dict().items()}
    with torch.device("meta"):
        model = _BodyAndHead()
    model.body.load_state_dict({k: v.clone() for k, v in body.items()}, assign=True)  # compared with body below
    torch.manual_seed(2)
    head = torch.nn.Linear(32, 3).state_dict()  # its reset_parameters' draws, first after the seed
    zero = {"stage": stage, "offload_optimizer": {"device": "cpu"}, "stage3_param_persistence_threshold": 0}
    torch.manual_seed(2)
    with offload.initialize(model, {"zero_optimization": zero}) as engine:
        state = engine.state_dict()
        for key, value in body.items():
            assert torch.equal(state[f"body.{key}"], value), key
        for key, value in head.items():
            assert torch.equal(state[f"head.{key}"], value), key


def test_a_module_half_on_meta_keeps_its_values_and_initialises_the_rest():
    """A LayerNorm whose weight was loaded and whose bias is on meta: the weight
    stays, the bias gets what LayerNorm's reset gives it (zeros)."""
    torch.manual_seed(1)
    body = _BodyAndHead().body.state_dict()
    body["1.weight"] = torch.rand(32) + 2.0  # not LayerNorm's ones
    with torch.device("meta"):
        model = _BodyAndHead()
    values = {k: v for k, v in body.items() if k != "1.bias"}
    model.body.load_state_dict({k: v.clone() for k, v in values.items()}, strict=False, assign=True)
    with offload.initialize(model, {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}) as e:
        state = e.state_dict()
        assert all(torch.equal(state[f"body.{k}"], v) for k, v in values.items())
        assert torch.equal(state["body.1.bias"], torch.zeros(32))


def test_a_block_is_initialised_only_when_everything_under_it_was_on_meta():
    """An init_fn that writes a child's weight from its parent (as Hugging Face's
    does for GPT-2's attention blocks) must not reach a child holding values."""
    def init_fn(module):
        if isinstance(module, torch.nn.Sequential):
            module[0].weight.fill_(7.0)
        elif isinstance(module, torch.nn.Linear):
            module.reset_parameters()

    torch.manual_seed(1)
    loaded = torch.nn.Linear(4, 4).state_dict()
    with torch.device("meta"):
        model = torch.nn.Sequential(torch.nn.Sequential(torch.nn.Linear(4, 4)), torch.nn.Sequential(torch.nn.Linear(4, 4)))
    model[0][0].load_state_dict({k: v.clone() for k, v in loaded.items()}, assign=True)  # the second block is new
    with offload.initialize(model, {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}},
                            init_fn=init_fn) as engine:
        state = engine.state_dict()
        assert torch.equal(state["0.0.weight"], loaded["weight"]) and torch.equal(state["0.0.bias"], loaded["bias"])
        assert torch.isfinite(state["1.0.weight"]).all()


def test_an_init_fn_writing_below_its_module_at_stage_3_is_told_what_init_fn_may_write(tmp_path):
    """Stage 3 frees each parameter once its own module is initialised: an
    init_fn of the user's that writes a grandchild's weight then finds it
    partitioned. The error says that, not the advice for a partitioned
    parameter touched between steps (engine.gathered), which cannot help here."""
    class Outer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.mid = torch.nn.Sequential(torch.nn.Linear(8, 8))
            self.head = torch.nn.Linear(8, 8)

    def init_fn(module):
        if hasattr(module, "reset_parameters"):
            module.reset_parameters()
        if isinstance(module, Outer):
            module.mid[0].weight.fill_(7.0)

    with torch.device("meta"):
        model = Outer()
    zero = {"stage": 3, "offload_optimizer": {"device": "cpu"}, "stage3_param_persistence_threshold": 0}
    with pytest.raises(UsageError, match=r"^mid\.0\.weight: init_fn\(Outer\) writes it, but it was partitioned once "
                                         r"its own module was initialised"):
        offload.initialize(model, {"zero_optimization": zero}, init_fn=init_fn)
