"""Parameter groups (Note [parameter groups]): each parameter takes its own
group's weight decay, learning rate, betas and eps, as in torch.optim.AdamW
(and Adam with L2 decay) given the same groups, at every stage and tier, world
sizes 1 and 2, and under a schedule; bad groups are refused by name."""

import copy
import os
import warnings

import numpy as np

import pytest
import torch

import offload
from offload import _native
from offload.errors import UsageError
from offload.optim.group_runs import GroupHyper

from .harness import (batch, config, each_tier, make_model, max_difference, spawn_ranks, train_engine,
                      train_reference)

pytestmark = pytest.mark.skipif(not _native.status().available, reason="native library not built")

STEPS = 6
TOLERANCE = 1e-5  # as tests/zero/test_equivalence.py; ignoring the groups moves weights by ~1e-3


def three_groups(model):
    """Matrices at the config's hyper-parameters (lr 3e-3); the embedding (tied to the head) at its own decay,
    a third of the rate (not exact in binary) and its own eps; the rest at no decay, twice the rate and their
    own betas."""
    embed = model.embed.weight
    matrices = [p for p in model.parameters() if p.dim() > 1 and p is not embed]
    return [{"params": matrices}, {"params": [embed], "weight_decay": 0.3, "lr": 1e-3, "eps": 1e-4},
            {"params": [p for p in model.parameters() if p.dim() < 2], "weight_decay": 0.0, "lr": 6e-3,
             "betas": (0.8, 0.95)}]


def _config(stage, device, tmp_path, param_device=None, l2=False, **extra):
    cfg = config(stage, device, 2, str(tmp_path) if "nvme" in (device, param_device) else None,
                 param_device=param_device, **extra)
    cfg["optimizer"]["params"]["weight_decay"] = 0.1
    if l2:
        cfg["optimizer"]["type"] = "Adam"
        cfg["optimizer"]["params"]["adam_w_mode"] = False
    return cfg


CASES = {
    "stage1-none": (1, "none", None, {}),
    "stage2-cpu": (2, "cpu", None, {}),
    "stage2-nvme-overlap": (2, "nvme", None, {"offload_optimizer": {"overlap_step": True}}),
    "stage2-cpu-l2": (2, "cpu", None, {"l2": True}),
    "stage1-none-l2": (1, "none", None, {"l2": True}),
    "stage3-cpu-params-cpu": (3, "cpu", "cpu", {}),
    "stage3-nvme-params-nvme": (3, "nvme", "nvme", {}),
    "stage3-none-params-none": (3, "none", "none", {}),
    "stage2-cpu-bf16-moments": (2, "cpu", None, {"offload_optimizer": {"state_dtype": "bfloat16"}}),
}


@pytest.mark.parametrize("case", CASES)
def test_world_size_1_matches_torch_with_the_same_groups(tmp_path, case):
    stage, device, param_device, extra = CASES[case]
    cfg = _config(stage, device, tmp_path, param_device, **extra)
    moments = torch.bfloat16 if "bf16" in case else torch.float32
    ref = train_reference(make_model(), STEPS, 1, 2, cfg, moments, groups=three_groups)
    ungrouped = train_reference(make_model(), STEPS, 1, 2, cfg, moments)
    assert max_difference(ref.state_dict(), ungrouped) > 100 * TOLERANCE  # the groups matter here
    with train_engine(make_model(), STEPS, 2, cfg, groups=three_groups) as engine:
        assert max_difference(engine.state_dict(), ref) < TOLERANCE


def _world2(rank: int, port: int, out_dir: str) -> None:
    def check(case, nvme):
        stage, tier = int(case[0]), case[2:]
        cfg = _config(stage, tier, nvme, tier if stage == 3 else None)
        ref = train_reference(make_model(), STEPS, 2, 2, cfg, groups=three_groups)
        with train_engine(make_model(), STEPS, 2, cfg, rank, groups=three_groups) as engine:
            return max_difference(engine.state_dict(), ref)

    each_tier(rank, port, out_dir, ("2-cpu", "2-nvme", "3-cpu", "3-nvme"), check)


def test_world_size_2_matches_torch_with_the_same_groups(tmp_path):
    for rank, results in enumerate(spawn_ranks(_world2, tmp_path)):
        assert len(results) == 4
        for case, difference in results.items():
            assert difference < TOLERANCE, (rank, case, difference)


def test_a_plain_list_of_parameters_is_one_group_at_the_configs_decay(tmp_path):
    cfg = _config(2, "cpu", tmp_path)
    ref = train_reference(make_model(), STEPS, 1, 2, cfg)
    with train_engine(make_model(), STEPS, 2, cfg, groups=lambda model: list(model.parameters())) as engine:
        assert max_difference(engine.state_dict(), ref) < TOLERANCE


