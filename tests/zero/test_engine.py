"""Engine behaviour beyond equivalence: host memory stays within the configured
optimizer buffers with NVMe offload; the delayed update equals AdamW fed
one-step-stale gradients (world sizes 1 and 2, cpu and nvme); reports, state
dicts and config checks."""

import copy
import gc
import json
import math
import os
import warnings
import re

import psutil
import pytest
import torch
import torch.nn as nn

import offload
from offload import _native
from offload.errors import UsageError
from offload.zero.transfer import SIMULATE_ENV

from .harness import (
    batch,
    config,
    finish_rank,
    init_gloo,
    make_model,
    max_difference,
    spawn_ranks,
    train_engine,
    train_reference,
)

pytestmark = pytest.mark.skipif(not _native.status().available, reason="native library not built")


class Wide(nn.Module):
    """8.4M parameters in narrow-batch linear layers: 100 MB of optimizer state."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(8)])

    def forward(self, x):
        return self.layers(x).square().mean()


def test_nvme_offload_keeps_host_optimizer_state_within_the_buffers(tmp_path):
    torch.manual_seed(0)
    model = Wide()
    params = sum(p.numel() for p in model.parameters())
    state_bytes = 12 * params
    sub_group, buffers = 500_000, 2
    cfg = {"zero_optimization": {"stage": 2, "sub_group_size": sub_group, "reduce_bucket_size": 2_000_000,
                                 "offload_optimizer": {"device": "nvme", "nvme_path": str(tmp_path), "buffer_count": buffers}},
           "aio": {"block_size": 1 << 20}}
    engine = offload.initialize(model, cfg)
    x = torch.randn(4, 1024)
    engine.backward(engine(x))  # the first step allocates what steps keep (buckets, pool)
    engine.step()
    gc.collect()
    rss_before = psutil.Process().memory_info().rss
    peak = rss_before
    for _ in range(3):
        engine.backward(engine(x))
        engine.step()
        peak = max(peak, psutil.Process().memory_info().rss)
    report = engine.memory_report()
    pool = report[("optimizer state", "host (buffer pool)")]  # no CUDA to pin it
    limit = buffers * (12 * sub_group + 3 * 4096) + 3 * 4096 + 8192
    assert pool["peak_bytes"] <= limit < state_bytes / 8
    assert report[("optimizer state", "nvme")]["bytes"] >= state_bytes
    assert peak - rss_before < state_bytes / 4  # measured: 1.4 MB against 101 MB of state
    assert "optimizer state" in str(report) and "nvme" in str(report)
    engine.close()


def train_stale_reference(model: nn.Module, steps: int, world: int, warmup: int, cfg: dict) -> nn.Module:
    """torch's AdamW fed what the delayed update feeds it (Note [delayed parameter
    update]): after the warm-up and the first delayed step, each step's gradient
    is taken at the weights from before the previous update."""
    ref, stale = copy.deepcopy(model), copy.deepcopy(model)
    p = cfg["optimizer"]["params"]
    opt = torch.optim.AdamW(ref.parameters(), lr=p["lr"], betas=tuple(p["betas"]), eps=p["eps"],
                            weight_decay=p["weight_decay"], foreach=False)
    for step in range(steps):
        at = stale if step > warmup else ref
        at.zero_grad()
        for rank in range(world):
            (at(batch(step, 0, rank)) / world).backward()
        grads = [q.grad.clone() for q in at.parameters()]
        stale.load_state_dict(ref.state_dict())  # the weights before this update
        for q, g in zip(ref.parameters(), grads):
            q.grad = g
        torch.nn.utils.clip_grad_norm_(ref.parameters(), cfg["gradient_clipping"])
        opt.step()
    return ref


DPU_STEPS, DPU_WARMUP = 8, 2


def _dpu_config(device: str, nvme: str | None) -> dict:
    return config(2, device, 1, nvme, offload_optimizer={"delayed_update": True, "delayed_update_warmup": DPU_WARMUP})


@pytest.mark.parametrize("device", ["cpu", "nvme"])
def test_delayed_update_equals_adamw_fed_one_step_stale_gradients(tmp_path, device):
    cfg = _dpu_config(device, str(tmp_path) if device == "nvme" else None)
    ref = train_stale_reference(make_model(), DPU_STEPS, 1, DPU_WARMUP, cfg)
    fresh = train_reference(make_model(), DPU_STEPS, 1, 1, cfg)
    with train_engine(make_model(), DPU_STEPS, 1, cfg) as engine:
        state = engine.state_dict()  # applies the update still in flight
        assert max_difference(state, ref) < 1e-5
        assert max_difference(state, fresh) > 1e-3  # staleness is visible: the reference is not the plain path
    assert os.listdir(tmp_path) == []


def _dpu_world2_worker(rank: int, port: int, out_dir: str) -> None:
    init_gloo(rank, 2, port)
    nvme = os.path.join(out_dir, f"nvme{rank}")
    os.makedirs(nvme)
    cfg = _dpu_config("nvme", nvme)
    ref = train_stale_reference(make_model(), DPU_STEPS, 2, DPU_WARMUP, cfg)
    with train_engine(make_model(), DPU_STEPS, 1, cfg, rank=rank) as engine:
        difference = max_difference(engine.state_dict(), ref)
    finish_rank(out_dir, rank, difference)


def test_delayed_update_at_world_size_2_equals_stale_adamw(tmp_path):
    for rank, difference in enumerate(spawn_ranks(_dpu_world2_worker, tmp_path)):
        assert difference < 1e-5, rank
        assert os.listdir(tmp_path / f"nvme{rank}") == []


def test_state_dict_has_the_models_keys_and_tied_weights():
    model = make_model()
    with train_engine(model, 2, 1, config(2, "none", 1)) as engine:
        state = engine.state_dict()
        assert list(state) == list(model.state_dict())
        assert torch.equal(state["embed.weight"], state["head.weight"])


@pytest.mark.skipif(os.environ.get(SIMULATE_ENV) == "1", reason="an asynchronous device needs the staging copy")
def test_weights_written_in_place_keep_no_staging_copy_of_the_shard():
    """A CPU accelerator at stage 2: the optimizer writes into the flat buffer;
    only a sub-group spanning two buckets' parts (sub-groups of 700, buckets
    of 1500) goes through a scratch buffer of its own size, not d*n bytes."""
    engine = train_engine(make_model(), 2, 1, config(2, "cpu", 1))
    with engine:
        weights = {kind: entry["peak_bytes"] for (kind, _), entry in engine.memory_report().items()
                   if kind.startswith("weights")}
    assert set(weights) == {"weights", "weights (scratch, one sub-group)"}
    assert weights["weights (scratch, one sub-group)"] == 4 * 700 < engine.layout.owned


@pytest.mark.parametrize("stage,param_device", [(3, "cpu"), (2, None)])
def test_a_bucket_of_one_parameter_hands_its_gradient_on_without_a_copy(stage, param_device):
    """Note [a bucket of one]: the owned gradient gets the very tensor autograd
    made, not a zeroed bucket it was added into and copied out of. Stage 3
    has a bucket per parameter; at stage 2, with buckets of 500 elements, a
    576-element weight is alone in one. Buckets that are padded (1464 and 24
    elements) or shared keep theirs."""
    cfg = config(stage, "cpu", 1, param_device=param_device)
    cfg["zero_optimization"]["reduce_bucket_size"] = 500
    model, arrived, added = make_model(), {}, []
    for name, param in model.named_parameters():  # registered first, so they run before the engine's
        param.register_post_accumulate_grad_hook(lambda p, name=name: arrived.__setitem__(name, p.grad))
    engine = offload.initialize(model, cfg)
    add = engine.gradient.add
    engine.gradient.add = lambda lo, hi, values: (added.append(values), add(lo, hi, values))
    with engine:
        engine.backward(engine(batch(0, 0, 0)))
    alone = {f"blocks.{i}.0.weight" for i in range(3)}
    assert {s.name for s in engine.layout.slots if engine.layout.buckets[s.bucket].is_one_parameter} == alone
    handed_on = {v.untyped_storage().data_ptr() for v in added}  # all alive: no address was reused
    assert {name for name, grad in arrived.items() if grad.untyped_storage().data_ptr() in handed_on} == alone


def test_batch_size_mismatch_is_refused():
    with pytest.raises(ValueError, match="train_batch_size 10 != train_micro_batch_size_per_gpu 3"):
        offload.initialize(make_model(), {**config(2, "none", 1), "train_batch_size": 10})


def test_a_deepspeed_config_without_accumulation_accumulates_what_its_batch_sizes_say():
    """Note [batch sizes]: train_batch_size 9 of micro-batches of 3 on one rank is
    3 micro-batches a step, as DeepSpeed derives it; the steps are those of
    accumulation 3 given outright."""
    derived = config(2, "cpu", 1)
    del derived["gradient_accumulation_steps"]
    derived["train_batch_size"] = 3 * derived["train_micro_batch_size_per_gpu"]
    engines = [offload.initialize(make_model(), cfg) for cfg in (derived, config(2, "cpu", 3))]
    assert [e.accumulation for e in engines] == [3, 3]
    for engine in engines:
        for micro in range(3):
            engine.backward(engine(batch(0, micro, 0)))
            engine.step()
        assert engine.global_steps == 1
    a, b = (e.module.state_dict() for e in engines)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_the_deepspeed_batch_getters_and_boundary_answer_as_there():
    cfg = config(2, "cpu", 1)
    del cfg["gradient_accumulation_steps"]
    cfg["train_batch_size"] = 3 * cfg["train_micro_batch_size_per_gpu"]
    with offload.initialize(make_model(), cfg) as engine:
        micro = cfg["train_micro_batch_size_per_gpu"]
        assert (engine.train_batch_size(), engine.train_micro_batch_size_per_gpu(),
                engine.gradient_accumulation_steps()) == (3 * micro, micro, 3)
        assert engine.zero_optimization_stage() == 2 and engine.local_rank == 0 and not engine.was_step_applied()
        before, between, applied = [], [], []  # asked before each micro-batch's backward, between it and its step()
        for step in range(2):
            for m in range(3):
                before.append(engine.is_gradient_accumulation_boundary())
                engine.backward(engine(batch(step, m, 0)))
                between.append(engine.is_gradient_accumulation_boundary())
                engine.step()
                applied.append(engine.was_step_applied())
        assert before == between == applied == [False, False, True] * 2 and engine.global_steps == 2
        assert engine.global_samples == 2 * 3 * micro
        engine.set_gradient_accumulation_boundary(True)  # ends the window at the next backward
        assert engine.is_gradient_accumulation_boundary()
        engine.backward(engine(batch(2, 0, 0)))
        assert engine.is_gradient_accumulation_boundary()
        engine.step()
        assert engine.global_steps == 3 and not engine.is_gradient_accumulation_boundary()


def test_a_step_skipped_for_an_fp16_overflow_was_not_applied():
    cfg = config(2, "cpu", 1, fp16={"enabled": True, "initial_scale_power": 4, "hysteresis": 1})
    with offload.initialize(make_model(), cfg) as engine:
        for step, factor in enumerate([1.0, float("inf"), 1.0]):
            engine.backward(engine(batch(step, 0, 0)) * factor)
            engine.step()
            assert engine.was_step_applied() == (factor == 1.0), step
        assert engine.skipped_steps == 1 and engine.global_samples == 3 * cfg["train_micro_batch_size_per_gpu"]


def test_a_torch_optimizers_attributes_on_engine_optimizer_say_where_they_went():
    with offload.initialize(make_model(), config(2, "cpu", 1)) as engine:
        for name in ("param_groups", "zero_grad", "state", "state_dict", "step"):  # FSDP's and torchao's habits
            with pytest.raises(AttributeError, match=f"not a torch.optim.Optimizer, so it has no {name}: "
                                                     r"engine.get_lr\(\) reads"):
                getattr(engine.optimizer, name)
        assert not hasattr(engine.optimizer, "nonsense")


def test_a_save_to_a_wrong_place_is_refused_before_any_work(tmp_path, monkeypatch):
    """Each save checks where it writes first, as the CLI does: a directory
    given as a file, a file as a directory, a missing parent."""
    afile = tmp_path / "afile"
    afile.write_text("x")
    (tmp_path / "adir").mkdir()
    os.symlink(tmp_path / "nowhere", tmp_path / "dangling")
    with offload.initialize(make_model(), config(2, "cpu", 1)) as engine:
        engine.backward(engine(batch(0, 0, 0)))
        engine.step()

        def no_work(*args, **kwargs):
            raise AssertionError("the save started its work before checking where it writes")

        monkeypatch.setattr(engine, "full_weights", no_work)
        monkeypatch.setattr(engine, "shard_state", no_work)
        for save, message in [
            (lambda: engine.export(str(tmp_path)), f"export: {tmp_path} is a directory; name the file to write in it"),
            (lambda: engine.export(str(tmp_path / "no" / "m.safetensors")),
             f"export: directory {tmp_path / 'no'} does not exist; create it first"),
            (lambda: engine.save_pretrained(str(afile)), f"save_pretrained: {afile} is not a directory; name a directory"),
            (lambda: engine.save_checkpoint(str(afile / "ckpt")), f"save_checkpoint: {afile} is not a directory"),
            (lambda: engine.save_pretrained(f"{afile}/"), f"save_pretrained: {afile} is not a directory"),
            (lambda: engine.save_16bit_model(str(tmp_path / "dangling")),
             f"save_16bit_model: {tmp_path / 'dangling'} is not a directory"),
            (lambda: engine.export(str(afile / "m.safetensors")), f"export: {afile} is not a directory"),
            (lambda: engine.export(str(afile / "sub" / "m.safetensors")), f"export: {afile} is not a directory"),
            (lambda: engine.export(""), "export: an empty path names no file"),
            (lambda: engine.save_checkpoint(""), "save_checkpoint: an empty path names no directory"),
            (lambda: engine.save_16bit_model(str(tmp_path), "adir"),
             f"save_16bit_model: {tmp_path / 'adir'} is a directory; name the file"),
        ]:
            with pytest.raises(UsageError, match=re.escape(message)):
                save()
        assert sorted(os.listdir(tmp_path)) == ["adir", "afile", "dangling"]


def test_step_acts_only_at_accumulation_boundaries():
    engine = offload.initialize(make_model(), config(2, "cpu", 3))
    before = {k: v.clone() for k, v in engine.module.state_dict().items()}
    for micro in range(2):
        engine.backward(engine(batch(0, micro, 0)))
        engine.step()
    assert engine.global_steps == 0
    assert all(torch.equal(before[k], v) for k, v in engine.module.state_dict().items())
    engine.backward(engine(batch(0, 2, 0)))
    engine.step()
    engine.step()  # a second call at the same boundary does nothing
    assert engine.global_steps == 1
    engine.close()


class Outputs(nn.Module):
    """A model whose forward takes keyword inputs and returns its loss inside an
    output, as Hugging Face models do; ``kind`` picks the output's form."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.inner = make_model()

    def forward(self, input_ids: torch.Tensor, scale: float = 1.0):
        loss = self.inner(input_ids) * scale
        if self.kind == "object":
            return type("ModelOutput", (), {"loss": loss, "logits": None})()
        if self.kind == "dict":
            return {"loss": loss, "logits": None}
        return (loss, None)


