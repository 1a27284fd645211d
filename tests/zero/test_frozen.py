"""Frozen parameters (``requires_grad`` false: a LoRA's base model): the
engine trains the rest as AdamW does at every stage and world sizes 1 and 2;
at stage 3 the frozen ones are partitioned and paged like the trained ones,
in every weight tier, and still reach state_dict, checkpoints and close."""

import json
import os
import re
import zlib

import pytest
import torch

import offload
from offload import _native
from offload.checkpoint import save_load
from offload.checkpoint.export import export
from offload.checkpoint.format import MANIFEST, _canonical
from offload.errors import CheckpointError, UsageError
from offload.safetensors_file import write_safetensors
from offload.zero.stage3 import ParamState

from .harness import (DIM, VOCAB, batch, config, finish_rank, init_gloo, make_model, max_difference, spawn_ranks,
                      train_engine, train_reference)

pytestmark = pytest.mark.skipif(not _native.status().available, reason="native library not built")

STEPS = 6
TOLERANCE = 1e-5  # as tests/zero/test_stage3.py
# The tied embedding and head, a whole block, and a LayerNorm weight (kept
# gathered at stage 3: at most stage3_param_persistence_threshold elements).
FROZEN = ("embed.weight", "blocks.1.0.weight", "blocks.1.0.bias", "norm.weight")
SETUPS = [(1, None), (2, None), (3, "none"), (3, "cpu"), (3, "nvme")]  # stage, weight tier


def _model(seed: int = 0) -> torch.nn.Module:
    model = make_model(seed, checkpoint=True)
    for name, p in model.named_parameters():
        p.requires_grad_(name not in FROZEN)
    return model


def _frozen_values(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items() if k in FROZEN or k == "head.weight"}