def _refused(groups_of, message, cfg=None):
    model = make_model()
    with pytest.raises(UsageError, match=message):
        offload.initialize(model, cfg or _config(2, "cpu", None), param_groups=groups_of(model))


def test_bad_groups_are_refused_by_name():
    _refused(lambda m: [{"params": list(m.parameters()), "amsgrad": True}],
             r"param_groups\[0\] sets amsgrad True where the config's optimizer has False: offload takes it from "
             "the config, the same for all groups; drop it from the group")
    _refused(lambda m: [{"params": list(m.parameters()), "bias_correction": False}],
             r"param_groups\[0\] sets bias_correction False where the config's optimizer has True")
    _refused(lambda m: [{"params": list(m.parameters()), "lr": -1e-3}],
             r"param_groups\[0\]\['lr'\] is -0.001; give a finite number >= 0")
    _refused(lambda m: [{"params": list(m.parameters()), "betas": [0.9, 1.0]}],
             r"param_groups\[0\]\['betas'\] is \[0.9, 1.0\]; give two numbers in \[0, 1\), as \(0.9, 0.999\)")
    _refused(lambda m: [{"params": list(m.parameters()), "betas": 0.9}], r"param_groups\[0\]\['betas'\] is 0.9; give")
    _refused(lambda m: [{"params": list(m.parameters()), "eps": -1e-8}],
             r"param_groups\[0\]\['eps'\] is -1e-08; give a finite number >= 0")
    _refused(lambda m: [{"params": list(m.parameters()), "weight_decay": -0.1}],
             r"param_groups\[0\]\['weight_decay'\] is -0.1")
    _refused(lambda m: [{"params": list(m.parameters())}, {"params": [m.gain]}],
             r"gain is in param_groups\[0\] and in param_groups\[1\]")
    _refused(lambda m: [{"params": [p for p in m.parameters() if p is not m.norm.bias]}],
             "param_groups leaves out the trainable parameters norm.bias; put them in a group, or freeze them")
    _refused(lambda m: [{"params": list(m.parameters()) + [torch.nn.Parameter(torch.ones(3))]}],
             r"holds a tensor of shape \(3,\) that is not a parameter of the model")
    _refused(lambda m: [list(m.parameters())], r"param_groups\[0\] is list; give every group as a dict")
    _refused(lambda m: {"params": list(m.parameters())}, "got a dict; wrap it in a list")
    _refused(lambda m: m, r"param_groups was given the model \(TinyLM\); pass model.parameters\(\)")
    _refused(lambda m: 0.1, "got a float; wrap it in a list")


def test_the_forms_torch_takes_are_taken(tmp_path):
    """Pairs from named_parameters, labels and implementation flags, the config's
    own values, one tensor, numpy and tensor decays, a parameter twice in its group."""
    forms = {
        "named": lambda m: m.named_parameters(),
        "labelled": lambda m: [{"params": list(m.named_parameters()), "name": "all", "param_names": [], "fused": None,
                                "lr": 3e-3, "betas": (0.9, 0.99), "eps": torch.tensor(1e-8), "amsgrad": False,
                                "weight_decay": np.float32(0.0)}],
        "one tensor": lambda m: [{"params": m.gain, "weight_decay": torch.tensor(0.0)},
                                 {"params": [p for p in m.parameters() if p is not m.gain] + [m.norm.bias]}],
    }
    runs = {"named": (), "labelled": ((0, 3336, GroupHyper(0.0)),), "one tensor": ((0, 24, GroupHyper(0.0)),)}
    for name, groups_of in forms.items():
        model = make_model()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with offload.initialize(model, _config(2, "cpu", tmp_path), param_groups=groups_of(model)) as engine:
                assert engine.optimizer.runs.runs == runs[name], name
                assert engine.get_lr() == [3e-3] * len(list(groups_of(model)) if name != "named" else [0])
        assert not [w for w in caught if "param_groups" in str(w.message)], name
    model = make_model()
    with pytest.warns(UserWarning, match=r"param_groups\[0\] has 'weight_dacay', which offload does not read"):
        offload.initialize(model, _config(2, "cpu", tmp_path), param_groups=[
            {"params": model.parameters(), "weight_dacay": 0.0}]).close()