@pytest.mark.parametrize("kind", ["object", "dict", "tuple"])
def test_backward_takes_a_model_output_and_forward_passes_keywords(kind):
    with offload.initialize(Outputs(kind), config(2, "cpu", 1)) as engine, \
            offload.initialize(make_model(), config(2, "cpu", 1)) as plain:
        for step in range(3):
            engine.backward(engine(**{"input_ids": batch(step, 0, 0), "scale": 1.0}))
            engine.step()
            plain.backward(plain(batch(step, 0, 0)))
            plain.step()
        a, b = engine.state_dict(), plain.state_dict()
        assert all(torch.equal(a[f"inner.{k}"], b[k]) for k in b)
        with pytest.raises(ValueError, match="engine.backward needs the loss"):
            engine.backward({"logits": None})


@pytest.mark.parametrize("stage,param_device", [(2, None), (3, "cpu"), (3, "none")])
def test_two_losses_of_one_forward_each_given_to_backward(stage, param_device):
    """DeepSpeed's backward(loss, retain_graph=True): another loss of the same
    forward goes back through the graph after it, and the step applies the
    sum of both gradients, as torch's."""
    cfg = config(stage, "cpu", 1, param_device=param_device)
    ref = make_model()
    p = cfg["optimizer"]["params"]
    adamw = torch.optim.AdamW(ref.parameters(), lr=p["lr"], betas=p["betas"], eps=p["eps"],
                              weight_decay=p["weight_decay"], foreach=False)
    with offload.initialize(make_model(), cfg) as engine:
        for step in range(3):
            loss = engine(batch(step, 0, 0))
            engine.backward(loss, retain_graph=True)
            engine.backward(loss.square())
            engine.step()
            expected = ref(batch(step, 0, 0))
            expected.backward(retain_graph=True)
            expected.square().backward()
            torch.nn.utils.clip_grad_norm_(ref.parameters(), cfg["gradient_clipping"])
            adamw.step()
            adamw.zero_grad()
        assert max_difference(engine.state_dict(), ref) < 1e-5