def _check(engine, ref, initial: dict[str, torch.Tensor], stage: int, tier: str | None, world: int) -> dict:
    """What a rank checks of a trained engine: the errors against AdamW, and
    at stage 3 where the frozen weights live."""
    state = engine.state_dict()
    result = {"difference": max_difference(state, ref),
              "frozen_kept": all(torch.equal(state[k], v) for k, v in initial.items())}
    report = engine.memory_report()
    frozen_bytes = sum(p.numel() * 4 for p in engine.module.parameters() if not p.requires_grad)  # fp32 compute
    result["whole_reported"] = report.get(("weights (frozen, whole)", "device"), {}).get("bytes", 0)
    result["whole_expected"] = 0 if stage == 3 else frozen_bytes  # stage 3 pages them: nothing is held whole
    if stage == 3:
        states = engine.weights.states()
        result["partitioned"] = [states[k] is ParamState.PARTITIONED for k in ("embed.weight", "blocks.1.0.weight")]
        result["persistent"] = states["norm.weight"] is ParamState.GATHERED
        result["tier"] = engine.weights.tiers()["embed.weight"]
        result["no_storage"] = engine.module.embed.weight.untyped_storage().size() == 0
        element = 4  # fp32 compute
        parts = sum(-(-p.numel() // world) for p in engine.module.parameters())  # at least: padding is added
        held = sum(v["bytes"] for (what, _), v in report.items() if what.startswith("weights (partition"))
        result["partition_covers_frozen"] = held >= parts * element
    return result


def _train_and_check(stage: int, tier: str | None, nvme: str, saves: str, world: int = 1, rank: int = 0) -> dict:
    cfg = config(stage, "nvme" if tier == "nvme" else "cpu", 2, nvme, param_device=tier)
    ref = train_reference(_model(), STEPS, world, 2, cfg)
    initial = _frozen_values(_model())
    with train_engine(_model(), STEPS, 2, cfg, rank=rank) as engine:
        result = _check(engine, ref, initial, stage, tier, world)
        # a checkpoint holds the frozen weights: a model whose frozen ones differ gets them back
        engine.save_checkpoint(saves)
        with offload.initialize(_model(seed=5), cfg) as again:
            frozen, read_elements, assign = again.module.blocks[1][0].weight, [], again.weights.assign

            def counted(tensor, read):
                def reading(lo, hi):
                    if tensor is frozen:
                        read_elements.append(hi - lo)
                    return read(lo, hi)
                assign(tensor, reading)

            again.weights.assign = counted
            again.load_checkpoint(saves)
            # at stage 3 each rank reads only its part of a frozen weight that is not gathered
            result["frozen_read"] = sum(read_elements) / frozen.numel()
            result["reloaded"] = max_difference(again.state_dict(), ref)
    model = engine.module  # closed: every parameter whole again, in its own dtype
    result["closed"] = all(torch.equal(model.state_dict()[k], v) for k, v in initial.items()) and \
        all(p.dtype == torch.float32 and p.untyped_storage().size() > 0 for p in model.parameters())
    return result


def _assert_good(result: dict, stage: int, tier: str | None, where: str, world: int = 1) -> None:
    assert result["difference"] < TOLERANCE and result["reloaded"] < TOLERANCE, where
    assert result["frozen_kept"] and result["closed"], where
    assert result["whole_reported"] == result["whole_expected"], where
    assert result["frozen_read"] == (1 / world if stage == 3 else 1), where
    if stage == 3:
        assert result["partitioned"] == [True, True] and result["persistent"], where
        assert result["tier"] == tier and result["no_storage"] and result["partition_covers_frozen"], where


@pytest.mark.parametrize("stage, tier", SETUPS, ids=[f"stage{s}-{t}" if t else f"stage{s}" for s, t in SETUPS])
def test_frozen_parameters_stay_and_the_rest_trains_as_adamw(tmp_path, stage, tier):
    _assert_good(_train_and_check(stage, tier, str(tmp_path), str(tmp_path / "saves")), stage, tier,
                 f"stage {stage} {tier}")


def _world2_worker(rank: int, port: int, out_dir: str) -> None:
    init_gloo(rank, 2, port)
    results = {}
    for stage, tier in ((2, None), (3, "cpu"), (3, "nvme")):
        nvme = os.path.join(out_dir, f"nvme{rank}-{stage}-{tier}")
        os.makedirs(nvme)
        saves = os.path.join(out_dir, f"saves-{stage}-{tier}")  # one directory for both ranks
        results[f"{stage}-{tier}"] = _train_and_check(stage, tier, nvme, saves, world=2, rank=rank)
    finish_rank(out_dir, rank, results)


def test_world_size_2(tmp_path):
    for rank, results in enumerate(spawn_ranks(_world2_worker, tmp_path)):
        assert len(results) == 3
        for name, result in results.items():
            stage, tier = name.split("-")
            _assert_good(result, int(stage), None if tier == "None" else tier, f"rank {rank} {name}", world=2)


def test_stage3_exports_and_loads_frozen_weights_into_their_parts(tmp_path):
    """``export`` gathers each frozen weight; ``load_weights`` writes each into
    this rank's part in its tier (a model built with other values takes them)."""
    cfg = config(3, "nvme", 1, str(tmp_path), param_device="nvme")
    path = str(tmp_path / "model.safetensors")
    with offload.initialize(_model(seed=5), cfg) as engine:
        engine.export(path)
        expected = engine.state_dict()
    with offload.initialize(_model(seed=0), cfg) as engine:
        offload.load_weights(engine, path)
        assert engine.weights.states()["blocks.1.0.weight"] is ParamState.PARTITIONED
        got = engine.state_dict()
    assert got.keys() == expected.keys() and all(torch.equal(got[k], expected[k]) for k in expected)
    assert not torch.equal(expected["embed.weight"], _model(seed=0).embed.weight)


def test_a_checkpoint_may_leave_the_frozen_parameters_out(tmp_path):
    """``exclude_frozen_parameters`` (DeepSpeed's name): the checkpoint holds
    the trained state and buffers only; a model loading it keeps its own
    frozen values, and gets the trained ones."""
    cfg = config(3, "nvme", 1, str(tmp_path), param_device="nvme")
    with train_engine(_model(), 2, 1, cfg) as engine:
        engine.save_checkpoint(str(tmp_path / "saves"), exclude_frozen_parameters=True)
        trained = engine.state_dict(exclude_frozen_parameters=True)
    assert not set(trained) & {*FROZEN, "head.weight"}
    other = _model(seed=5)
    own = _frozen_values(other)
    with offload.initialize(other, cfg) as engine:
        engine.load_checkpoint(str(tmp_path / "saves"))
        state = engine.state_dict()
    assert all(torch.equal(state[k], v) for k, v in own.items())
    assert all(torch.equal(state[k], v) for k, v in trained.items())
    # exporting it would write a model without its frozen weights
    with pytest.raises(CheckpointError, match="saved without its 5 frozen parameters"):
        export(str(tmp_path / "saves"), str(tmp_path / "out.safetensors"), torch.float32)


def test_a_frozen_parameter_missing_from_pretrained_weights_is_an_error(tmp_path):
    """A frozen parameter the checkpoint lacks would stay as initialised (a
    LoRA's base as noise): named, as a trainable one is; allow_missing keeps
    it, with a warning."""
    cfg = config(3, "cpu", 1, str(tmp_path), param_device="cpu")
    source = make_model(5).state_dict()
    kept = {k: v for k, v in source.items() if k != "blocks.1.0.weight"}
    path = str(tmp_path / "partial.safetensors")
    write_safetensors(path, [(k, v.dtype, tuple(v.shape)) for k, v in kept.items()], kept.items())
    with offload.initialize(_model(), cfg) as engine:
        with pytest.raises(UsageError, match=r"blocks.1.0.weight missing from .*a parameter needs a value"):
            offload.load_weights(engine, path)
    with offload.initialize(_model(), cfg) as engine:
        with pytest.warns(UserWarning, match="blocks.1.0.weight not in"):
            offload.load_weights(engine, path, allow_missing=True)
        state = engine.state_dict()
    assert torch.equal(state["blocks.1.0.weight"], _model().blocks[1][0].weight)
    assert all(torch.equal(state[k], v) for k, v in kept.items())


def test_a_step_does_not_gather_persistent_frozen_parameters_again(tmp_path):
    """New weights make gathered copies of trained parameters stale, not of
    frozen ones: a persistent frozen parameter stays gathered across steps."""
    cfg = config(3, "cpu", 1, str(tmp_path), param_device="cpu")
    with train_engine(_model(), 1, 1, cfg) as engine:
        gathered = _count_gathers(engine)
        engine.backward(engine(batch(1, 0, 0)))
        engine.step()
    assert "norm.bias" in gathered and "norm.weight" not in gathered  # both persistent; the weight is frozen
    assert "blocks.1.0.weight" in gathered  # frozen, not persistent: gathered for its module, as before


def _count_gathers(engine) -> list[str]:
    """The names of the parameters stage 3 gathers from now on, once per gather."""
    gathered, gather = [], engine.weights._gather

    def counted(m, record=True):
        if m.state is ParamState.PARTITIONED:
            gathered.append(m.slot.name)
        gather(m, record)

    engine.weights._gather = counted
    return gathered


class InputGrads(torch.nn.Module):
    """PEFT's enable_input_require_grads in miniature: a forward hook makes the
    frozen embedding's output require grad, so that checkpointed trainable
    blocks recompute with gradients; a frozen head."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, DIM).requires_grad_(False)
        self.embed.register_forward_hook(lambda module, args, output: output.requires_grad_(True))
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(DIM, DIM) for _ in range(2))
        self.head = torch.nn.Linear(DIM, VOCAB, bias=False).requires_grad_(False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens[:, :-1])
        for block in self.blocks:
            x = x + torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
        return torch.nn.functional.cross_entropy(self.head(x).reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))


@pytest.mark.parametrize("tier", ["cpu", "nvme"])
def test_a_frozen_embedding_made_to_require_grad_is_not_gathered_for_backward(tmp_path, tier):
    """Its backward needs no weights (token ids take no gradient, nor does the
    frozen weight): one gather per micro-step, for forward (there were two).
    The frozen head's input takes a gradient through its weight: two. Training
    equals AdamW."""
    cfg = config(3, "cpu", 2, str(tmp_path), param_device=tier)
    cfg["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    torch.manual_seed(0)
    model = InputGrads()
    ref = train_reference(model, STEPS, 1, 2, cfg)
    engine = offload.initialize(model, cfg)
    gathered = _count_gathers(engine)
    with engine:
        for step in range(STEPS):
            for micro in range(2):
                engine.backward(engine(batch(step, micro, 0)))
                engine.step()
        trained = list(gathered)
        assert max_difference(engine.state_dict(), ref) < TOLERANCE
    micro_steps = STEPS * 2
    assert trained.count("embed.weight") == micro_steps
    assert trained.count("head.weight") == trained.count("blocks.0.weight") == 2 * micro_steps


def test_checkpoints_hold_one_gathered_frozen_parameter_at_a_time(tmp_path, monkeypatch):
    """Saving gathers each frozen parameter as the extras file takes it (a
    LoRA's base need not fit in host memory); loading reads each while it is
    assigned."""
    cfg = config(3, "cpu", 1, str(tmp_path), param_device="cpu")
    events = []
    write, reader = save_load.write_safetensors, save_load.SafetensorsReader

    def logged_write(path, plan, tensors, **kwargs):
        def each():
            for key, value in tensors:
                events.append("write")
                yield key, value
        return write(path, plan, each(), **kwargs)

    class LoggedReader(reader):
        def read(self, key, lo=0, hi=None):
            events.append("read")
            return super().read(key, lo, hi)

    monkeypatch.setattr(save_load, "write_safetensors", logged_write)
    monkeypatch.setattr(save_load, "SafetensorsReader", LoggedReader)
    with train_engine(_model(), 1, 1, cfg) as engine:
        whole, assign = engine.weights.whole, engine.weights.assign
        engine.weights.whole = lambda t: (events.append("gather"), whole(t))[1]
        engine.weights.assign = lambda t, v: (events.append("assign"), assign(t, v))[1]
        engine.save_checkpoint(str(tmp_path / "saves"))
        saved, events[:] = list(events), []
        engine.load_checkpoint(str(tmp_path / "saves"))
        loaded, keys = list(events), len(engine.other_entries())
    assert keys >= 5 and saved == ["gather", "write"] * keys
    # each entry read only within its own assignment (once whole, once its part if gathered)
    assert re.fullmatch(f"(AR+){{{keys}}}", "".join("A" if e == "assign" else "R" for e in loaded))


def test_a_manifest_written_before_frozen_parameters_could_be_left_out_still_loads(tmp_path):
    """Such a manifest lacks ``frozen_left_out``: it loads, and exports, as
    one that left nothing out; an unknown field is still refused."""
    cfg = config(3, "cpu", 1, str(tmp_path), param_device="cpu")
    with train_engine(_model(), 1, 1, cfg) as engine:
        directory = engine.save_checkpoint(str(tmp_path / "saves"))
        expected = engine.state_dict()
    path = os.path.join(directory, MANIFEST)

    def rewrite(change) -> None:
        with open(path) as f:
            data = json.load(f)
        data.pop("crc32")
        change(data)
        with open(path, "w") as f:
            json.dump({**data, "crc32": zlib.crc32(_canonical(data))}, f)

    rewrite(lambda data: data.pop("frozen_left_out"))
    with offload.initialize(_model(seed=5), cfg) as engine:
        engine.load_checkpoint(str(tmp_path / "saves"))
        assert all(torch.equal(v, expected[k]) for k, v in engine.state_dict().items())
    export(str(tmp_path / "saves"), str(tmp_path / "out.safetensors"), torch.float32)
    rewrite(lambda data: data.update(unknown=1))
    with pytest.raises(CheckpointError, match="has fields .* the manifest is damaged or from another version"):
        export(str(tmp_path / "saves"), str(tmp_path / "again.safetensors"), torch.float32)


@pytest.mark.parametrize("stage,device,param_device", [(1, "none", None), (2, "cpu", None), (3, "nvme", "nvme")])
def test_freezing_or_unfreezing_after_initialize_is_refused_by_name(tmp_path, stage, device, param_device):
    """The engine partitioned the gradients and state of the parameters
    trainable when it was made: one frozen since would go on being stepped
    (by its zero gradient, as DeepSpeed does), one unfrozen would never train."""
    model = make_model()
    model.norm.bias.requires_grad_(False)
    with offload.initialize(model, config(stage, device, 1, str(tmp_path), param_device=param_device)) as engine:
        engine.backward(engine(batch(0, 0, 0)))
        engine.step()
        for change, said in ((lambda: model.embed.requires_grad_(False), "embed.weight frozen"),
                             (lambda: model.norm.bias.requires_grad_(True), "norm.bias unfrozen")):
            change()
            with pytest.raises(UsageError, match=f"requires_grad changed after offload.initialize: {said}; the "
                                                 "engine trains the parameters that were trainable when it was made"):
                engine.backward(engine(batch(1, 0, 0)))
            model.embed.requires_grad_(True)
            model.norm.bias.requires_grad_(False)
        engine.backward(engine(batch(1, 0, 0)))  # as it was: training goes on
        engine.step()
        model.extra = torch.nn.Linear(2, 2)  # a module added since: its parameters would never train
        with pytest.raises(UsageError, match=r"requires_grad changed after offload.initialize: extra.weight new, "
                                             r"extra.bias new \(new: added to the model since\)"):
            engine.backward(engine(batch(2, 0, 0)))
        del model.extra