def test_frozen_parameters_need_no_group(tmp_path):
    model = make_model()
    model.norm.requires_grad_(False)
    groups = [{"params": [p for p in model.parameters() if p.requires_grad], "weight_decay": 0.0}]
    reference = copy.deepcopy(model)
    with offload.initialize(model, _config(2, "cpu", tmp_path), param_groups=groups) as engine:
        trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
        assert engine.optimizer.runs.runs == ((0, trained, GroupHyper(0.0)),)  # the padding after them decays nothing
        assert torch.equal(engine.state_dict()["norm.weight"], reference.norm.weight)
    assert os.listdir(tmp_path) == []


def test_a_checkpoint_records_the_groups_and_a_load_says_when_they_differ(tmp_path):
    cfg = _config(2, "cpu", tmp_path)
    with train_engine(make_model(), 2, 2, cfg, groups=three_groups) as engine:
        engine.save_checkpoint(str(tmp_path / "ckpt"))
    said = {}
    for grouped in (True, False):
        model = make_model()
        with offload.initialize(model, cfg, param_groups=three_groups(model) if grouped else None) as engine:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                engine.load_checkpoint(str(tmp_path / "ckpt"))
        said[grouped] = [str(w.message) for w in caught if "load_checkpoint" in str(w.message)]
    assert said[True] == []
    decay, rate, betas, eps = said[False]
    assert "load_checkpoint: 7 parameters (gain, embed.weight, blocks.0.0.bias, " in decay, said
    assert "were trained with another weight decay than this engine applies (gain: 0.0 saved, 0.1 now)" in decay
    assert "load_checkpoint: 7 parameters (gain, embed.weight, blocks.0.0.bias, " in rate, said
    assert "another rate relative to the config's than this engine applies (gain: 2.0 saved, 1.0 now)" in rate
    assert "load_checkpoint: 6 parameters (gain, blocks.0.0.bias, " in betas, said
    assert "another betas than this engine applies (gain: (0.8, 0.95) saved, (0.9, 0.99) now)" in betas
    assert "load_checkpoint: 1 parameters (embed.weight) were trained with another eps than this engine applies " \
           "(embed.weight: 0.0001 saved, 1e-08 now)" in eps
    other = {**cfg, "optimizer": {**cfg["optimizer"], "params": {**cfg["optimizer"]["params"], "betas": [0.5, 0.6]}}}
    model = make_model()
    with offload.initialize(model, other, param_groups=three_groups(model)) as engine:
        with pytest.warns(UserWarning, match=r"load_checkpoint: 4 parameters \(embed.weight, blocks.0.0.weight, .* "
                                             r"another betas than this engine applies \(embed.weight: \(0.9, 0.99\) "
                                             r"saved, \(0.5, 0.6\) now\)"):  # the config's: all but the third group's
            engine.load_checkpoint(str(tmp_path / "ckpt"))


def test_a_load_says_when_the_learning_rate_resumes_at_the_saved_one(tmp_path):
    """Without a schedule the saved rate comes back (as in DeepSpeed), over the
    loading engine's config: said, with the way to change it; not said when equal."""
    cfg = _config(2, "cpu", tmp_path)
    with train_engine(make_model(), 1, 2, cfg) as engine:
        engine.save_checkpoint(str(tmp_path / "ckpt"))
        saved = engine.lr
    lower = {**cfg, "optimizer": {**cfg["optimizer"], "params": {**cfg["optimizer"]["params"], "lr": saved / 2}}}
    for loading, said in ((lower, True), (cfg, False)):
        with offload.initialize(make_model(), loading) as engine:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                engine.load_checkpoint(str(tmp_path / "ckpt"))
            assert engine.lr == saved
        told = [str(w.message) for w in caught if "learning rate" in str(w.message)]
        assert told == ([f"load_checkpoint: the learning rate resumes at the saved {saved:g}, not this engine's "
                         f"{saved / 2:g} (optimizer.params.lr, or the last engine.lr set); set engine.lr after "
                         "loading to train at another"] if said else []), told


# A warm-up to 4.5e-3, where the config's optimizer.params.lr is 3e-3: a group's lr is its rate at the peak.
PEAKING = {"type": "WarmupLR", "params": {"warmup_min_lr": 1.5e-3, "warmup_max_lr": 4.5e-3, "warmup_num_steps": 4,
                                          "warmup_type": "linear"}}
RATES = [1.5e-3, 1.5e-3, 2.25e-3, 3e-3, 3.75e-3, 4.5e-3, 4.5e-3]  # of optimizer steps 1-7, by hand
PEAK = 4.5e-3

SCHEDULED = {
    "stage1-none": (1, "none", None, {}),
    "stage2-cpu": (2, "cpu", None, {}),
    "stage2-nvme-overlap": (2, "nvme", None, {"offload_optimizer": {"overlap_step": True}}),
    "stage3-nvme-params-nvme": (3, "nvme", "nvme", {}),
}