def test_a_graph_kept_by_every_backward_is_let_go_at_the_step():
    """Note [pass hooks]: stage 3 keeps a retaining backward's gradient hooks
    for another backward through its graph, and drops them at the step, so a
    loop that retains every graph holds no more than one step's."""
    with offload.initialize(make_model(), config(3, "cpu", 1, param_device="cpu")) as engine:
        kept, after_step = [], []
        for step in range(4):
            engine.backward(engine(batch(step, 0, 0)), retain_graph=True)
            kept.append(len(engine.weights._pass_hooks))
            engine.step()
            after_step.append(len(engine.weights._pass_hooks))
        assert min(kept) > 0 and after_step == [0] * 4


@pytest.mark.parametrize("stage,device,param_device", [(2, "cpu", None), (3, "nvme", "nvme"), (3, "none", "none")])
def test_close_gives_the_model_back_in_its_dtype_with_the_trained_weights(tmp_path, stage, device, param_device):
    model = make_model()
    model.register_buffer("counter", torch.arange(3))  # integer buffers keep their dtype throughout
    model.register_buffer("shift", torch.full((2,), 0.1), persistent=False)  # runs in the compute dtype
    frequencies = 1 / 1e4 ** torch.linspace(0, 1, 5)  # a rotary table: keeps its dtype (Note [buffers in low precision])
    model.norm.register_buffer("inv_freq", frequencies.clone(), persistent=False)
    dtypes = {k: v.dtype for k, v in model.state_dict().items()}
    engine = train_engine(model, 2, 1, config(stage, device, 1, str(tmp_path), param_device=param_device,
                                              bf16={"enabled": True}))
    assert next(model.parameters()).dtype == torch.bfloat16
    assert (model.shift.dtype, model.counter.dtype) == (torch.bfloat16, torch.int64)
    assert torch.equal(model.norm.inv_freq, frequencies)
    trained = engine.state_dict()
    engine.close()
    state = model.state_dict()
    assert {k: v.dtype for k, v in state.items()} == dtypes and torch.equal(model.norm.inv_freq, frequencies)
    assert model.shift.dtype == torch.float32
    assert all(torch.equal(state[k], trained[k]) for k in trained)
    assert model.head.weight is model.embed.weight  # still tied
    model(batch(0, 0, 0)).backward()  # an ordinary module again


def test_close_can_leave_a_stage_3_model_unmaterialised(tmp_path):
    model = make_model()
    engine = train_engine(model, 1, 1, config(3, "cpu", 1, param_device="cpu"))
    engine.close(restore_model=False)
    assert model.blocks[1][0].weight.untyped_storage().size() == 0  # a model too big for memory stays so


@pytest.mark.parametrize("stage,param_device", [(2, None), (3, "cpu")])
def test_a_model_another_engine_trains_is_refused_until_that_engine_closes(stage, param_device):
    model = make_model()
    first = train_engine(model, 1, 1, config(stage, "cpu", 1, param_device=param_device))
    with pytest.raises(UsageError, match="a model another engine still trains .* call that engine's close"):
        offload.initialize(model, config(stage, "cpu", 1, param_device=param_device))
    if stage == 2:  # the engine's mark is beside the model: a deep copy is a model of its own
        offload.initialize(copy.deepcopy(model), config(stage, "cpu", 1)).close()
    first.close()
    second = train_engine(model, 1, 1, config(stage, "cpu", 1, param_device=param_device))  # given back: trains again
    assert second.global_steps == 1
    second.close()


def test_initialize_names_what_it_takes_when_given_no_module():
    with pytest.raises(UsageError, match="takes a torch.nn.Module, got str; .* offload.from_pretrained"):
        offload.initialize("gpt2", config(2, "cpu", 1))


def test_a_missing_swap_directory_is_named_by_its_key(tmp_path):
    missing = str(tmp_path / "absent")
    with pytest.raises(UsageError, match=r"zero_optimization.offload_param.nvme_path '.*absent' is not an existing "
                                         r"directory; create it, or point it at one \(nvme_path=DIR, given to "
                                         r"offload.initialize or OffloadTrainer, replaces"):
        offload.initialize(make_model(), config(3, "cpu", 1, missing, param_device="nvme"))
    given = config(3, "cpu", 1, str(tmp_path), param_device="nvme")
    with pytest.raises(UsageError, match=r"^nvme_path='.*absent' is not an existing directory; create it, or pass one "
                                         r"that exists$"):  # named as the caller gave it
        offload.initialize(make_model(), given, nvme_path=missing)
    with pytest.raises(UsageError, match=r"^nvme_path='.*absent' is not an existing directory"):
        with offload.init(given, nvme_path=missing):
            pass