@pytest.mark.parametrize("case", SCHEDULED)
def test_group_rates_follow_the_schedule_in_proportion(tmp_path, case):
    """Each group's rate is its lr times the schedule's rate over its peak, as
    torch's schedulers move groups; get_lr gives every group's."""
    stage, device, param_device, extra = SCHEDULED[case]
    cfg = _config(stage, device, tmp_path, param_device, scheduler=PEAKING, **extra)
    model = make_model()
    ref = copy.deepcopy(model)
    p = cfg["optimizer"]["params"]
    opt = torch.optim.AdamW(three_groups(ref), lr=p["lr"], betas=tuple(p["betas"]), eps=p["eps"],
                            weight_decay=p["weight_decay"], foreach=False)
    own_rates = [PEAK, 1e-3, 6e-3]  # the first group's is the config's: the schedule's peak
    with offload.initialize(model, cfg, param_groups=three_groups(model)) as engine:
        for step, rate in enumerate(RATES):
            for group, own in zip(opt.param_groups, own_rates):
                group["lr"] = own * rate / PEAK
            assert engine.get_lr() == pytest.approx([group["lr"] for group in opt.param_groups], rel=1e-12)
            opt.zero_grad()
            for micro in range(2):
                engine.backward(engine(batch(step, micro, 0)))
                engine.step()
                (ref(batch(step, micro, 0)) / 2).backward()
            torch.nn.utils.clip_grad_norm_(ref.parameters(), cfg["gradient_clipping"])
            opt.step()
        assert max_difference(engine.state_dict(), ref) < TOLERANCE


def test_a_groups_rate_is_its_schedulers_base_and_needs_a_config_rate(tmp_path):
    """Groups taken from a torch optimizer under a scheduler carry the
    scheduler's current rate in lr (0 at a warm-up's start) and their own in
    initial_lr: the engine takes initial_lr."""
    model = make_model()
    opt = torch.optim.AdamW(three_groups(model), lr=3e-3, betas=(0.9, 0.99))
    torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.0)
    assert [group["lr"] for group in opt.param_groups] == [0.0] * 3
    with offload.initialize(model, _config(2, "cpu", tmp_path), param_groups=opt.param_groups) as engine:
        assert engine.get_lr() == pytest.approx([3e-3, 1e-3, 6e-3], rel=1e-12)
    cfg = _config(2, "cpu", tmp_path)
    cfg["optimizer"]["params"]["lr"] = 0.0
    _refused(three_groups, r"param_groups\[1\] sets lr 0.001 where optimizer.params.lr is 0: a group's rate is kept "
             "as a multiple of the config's", cfg=cfg)
    _refused(lambda m: [{"params": list(m.parameters()), "initial_lr": -1e-3, "lr": 0.0}],
             r"param_groups\[0\]\['initial_lr'\] is -0.001; give a finite number >= 0")


def test_groups_none_of_which_is_at_the_configs_rate_are_warned_about(tmp_path):
    """A torch optimizer's groups all carry its lr, torch's default 1e-3 included."""
    model = make_model()
    groups = torch.optim.AdamW(model.parameters(), betas=(0.9, 0.99)).param_groups
    with pytest.warns(UserWarning, match=r"every group of param_groups sets its own lr, none at optimizer.params.lr "
                                         r"\(0.003\): every parameter trains at a multiple of the config's rate "
                                         r"\(param_groups\[0\] at 0.333333 times it\)"):
        offload.initialize(model, _config(2, "cpu", tmp_path), param_groups=groups).close()


@pytest.mark.parametrize("stage,device", [(1, "none"), (2, "cpu")])
def test_resuming_with_groups_is_bitwise(tmp_path, stage, device):
    cfg = _config(stage, device, tmp_path)
    with train_engine(make_model(), 4, 2, cfg, groups=three_groups) as straight:
        expected = straight.state_dict()
    with train_engine(make_model(), 2, 2, cfg, groups=three_groups) as first:
        first.save_checkpoint(str(tmp_path / "ckpt"))
    model = make_model()
    with offload.initialize(model, cfg, param_groups=three_groups(model)) as engine:
        engine.load_checkpoint(str(tmp_path / "ckpt"))
        for step in range(2, 4):
            for micro in range(2):
                engine.backward(engine(batch(step, micro, 0)))
                engine.step()
        resumed = engine.state_dict()
    assert all(torch.equal(resumed[k], expected[k]) for k in expected)