def test_an_initialize_nvme_path_without_an_nvme_tier_is_said(tmp_path):
    with pytest.warns(UserWarning, match=r"nvme_path='.*' has no effect here: no tier of this config is on nvme"):
        engine = offload.initialize(make_model(), config(2, "cpu", 1), nvme_path=tmp_path)
    engine.close()


def test_the_initialize_nvme_path_replaces_the_configs(tmp_path):
    shipped = os.path.join(os.path.dirname(__file__), "..", "..", "configs", "zero2_nvme.json")
    with open(shipped) as f:
        assert json.load(f)["zero_optimization"]["offload_optimizer"]["nvme_path"] == "/local_nvme"
    with offload.initialize(make_model(), shipped, nvme_path=tmp_path) as engine:
        engine.backward(engine(batch(0, 0, 0)))
        engine.step()
        assert engine.disk_traffic().bytes_written > 0 and len(os.listdir(tmp_path)) == 1  # its run directory
    assert os.listdir(tmp_path) == []


def test_the_cpu_adam_uses_the_threads_it_is_given(monkeypatch):
    from offload.zero import optimizer as optimizer_module

    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    used = set()
    real = optimizer_module.adam_step
    monkeypatch.setattr(optimizer_module, "adam_step", lambda *a, **k: (used.add(k["threads"]), real(*a, **k))[1])
    with train_engine(make_model(), 1, 1, config(2, "cpu", 1)):
        pass
    assert used == {1}


def test_where_things_run_is_said_once(monkeypatch):
    from offload import engine as engine_module
    from offload.zero import stage3

    monkeypatch.setattr(stage3, "_told_where", False)
    with pytest.warns(UserWarning, match="offload_param.device is none, so each rank's partition") as caught:
        offload.initialize(make_model(), config(3, "cpu", 1)).close()
        offload.initialize(make_model(), config(3, "cpu", 1)).close()
    assert len([w for w in caught if "partition of the weights" in str(w.message)]) == 1
    monkeypatch.setattr(engine_module, "_warned_cpu", False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.warns(UserWarning, match="parameters are on the CPU although CUDA is available") as caught:
        engine_module._warn_if_cpu_beside_cuda(torch.device("cpu"))
        engine_module._warn_if_cpu_beside_cuda(torch.device("cpu"))
    assert len(caught) == 1


def test_looking_at_a_delayed_update_does_not_change_it():
    """A memory report, a state dict or the disk traffic mid-run wait for the
    worker but leave its weights unpublished: the schedule, and so the
    training, is the same as a run nobody looked at."""
    cfg = _dpu_config("cpu", None)
    with train_engine(make_model(), DPU_STEPS, 1, cfg) as quiet:
        expected = quiet.state_dict()
    with offload.initialize(make_model(), cfg) as watched:
        for step in range(DPU_STEPS):
            watched.backward(watched(batch(step, 0, 0)))
            watched.step()
            watched.memory_report()
            watched.disk_traffic()
            watched.state_dict()
        state = watched.state_dict()
    assert all(torch.equal(state[k], expected[k]) for k in expected)


@pytest.mark.parametrize("stage, device", [(2, "cpu"), (3, "nvme")])
def test_windows_of_any_length_when_the_loop_says_where_they_end(tmp_path, stage, device):
    """set_gradient_accumulation_boundary, as a Trainer uses it: windows of 3, 1
    and 2 micro-batches with accumulation 2, each loss divided by 2 (DeepSpeed's
    rule): AdamW stepped after the same windows, within 1e-5 after 3 steps."""
    windows = [3, 1, 2]
    cfg = config(stage, device, 2, str(tmp_path), param_device="cpu" if stage == 3 else None)
    model = make_model()
    ref = copy.deepcopy(model)
    p = cfg["optimizer"]["params"]
    opt = torch.optim.AdamW(ref.parameters(), lr=p["lr"], betas=tuple(p["betas"]), eps=p["eps"],
                            weight_decay=p["weight_decay"], foreach=False)
    engine = offload.initialize(model, cfg)
    for step, length in enumerate(windows):
        opt.zero_grad()
        for micro in range(length):
            (ref(batch(step, micro, 0)) / 2).backward()
            engine.set_gradient_accumulation_boundary(micro == length - 1)
            engine.backward(engine(batch(step, micro, 0)))
            engine.step()
            assert engine.global_steps == step + (micro == length - 1)
        torch.nn.utils.clip_grad_norm_(ref.parameters(), cfg["gradient_clipping"])
        opt.step()
    assert engine.micro_steps == sum(windows) and engine.pending_micro_steps == 0
    assert max_difference(engine.state_dict(), ref) < 1e-5
    engine.close()


@pytest.mark.parametrize("stage,param_device", [(2, None), (3, "cpu")])
def test_loss_backward_in_place_of_engine_backward_is_refused_and_leaks_nothing(stage, param_device):
    """The plain-PyTorch habit: the gradient would be neither scaled nor
    stepped, and would join the next window; refused at the first gradient,
    and training goes on as if that backward had never run."""
    cfg = config(stage, "cpu", 1, param_device=param_device)
    engine = offload.initialize(make_model(), cfg)
    with pytest.raises(UsageError, match=r"got a gradient from a backward its engine did not start: .*"
                                         r"call engine.backward\(loss\) in place of loss.backward\(\)"):
        engine(batch(9, 0, 0)).backward()
    for step in range(2):
        loss = engine(batch(step, 0, 0))
        assert engine.backward(loss) is loss  # as DeepSpeed's: loss = engine.backward(loss)
        engine.step()
    ref = train_reference(make_model(), 2, 1, 1, cfg)
    assert engine.global_steps == 2 and max_difference(engine.state_dict(), ref) < 1e-5
    engine.close()


@pytest.mark.parametrize("stage,param_device", [(2, None), (3, "cpu")])
def test_a_closed_engine_refuses_to_train_or_save(tmp_path, stage, param_device):
    """At stage 3 a closed engine's forward, backward and step used to run and
    count steps while training nothing."""
    engine = offload.initialize(make_model(), config(stage, "cpu", 1, param_device=param_device))
    loss = engine(batch(0, 0, 0))
    engine.close()
    calls = {"engine(...)": lambda: engine(batch(0, 0, 0)), "engine.backward": lambda: engine.backward(loss),
             "engine.step": engine.step, "engine.state_dict": engine.state_dict,
             "engine.save_checkpoint": lambda: engine.save_checkpoint(str(tmp_path)),
             "engine.gathered": lambda: engine.gathered(list(engine.module.parameters())[:1])}
    for name, call in calls.items():
        with pytest.raises(UsageError, match=rf"^{re.escape(name)} after engine.close\(\): .* make a new one"):
            call()
    assert engine.global_steps == 0 and os.listdir(tmp_path) == []


def test_a_low_precision_model_under_an_fp32_config_is_said():
    with pytest.warns(UserWarning, match=r'parameters are bfloat16, but the config enables neither bf16 nor fp16.*'
                                         r'"bf16": \{"enabled": true\}'):
        offload.initialize(make_model().to(torch.bfloat16), config(2, "cpu", 1)).close()
    adapted = make_model().to(torch.bfloat16)  # a LoRA's way: a frozen bf16 base, fp32 adapters
    adapted.requires_grad_(False)
    adapted.gain = nn.Parameter(torch.ones(adapted.gain.shape))
    with pytest.warns(UserWarning, match=r"parameters are bfloat16, but the config enables neither"):
        offload.initialize(adapted, config(2, "cpu", 1)).close()
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        warnings.filterwarnings("ignore", message=".*no effect here")
        offload.initialize(make_model().to(torch.bfloat16), config(2, "cpu", 1, bf16={"enabled": True})).close()


@pytest.mark.parametrize("threshold,said", [(10**9, True), (30, False)])
def test_stage_3_that_partitions_nothing_is_said(threshold, said):
    cfg = config(3, "cpu", 1, param_device="cpu")
    cfg["zero_optimization"]["stage3_param_persistence_threshold"] = threshold
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        offload.initialize(make_model(), cfg).close()
    told = [w for w in caught if "partitions none of them" in str(w.message)]
    assert bool(told) == said
    if said:
        assert told[0].filename == __file__  # the user's line, as a warnings filter by module needs
        told = [str(told[0].message)]
        assert f"stage3_param_persistence_threshold ({threshold:,})" in told[0]
        assert ("each rank's part of each still lives in offload_param.device 'cpu', written and read back once a "
                "step") in told[0]


def test_stage_3_that_partitions_nothing_says_only_that(tmp_path):
    """Not also what offload_param.max_in_cpu keeps in host memory, with advice to
    set it to 0, which would change nothing."""
    cfg = config(3, "cpu", 1, str(tmp_path), param_device="nvme")
    cfg["zero_optimization"]["stage3_param_persistence_threshold"] = 10**9
    cfg["zero_optimization"]["offload_param"]["max_in_cpu"] = 10**9
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        offload.initialize(make_model(), cfg).close()
    said = [str(w.message) for w in caught]
    assert any("partitions none of them" in m for m in said) and not any("max_in_cpu" in m for m in said), said


def test_deepspeeds_checkpoint_arguments(tmp_path):
    """save_latest as there; a partial load refused by name; nothing to load:
    (None, None) with a warning, as DeepSpeed's "resume if any" reads it."""
    engine = train_engine(make_model(), 1, 1, config(2, "cpu", 1))
    with pytest.warns(UserWarning, match=rf"{tmp_path / 'none'} holds no checkpoint .* returns \(None, None\)"):
        assert engine.load_checkpoint(str(tmp_path / "none")) == (None, None)
    engine.save_checkpoint(str(tmp_path / "c"), "a")
    engine.save_checkpoint(str(tmp_path / "c"), "b", save_latest=False)
    assert (tmp_path / "c" / "latest").read_text() == "a" and (tmp_path / "c" / "b" / "manifest.json").exists()
    for kwargs in [{"load_optimizer_states": False}, {"load_module_only": True}, {"load_lr_scheduler_states": False},
                   {"load_module_strict": False}]:
        (name, value), = kwargs.items()
        with pytest.raises(UsageError, match=rf"load_checkpoint\({name}={value}\) is not supported"):
            engine.load_checkpoint(str(tmp_path / "c"), **kwargs)
    assert engine.load_checkpoint(str(tmp_path / "c"), load_optimizer_states=True)[0].endswith("a")
    engine.close()


def test_a_parameter_moved_after_initialize_is_refused_by_name():
    """Replicated weights view the engine's flat buffer: a parameter given new
    storage (``model.to`` another device; on two CPU ranks Accelerate's device
    is ``cpu:0``, and ``.to`` copies) would train a copy no step updates."""
    model = make_model()
    engine = offload.initialize(model, config(2, "cpu", 1))
    engine.backward(engine(batch(0, 0, 0)))
    engine.step()
    name, param = next(iter(model.named_parameters()))
    param.data = param.data.clone()
    with pytest.raises(offload.OffloadError, match=f"parameter {name} no longer lives where the engine put it"):
        engine(batch(1, 0, 0))
    engine.close()


@pytest.mark.parametrize("stage", [2, 3])
def test_an_io_error_from_the_kernel_fails_the_step_and_the_last_checkpoint_loads(tmp_path, stage):
    """EIO reported by a kernel AIO completion of an optimizer-state read or
    write (Note [kernel faults]): the step fails naming the swap file, and the
    checkpoint saved before loads into a new engine that trains on."""
    cfg = config(stage, "nvme", 1, str(tmp_path), param_device="nvme" if stage == 3 else None)
    engine = offload.initialize(make_model(), cfg)
    engine.backward(engine(batch(0, 0, 0)))
    engine.step()
    engine.save_checkpoint(str(tmp_path / "ckpt"))
    expected = engine.state_dict()
    engine.optimizer.store.engine.kernel_faults(eio_result=1)
    with pytest.raises(offload.OffloadError, match=r"\.swap at offset \d+: Input/output error \(errno 5\)"):
        for step in range(1, 4):
            engine.backward(engine(batch(step, 0, 0)))
            engine.step()
        engine.synchronize()
    engine.close(restore_model=False)
    with offload.initialize(make_model(seed=3), cfg) as fresh:
        fresh.load_checkpoint(str(tmp_path / "ckpt"))
        state = fresh.state_dict()
        assert all(torch.equal(state[k], expected[k]) for k in expected)
        fresh.backward(fresh(batch(1, 0, 0)))
        fresh.step()
    assert [n for n in os.listdir(tmp_path) if n.startswith("offload-run-")] == []


def test_deepspeeds_engine_methods(tmp_path):
    """train/eval, get_lr and get_global_grad_norm, as a DeepSpeed loop calls them."""
    cfg = config(2, "cpu", 1)
    ref = train_reference(make_model(), 3, 1, 1, cfg)
    with train_engine(make_model(), 3, 1, cfg) as engine:
        assert engine.get_global_grad_norm() == pytest.approx(ref.grad_norms[-1], rel=1e-5)
        assert engine.eval() is engine and not any(m.training for m in engine.module.modules())
        assert engine.train() is engine and all(m.training for m in engine.module.modules())
        engine.lr = 1.5e-4
        assert engine.get_lr() == [1.5e-4]
    cfg["gradient_clipping"] = 0.0
    with train_engine(make_model(), 1, 1, cfg) as engine:
        assert engine.get_global_grad_norm() is None  # nothing needed the norm
    reference = make_model()
    reference(batch(0, 0, 0)).backward()
    expected = torch.linalg.vector_norm(torch.cat([p.grad.reshape(-1) for p in reference.parameters()])).item()
    fp16 = {**cfg, "fp16": {"enabled": True, "initial_scale_power": 8, "hysteresis": 1}}
    with train_engine(make_model(), 1, 1, fp16) as engine:
        assert engine.get_global_grad_norm() == pytest.approx(expected, rel=1e-2)  # fp16 needs it, clipping or not
        assert (engine.loss_scale, engine.skipped_steps, engine.applied_steps) == (2.0**8, 0, 1)
        engine.backward(engine(batch(1, 0, 0)) * math.inf)
        engine.step()
        assert engine.get_global_grad_norm() == math.inf  # skipped: not the last applied step's norm
        assert (engine.loss_scale, engine.skipped_steps, engine.applied_steps) == (2.0**7, 1, 1)


def test_unpacking_the_engine_as_deepspeeds_closes_it_and_gives_the_model_back(tmp_path):
    """`engine, *_ = offload.initialize(...)` binds nothing: the engine it
    built must not keep the model, or the corrected line is refused."""
    model = make_model()
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    cfg = config(3, "nvme", 1, str(tmp_path), param_device="nvme")
    with pytest.raises(TypeError, match=r"returns the engine alone, not DeepSpeed's \(engine, optimizer.* This "
                                        r"engine had not trained: it is closed and gave the model back"):
        engine, *_ = offload.initialize(model, cfg)
    assert all(torch.equal(p, before[name]) for name, p in model.named_parameters())
    assert [n for n in os.listdir(tmp_path) if n.startswith("offload-run-")] == []
    with offload.initialize(model, cfg) as engine:
        engine.backward(engine(batch(0, 0, 0)))
        engine.step()
        with pytest.raises(TypeError, match="holds no items"):
            "x" in engine
        with pytest.raises(TypeError, match=r"returns the engine alone.*your own data loader$"):
            list(engine)  # a trained engine iterated by mistake somewhere else: it stays
        engine.backward(engine(batch(1, 0, 0)))
        engine.step()


def test_deepspeeds_initialize_and_engine_names_work_or_say_where_they_went():
    """A script written for DeepSpeed: model_parameters is param_groups, the
    getters answer as there, and what offload does elsewhere is said by name."""
    cfg = config(2, "cpu", 1)
    model = make_model()
    decayed = [p for p in model.parameters() if p.dim() > 1]
    groups = [{"params": decayed}, {"params": [p for p in model.parameters() if p.dim() == 1], "weight_decay": 0.0}]
    with offload.initialize(model=model, config=cfg, model_parameters=groups) as engine:
        names = {id(p): n for n, p in model.named_parameters()}
        assert engine.group_of(names[id(groups[1]["params"][0])]).weight_decay == 0.0
        assert engine.group_of(names[id(decayed[0])]).weight_decay == cfg["optimizer"]["params"]["weight_decay"]
        assert (engine.fp16_enabled(), engine.bfloat16_enabled(), engine.gradient_clipping()) == (False, False, 0.5)
        assert (engine.global_rank, engine.world_size, engine.dp_world_size) == (0, 1, 1)
        for name, where in (("lr_scheduler", "the config's scheduler section runs inside engine.step"),
                            ("no_sync", "gradient_accumulation_steps"), ("get_loss_scale", "engine.loss_scale"),
                            ("set_requires_gradient_sync", "FSDP's switch between micro-batches"),
                            ("parameters", "engine.module is the model"), ("half", "sets the compute dtype")):
            with pytest.raises(AttributeError, match=f"offload's engine has no {name}: .*{re.escape(where)}"):
                getattr(engine, name)
            assert not hasattr(engine, name)
        with pytest.raises(AttributeError, match="has no cur_scale: engine.loss_scale"):
            engine.optimizer.cur_scale
        with pytest.raises(AttributeError, match="'Engine' object has no attribute 'nothing'"):
            engine.nothing
        with pytest.raises(AttributeError, match="offload's engine has no get_mom: engine.group_of"):
            engine.get_mom()
        model.generate = lambda: None  # as a Hugging Face model has it
        with pytest.raises(AttributeError, match=r"does not pass the model's attributes on: engine.module.generate"):
            engine.generate()
    # DeepSpeed's own defaults for its other arguments ask for nothing
    offload.initialize(model=make_model(), config=cfg, args=None, optimizer=None, lr_scheduler=None, mpu=None,
                       training_data=None, dist_init_required=None).close()
    with pytest.raises(UsageError, match="param_groups and model_parameters are both given"):
        offload.initialize(make_model(), cfg, param_groups=groups, model_parameters=groups)
    with pytest.raises(UsageError, match=r"does not take optimizer= \(the optimizer is the config's optimizer section"):
        offload.initialize(model, cfg, optimizer=torch.optim.AdamW(model.parameters()))
    with pytest.raises(UsageError, match=r"does not take config_params= \(it is DeepSpeed's old name for config"):
        offload.initialize(model=model, config_params=cfg)
    with pytest.raises(UsageError, match="offload.initialize needs a config"):
        offload.initialize(model=model)
    with pytest.raises(TypeError, match=r"unexpected keyword arguments \['confg'\]"):
        offload.initialize(model, confg=cfg)


@pytest.mark.parametrize("device", ["cpu", "nvme"])
def test_bias_correction_false_steps_without_it(tmp_path, device):
    """DeepSpeed's optimizer.params.bias_correction false: no 1 - beta^t
    divisors, against AdamW written out in float64 (with them, the first step
    alone would differ by a factor of 3, 0.1 / sqrt(1 - 0.999))."""
    torch.manual_seed(0)
    model = nn.Linear(8, 4)
    ref = [p.detach().double().clone() for p in model.parameters()]
    moments = [(torch.zeros_like(p), torch.zeros_like(p)) for p in ref]
    x = torch.randn(16, 8, generator=torch.Generator().manual_seed(1))
    lr, b1, b2, eps, wd = 1e-2, 0.9, 0.999, 1e-8, 0.1
    cfg = {"optimizer": {"type": "AdamW", "params": {"lr": lr, "betas": [b1, b2], "eps": eps, "weight_decay": wd,
                                                     "bias_correction": False}},
           "zero_optimization": {"stage": 2, "offload_optimizer": {"device": device, "nvme_path": str(tmp_path)}}}
    with offload.initialize(model, cfg) as engine:
        for _ in range(3):
            engine.backward(engine(x).square().mean())
            engine.step()
            params = [p.requires_grad_() for p in ref]
            grads = torch.autograd.grad(nn.functional.linear(x.double(), *params).square().mean(), params)
            with torch.no_grad():
                for p, g, (m, v) in zip(ref, grads, moments):
                    p.mul_(1 - lr * wd)
                    m.mul_(b1).add_(g, alpha=1 - b1)
                    v.mul_(b2).addcmul_(g, g, value=1 - b2)
                    p.sub_(lr * m / (v.sqrt() + eps))
        state = engine.state_dict()
    assert max((state[k].double() - p).abs().max().item() for k, p in zip(("weight", "bias"), ref)) < 1e-6


def test_a_config_without_an_optimizer_section_says_what_it_steps_with(tmp_path):
    """DeepSpeed builds no optimizer from such a config; here the engine steps
    the defaults, and says so, once, naming them; a file is read as a dict is."""
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 2}}))
    for given in ({}, {"zero_optimization": {"stage": 2}}, str(path)):
        with pytest.warns(UserWarning) as caught:
            offload.initialize(nn.Linear(4, 4), given).close()
        (warning,) = [w for w in caught if "optimizer section" in str(w.message)]
        assert str(warning.message) == (
            "offload.initialize: the config has no optimizer section, so the engine steps AdamW with lr 0.001, betas "
            "(0.9, 0.999), eps 1e-08 and weight_decay 0.0 (offload's defaults); give an optimizer section to choose "
            "them"), given
        assert warning.filename == __file__  # the user's line
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        offload.initialize(nn.Linear(4, 4), {"optimizer": {"params": {"lr": 0.1}}}).close()
