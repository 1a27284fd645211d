"""Model directories that ``from_pretrained`` reads (offload/pretrained.py):
``engine.save_pretrained`` and ``offload export CKPT --hf DIR`` write sharded
safetensors with Hugging Face's names and index, and the model's config; a
tiny GPT-2 and a tiny Llama built from their configs load back with
``transformers.AutoModelForCausalLM.from_pretrained`` and give the engine's
logits.

And the way in (offload/load_weights.py): ``offload.load_weights`` puts such
a checkpoint into a fresh engine's partitions at every stage and tier, at
world sizes 1 and 2, with clear errors for a missing key or a wrong shape;
``offload.from_pretrained`` builds a Hugging Face model under
``offload.init`` and loads it."""

import copy
import json
import os
import subprocess
import sys
import warnings

import pytest
import torch

import offload
from offload.cli import main
from offload.errors import CheckpointError, UsageError
from offload import pretrained
from offload.checkpoint.export import _meta_model
from offload.load_weights import SafetensorsCheckpoint
from offload.pretrained import INDEX, WEIGHTS, shards
from offload.safetensors_file import read_safetensors, write_safetensors

from .kill_points import Killed, KillPoints
from .zero.harness import batch, config, finish_rank, init_gloo, make_model, spawn_ranks


def _engine(model, stage=3, tmp_path=None):
    cfg = config(stage, "cpu", 1, param_device="cpu" if stage == 3 else None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return offload.initialize(model, cfg)


def _read_directory(directory) -> dict[str, torch.Tensor]:
    names = os.listdir(directory)
    if INDEX in names:
        with open(os.path.join(directory, INDEX)) as f:
            index = json.load(f)
        files = sorted(set(index["weight_map"].values()))
        out = {}
        for name in files:
            part = read_safetensors(os.path.join(directory, name))
            assert all(index["weight_map"][k] == name for k in part)
            out.update(part)
        assert set(out) == set(index["weight_map"])
        assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in out.values())
        return out
    return read_safetensors(os.path.join(directory, WEIGHTS))


def test_shards_cut_in_order_at_the_size_and_a_large_tensor_stands_alone():
    plan = [(f"t{i}", torch.float32, (n,)) for i, n in enumerate([10, 10, 30, 5, 5])]
    cut = shards(plan, 80)  # bytes: 40, 40, 120, 20, 20
    assert [[k for k, _, _ in part] for part in cut] == [["t0", "t1"], ["t2"], ["t3", "t4"]]


@pytest.mark.parametrize("max_shard_bytes", [10**9, 1500])
def test_save_pretrained_writes_the_state_dict_in_shards_with_an_index(tmp_path, max_shard_bytes):
    with _engine(make_model()) as engine:
        state = engine.state_dict(torch.bfloat16)
        files = engine.save_pretrained(str(tmp_path / "model"), torch.bfloat16, max_shard_bytes)
    names = os.listdir(tmp_path / "model")
    assert sorted(files) == sorted(names)
    if max_shard_bytes == 10**9:
        assert names == [WEIGHTS]
    else:
        assert INDEX in names and len(names) > 3
        assert all(os.path.getsize(tmp_path / "model" / n) <= max_shard_bytes + 4096 for n in names if n != INDEX)
    written = _read_directory(tmp_path / "model")
    assert set(written) == set(state) and all(torch.equal(written[k], state[k]) for k in state)


@pytest.mark.parametrize("bf16", [False, True])
def test_save_pretrained_writes_the_compute_dtype_unless_told(tmp_path, bf16):
    """As transformers writes a model in its own dtype: a bf16 run's weights
    in bf16, an fp32 run's in fp32; so does export --hf from its checkpoint."""
    cfg = config(2, "cpu", 1, **({"bf16": {"enabled": True}} if bf16 else {}))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with offload.initialize(make_model(), cfg) as engine:
            engine.save_pretrained(str(tmp_path / "default"))
            engine.save_pretrained(str(tmp_path / "fp32"), torch.float32)
            engine.save_checkpoint(str(tmp_path / "ckpt"))
            expected = engine.state_dict(torch.bfloat16 if bf16 else torch.float32)
        assert main(["export", str(tmp_path / "ckpt"), "--hf", str(tmp_path / "exported")]) == 0  # the same default
    for directory in ("default", "exported"):
        written = _read_directory(tmp_path / directory)
        assert all(written[k].dtype == expected[k].dtype and torch.equal(written[k], expected[k]) for k in expected)
    assert all(v.dtype == torch.float32 for v in _read_directory(tmp_path / "fp32").values())


def test_a_second_save_replaces_the_first_shards(tmp_path):
    out = str(tmp_path / "model")
    with _engine(make_model()) as engine:
        engine.save_pretrained(out, max_shard_bytes=1500)
        engine.save_pretrained(out)
    assert os.listdir(out) == [WEIGHTS]


def test_a_save_that_fails_leaves_the_earlier_one_as_it_was(tmp_path, monkeypatch):
    out = tmp_path / "model"
    with _engine(make_model()) as engine:
        engine.save_pretrained(str(out), max_shard_bytes=1500)
        before = {name: (out / name).read_bytes() for name in os.listdir(out)}
        engine.backward(engine(batch(0, 0, 0)))
        engine.step()
        real, calls = pretrained.write_safetensors, []

        def fail_on_the_third(path, *args, **kwargs):
            calls.append(path)
            if len(calls) == 3:
                raise OSError(28, "No space left on device")
            return real(path, *args, **kwargs)

        monkeypatch.setattr(pretrained, "write_safetensors", fail_on_the_third)
        with pytest.raises(OSError, match="No space left"):
            engine.save_pretrained(str(out), max_shard_bytes=1500)
    assert {name: (out / name).read_bytes() for name in os.listdir(out)} == before


def _what_loads(directory) -> dict[str, torch.Tensor] | None:
    """What ``from_pretrained`` reads: ``model.safetensors`` if present, else the
    files the index names (transformers' modeling_utils, in that order); None
    when there is neither. offload's own reader must agree."""
    ours = _what_offload_loads(directory)
    theirs = _what_transformers_loads(directory)
    assert (ours is None) == (theirs is None) and (ours is None or (
        set(ours) == set(theirs) and all(torch.equal(ours[k], theirs[k]) for k in ours)))
    return theirs


def _what_offload_loads(directory) -> dict[str, torch.Tensor] | None:
    if not any(os.path.exists(os.path.join(directory, name)) for name in (WEIGHTS, INDEX)):
        return None
    checkpoint = SafetensorsCheckpoint(str(directory))
    try:
        return {key: checkpoint.read(key).reshape(checkpoint.shape(key)) for key in checkpoint.where}
    finally:
        checkpoint.close()


def _what_transformers_loads(directory) -> dict[str, torch.Tensor] | None:
    if os.path.exists(os.path.join(directory, WEIGHTS)):
        return read_safetensors(os.path.join(directory, WEIGHTS))
    if not os.path.exists(os.path.join(directory, INDEX)):
        return None
    with open(os.path.join(directory, INDEX)) as f:
        weight_map = json.load(f)["weight_map"]
    out = {}
    for name in set(weight_map.values()):
        part = read_safetensors(os.path.join(directory, name))
        assert all(weight_map[key] == name for key in part)
        out.update(part)
    assert set(out) == set(weight_map)
    return out


def _weights(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"layer{i}.weight": torch.randn(10, 10, generator=g) for i in range(6)}


def _save(directory, state, max_shard_bytes):
    plan = [(key, value.dtype, tuple(value.shape)) for key, value in state.items()]
    return pretrained.write_pretrained(str(directory), plan, iter(state.items()), {"config.json": "{}"}, max_shard_bytes)


# shard bytes: 10**9 one file; 1200, 3 shards (two tensors each); 500, 6 shards
@pytest.mark.parametrize("earlier,later", [(10**9, 1200), (1200, 1200), (1200, 10**9), (1200, 500), (None, 1200)],
                         ids=["file-to-shards", "same-shard-names", "shards-to-file", "other-shard-count", "new"])
def test_a_save_killed_anywhere_leaves_one_whole_model(tmp_path, monkeypatch, earlier, later):
    """Note [a save in place]: killed at each rename, link or unlink of a save
    over an earlier one, the directory loads the earlier model or the new one,
    whole; and the next save leaves only its own files."""
    old, new = _weights(0), _weights(1)
    kill = KillPoints(monkeypatch, [(os, "replace"), (os, "unlink"), (os, "link")])
    at, outcomes = 1, set()
    while True:
        directory = tmp_path / f"kill{at}"
        if earlier is not None:
            kill.arm(0)
            _save(directory, old, earlier)
        kill.arm(at)
        try:
            _save(directory, new, later)
        except Killed:
            loaded = _what_loads(directory)
        else:
            break
        if loaded is None:
            assert earlier is None, f"killed at file-system call {at}: the earlier save is gone"
        else:
            match = [label for label, state in (("old", old), ("new", new))
                     if set(loaded) == set(state) and all(torch.equal(loaded[k], state[k]) for k in state)]
            assert match, f"killed at file-system call {at}: the directory loads neither save whole"
            outcomes.add(match[0])
        at += 1
    assert outcomes == ({"old", "new"} if earlier is not None else {"new"})
    kill.arm(0)
    files = _save(directory, new, later)
    assert sorted(os.listdir(directory)) == sorted(files)


def test_a_save_over_shards_on_a_filesystem_without_hard_links_copies_them_aside(tmp_path, monkeypatch):
    old, new = _weights(0), _weights(1)
    _save(tmp_path, old, 1200)

    def no_links(*args, **kwargs):
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(os, "link", no_links)
    files = _save(tmp_path, new, 1200)
    assert sorted(os.listdir(tmp_path)) == sorted(files)
    loaded = _what_loads(tmp_path)
    assert all(torch.equal(loaded[k], new[k]) for k in new)


def test_a_save_that_fails_putting_shards_in_place_leaves_no_incoming_file(tmp_path, monkeypatch):
    old = _weights(0)
    _save(tmp_path, old, 1200)
    before = sorted(os.listdir(tmp_path))

    def full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(pretrained, "_copy_synced", full)
    monkeypatch.setattr(os, "link", full)
    with pytest.raises(OSError, match="No space left"):
        _save(tmp_path, _weights(1), 1200)
    assert not [name for name in os.listdir(tmp_path) if name.endswith(".incoming")]
    loaded = _what_loads(tmp_path)
    assert all(torch.equal(loaded[k], old[k]) for k in old) and before == sorted(
        n for n in os.listdir(tmp_path) if not n.startswith(pretrained.ASIDE))


SETUPS = [(1, "cpu", None), (2, "nvme", None), (3, "cpu", "cpu"), (3, "nvme", "nvme")]


def _trained_directory(tmp_path, max_shard_bytes=1500) -> tuple[str, dict]:
    out = str(tmp_path / "pretrained")
    with _engine(make_model()) as engine:
        for step in range(2):
            engine.backward(engine(batch(step, 0, 0)))
            engine.step()
        engine.save_pretrained(out, max_shard_bytes=max_shard_bytes)
        return out, engine.state_dict()


def _fresh(stage, device, param_device, nvme, seed=1, rank=0):
    cfg = config(stage, device, 1, nvme if "nvme" in (device, param_device) else None, param_device=param_device)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return offload.initialize(make_model(seed=seed), cfg)


@pytest.mark.parametrize("source", ["directory", "state dict"])
@pytest.mark.parametrize("stage,device,param_device", SETUPS)
def test_load_weights_puts_a_checkpoint_into_every_stage_and_tier(tmp_path, stage, device, param_device, source):
    directory, expected = _trained_directory(tmp_path)
    os.makedirs(tmp_path / "nvme")
    with _fresh(stage, device, param_device, str(tmp_path / "nvme")) as engine:
        before = engine.state_dict()
        assert not all(torch.equal(before[k], expected[k]) for k in expected)  # another init: the load is real
        offload.load_weights(engine, directory if source == "directory" else {k: v.clone() for k, v in expected.items()})
        loaded = engine.state_dict()
        assert all(torch.equal(loaded[k], expected[k]) for k in expected)
        engine.backward(engine(batch(0, 0, 0)))  # and it trains from there
        engine.step()


def _load_worker(rank: int, port: int, out_dir: str) -> None:
    init_gloo(rank, 2, port)
    results = {}
    for stage, device, param_device in SETUPS[1:]:
        nvme = os.path.join(out_dir, f"nvme{rank}")
        os.makedirs(nvme, exist_ok=True)
        with _fresh(stage, device, param_device, nvme, rank=rank) as engine:
            offload.load_weights(engine, os.path.join(out_dir, "pretrained"))
            state = engine.state_dict()
        expected = read_safetensors(os.path.join(out_dir, "expected.safetensors"))
        results[f"{stage}-{device}-{param_device}"] = all(torch.equal(state[k], expected[k]) for k in expected)
    finish_rank(out_dir, rank, results)


def test_load_weights_with_two_ranks(tmp_path):
    _, expected = _trained_directory(tmp_path)
    write_safetensors(str(tmp_path / "expected.safetensors"), [(k, v.dtype, tuple(v.shape)) for k, v in expected.items()],
                      expected.items())
    for results in spawn_ranks(_load_worker, tmp_path):
        assert results == {f"{s}-{d}-{p}": True for s, d, p in SETUPS[1:]}


def _without(directory, drop: str, out, reshape=None) -> str:
    tensors = _read_directory(directory)
    tensors.pop(drop) if reshape is None else tensors.update({drop: tensors[drop].reshape(reshape)})
    write_safetensors(str(out), [(k, v.dtype, tuple(v.shape)) for k, v in tensors.items()], tensors.items())
    return str(out)


def test_load_weights_names_a_missing_key_and_a_wrong_shape(tmp_path):
    directory, expected = _trained_directory(tmp_path)
    key = "blocks.1.0.weight"
    with _fresh(2, "cpu", None, None) as engine:
        # head.weight is embed.weight (tied): either key is enough, as in from_pretrained.
        offload.load_weights(engine, _without(directory, "head.weight", tmp_path / "tied.safetensors"))
        assert torch.equal(engine.state_dict()["head.weight"], expected["head.weight"])
    with _fresh(2, "cpu", None, None) as engine:
        with pytest.raises(UsageError, match=f"{key} missing from .*allow_missing=True"):
            offload.load_weights(engine, _without(directory, key, tmp_path / "missing.safetensors"))
        with pytest.raises(UsageError, match=f"{key} has shape"):
            offload.load_weights(engine, _without(directory, key, tmp_path / "bad.safetensors", reshape=(-1,)))
        engine.backward(engine(batch(0, 0, 0)))
        engine.step()
        with pytest.raises(UsageError, match="fresh engine"):
            offload.load_weights(engine, directory)


@pytest.mark.parametrize("stage,bf16", [(2, True), (3, False)])
def test_initialize_that_cannot_load_its_weights_leaves_the_users_model_as_it_was(tmp_path, stage, bf16):
    """A failed ``initialize(weights=...)`` closed its engine without giving
    the model back: at stage 3 its parameters were left without storage, so
    its forward and any new engine failed; at stages 1-2 it stayed in bf16."""
    model = make_model(0)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    kept = {k: v for k, v in make_model(5).state_dict().items() if k != "blocks.1.0.weight"}
    path = str(tmp_path / "partial.safetensors")
    write_safetensors(path, [(k, v.dtype, tuple(v.shape)) for k, v in kept.items()], kept.items())
    cfg = config(stage, "cpu", 1, param_device="cpu" if stage == 3 else None, bf16={"enabled": bf16})
    with pytest.raises(UsageError, match="blocks.1.0.weight missing from"):
        offload.initialize(model, cfg, weights=path)
    after = model.state_dict()
    assert all(after[k].dtype == v.dtype and torch.equal(after[k], v) for k, v in before.items())
    assert torch.isfinite(model(batch(0, 0, 0))).all()
    with offload.initialize(model, cfg) as engine:
        engine.backward(engine(batch(0, 0, 0)))
        engine.step()


@pytest.mark.parametrize("stage,device,param_device", [(1, "cpu", None), (3, "nvme", "nvme")])
def test_allow_missing_keeps_the_models_own_values_for_what_the_checkpoint_lacks(tmp_path, stage, device,
                                                                                  param_device):
    """A new head on a pretrained body: the missing parameter keeps the value the
    model's own initialisation gave it (read back from the optimizer state,
    wherever it lives), every other one the checkpoint's."""
    directory, expected = _trained_directory(tmp_path)
    key = "blocks.1.0.weight"
    with _fresh(stage, device, param_device, str(tmp_path)) as engine:
        initial = engine.state_dict()[key]
        assert not torch.equal(initial, expected[key])
        said = f"{key} not in .* keep their present values \\(the model's own initialisation, unless"
        with pytest.warns(UserWarning, match=said):
            offload.load_weights(engine, _without(directory, key, tmp_path / "missing.safetensors"),
                                 allow_missing=True)
        state = engine.state_dict()
        assert torch.equal(state[key], initial)
        assert all(torch.equal(state[k], expected[k]) for k in expected if k != key)


class _Gain(torch.nn.Module):
    """A module with a parameter and no reset_parameters: offload.init alone cannot initialise it."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.gain = torch.nn.Parameter(torch.ones(n))

    def forward(self, x):
        return x * self.gain


class _Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed, self.gain, self.head = torch.nn.Embedding(50, 16), _Gain(16), torch.nn.Linear(16, 50)

    def forward(self, tokens):
        logits = self.head(self.gain(self.embed(tokens[:, :-1])))
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())


def _net_file(tmp_path, drop: str | None = None) -> tuple[str, dict]:
    torch.manual_seed(7)
    tensors = {k: v.detach() + 0.5 for k, v in _Net().state_dict().items()}  # no initialiser gives these
    tensors.pop(drop, None)
    path = str(tmp_path / f"net-{drop}.safetensors")
    write_safetensors(path, [(k, v.dtype, tuple(v.shape)) for k, v in tensors.items()], tensors.items())
    return path, tensors


@pytest.mark.parametrize("stage,device,param_device", [(2, "cpu", None), (3, "nvme", "nvme")])
def test_initialize_with_weights_needs_no_initialiser_for_what_the_checkpoint_covers(tmp_path, stage, device,
                                                                                     param_device):
    path, tensors = _net_file(tmp_path)
    cfg = config(stage, device, 1, str(tmp_path), param_device=param_device)
    with offload.init(cfg):
        model = _Net()
    with pytest.raises(UsageError, match="_Gain has its own parameters .* but no reset_parameters"):
        offload.initialize(copy.deepcopy(model), cfg)  # nothing to give _Gain a value
    with offload.initialize(model, cfg, weights=path) as engine:
        state = engine.state_dict()
        assert state.keys() == tensors.keys() and all(torch.equal(state[k], tensors[k]) for k in tensors)
        engine.backward(engine(torch.randint(0, 50, (2, 9))))
        engine.step()


def test_initialize_with_weights_names_what_nothing_can_initialise(tmp_path):
    cfg = config(3, "cpu", 1, param_device="cpu")
    path, _ = _net_file(tmp_path, drop="gain.gain")
    with offload.init(cfg):
        model = _Net()
    with pytest.raises(UsageError, match="gain.gain missing from .*_Gain has no reset_parameters"):
        offload.initialize(model, cfg, weights=path)
    # a module with an initialiser of its own is covered by it, when missing is allowed
    path, tensors = _net_file(tmp_path, drop="head.weight")
    with offload.init(cfg):
        model = _Net()
    with pytest.warns(UserWarning, match="head.weight not in"):
        engine = offload.initialize(model, cfg, weights=path, allow_missing=True)
    state = engine.state_dict()
    assert all(torch.equal(state[k], tensors[k]) for k in tensors)
    assert state["head.weight"].abs().max() < 0.25  # Linear's own init: |w| <= 1/sqrt(16), not +0.5
    engine.close()


try:
    import transformers
except ImportError:
    transformers = None
needs_hf = pytest.mark.skipif(transformers is None, reason="transformers is not installed (pip install -e .[hf])")


def _gpt2():
    config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=97, n_positions=32, bos_token_id=0,
                                     eos_token_id=0)
    return transformers.GPT2LMHeadModel(config)


def _llama():
    config = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=160, num_attention_heads=4,
                                      num_key_value_heads=2, vocab_size=97, max_position_embeddings=32)
    return transformers.LlamaForCausalLM(config)


def _train(engine, steps=2):
    for step in range(steps):
        ids = torch.randint(0, 97, (2, 16), generator=torch.Generator().manual_seed(step))
        engine.backward(engine(input_ids=ids, labels=ids))
        engine.step()


@needs_hf
@pytest.mark.parametrize("auto", [False, True], ids=["class", "auto-class"])
@pytest.mark.parametrize("build", [_gpt2, _llama], ids=["gpt2", "llama"])
def test_offload_from_pretrained_builds_and_loads_a_hugging_face_model(tmp_path, build, auto):
    torch.manual_seed(0)
    ids = torch.randint(0, 97, (2, 16), generator=torch.Generator().manual_seed(99))
    model = build()
    model.save_pretrained(str(tmp_path / "hf"))  # Hugging Face's own writer, tied weights dropped
    model.eval()
    with torch.no_grad():
        expected = model(input_ids=ids).logits
    os.makedirs(tmp_path / "nvme")
    cfg = config(3, "nvme", 1, param_device="nvme")
    del cfg["zero_optimization"]["offload_param"]["nvme_path"]  # given below, as initialize takes it
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model_class = transformers.AutoModelForCausalLM if auto else type(model)
        engine = offload.from_pretrained(model_class, str(tmp_path / "hf"), cfg, nvme_path=str(tmp_path / "nvme"))
    assert type(engine.module) is type(model)
    with engine:
        engine.module.eval()
        with torch.no_grad():
            assert torch.equal(engine(input_ids=ids).logits, expected)


def _vit():
    config = transformers.ViTConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                    image_size=16, patch_size=8, num_labels=3)
    return transformers.ViTForImageClassification(config)


def _mixtral():
    config = transformers.MixtralConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, vocab_size=97,
                                        num_local_experts=12)  # past 9: experts.10 sorts before experts.2 as text
    return transformers.MixtralForCausalLM(config)


def _nomic_bert():
    config = transformers.NomicBertConfig(vocab_size=97, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                          intermediate_size=64)
    return transformers.NomicBertModel(config)


@needs_hf
@pytest.mark.parametrize("build,old_key", [(_vit, "vit.encoder.layer.0.attention.attention.query.weight"),
                                           (_nomic_bert, "encoder.layers.0.attn.Wqkv.weight")], ids=["vit", "nomic_bert"])
def test_a_checkpoint_in_a_layout_transformers_renames_or_splits_loads_as_transformers_loads_it(tmp_path, build,
                                                                                               old_key):
    """transformers 5 writes ViT under older key names, and NomicBert's
    q, k and v as one tensor, and converts them as it loads (Note
    [transformers' key conversions]): offload reads them under the model's
    names, and the model is the one transformers loads."""
    torch.manual_seed(0)
    model = build()
    model.save_pretrained(str(tmp_path / "hf"))
    assert old_key in SafetensorsCheckpoint(str(tmp_path / "hf")).keys()
    expected = type(model).from_pretrained(str(tmp_path / "hf")).state_dict()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine = offload.from_pretrained(type(model), str(tmp_path / "hf"), config(3, "cpu", 1, param_device="cpu"))
    with engine:
        loaded = engine.state_dict()
    assert loaded.keys() == expected.keys() and all(torch.equal(loaded[k], expected[k]) for k in expected)


@needs_hf
def test_two_checkpoint_keys_transformers_reads_as_one_are_refused(tmp_path):
    torch.manual_seed(0)
    model = _vit()
    model.save_pretrained(str(tmp_path / "hf"))
    tensors = dict(read_safetensors(str(tmp_path / "hf" / WEIGHTS)))
    tensors["vit.layers.0.attention.q_proj.weight"] = tensors["vit.encoder.layer.0.attention.attention.query.weight"]
    with offload.initialize(model, config(2, "cpu", 1)) as engine:
        with pytest.raises(UsageError, match=r"holds 'vit.layers.0.attention.q_proj.weight' and "
                                             r"'vit.encoder.layer.0.attention.attention.query.weight', which "
                                             r"transformers both reads as 'vit.layers.0.attention.q_proj.weight'"):
            offload.load_weights(engine, tensors)


def _merged_directory(tmp_path) -> tuple[str, dict[str, torch.Tensor]]:
    """A Mixtral as transformers 5 writes it (each expert's w1, w3 and w2 a
    tensor of its own), and the state dict transformers loads from it."""
    torch.manual_seed(0)
    directory = str(tmp_path / "hf")
    _mixtral().save_pretrained(directory)
    assert "model.layers.0.block_sparse_moe.experts.11.w3.weight" in SafetensorsCheckpoint(directory).keys()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return directory, transformers.MixtralForCausalLM.from_pretrained(directory).state_dict()


@needs_hf
@pytest.mark.parametrize("stage,param_device,frozen", [(2, None, False), (3, "nvme", False), (3, "cpu", True)],
                         ids=["stage2", "stage3-nvme", "stage3-frozen-experts"])
def test_a_checkpoint_whose_tensors_transformers_merges_loads_as_transformers_loads_it(tmp_path, stage, param_device,
                                                                                      frozen):
    """Mixtral's experts, one tensor each in the checkpoint, are one stacked
    tensor in the model (Note [transformers' key conversions]): bitwise what
    transformers loads, trainable or frozen (a LoRA's base)."""
    directory, expected = _merged_directory(tmp_path)
    os.makedirs(tmp_path / "nvme")
    cfg = config(stage, "cpu", 1, str(tmp_path / "nvme"), param_device=param_device)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if frozen:
            model = _mixtral()
            for name, p in model.named_parameters():
                p.requires_grad_("experts" not in name)
            engine = offload.initialize(model, cfg, weights=directory)
        else:
            engine = offload.from_pretrained(transformers.AutoModelForCausalLM, directory, cfg)
    with engine:
        loaded = engine.state_dict()
    assert loaded.keys() == expected.keys()
    assert [k for k in expected if not torch.equal(loaded[k], expected[k])] == []


@needs_hf
def test_a_lora_on_the_experts_loads_its_base_from_a_checkpoint_transformers_merges(tmp_path):
    """PEFT's LoRA on both of an MoE's stacked expert tensors (target_parameters)
    nests its wrapper twice (experts.base_layer.base_layer.gate_up_proj); the
    base comes from the per-expert checkpoint, as transformers merges it."""
    peft = pytest.importorskip("peft", reason="peft is not installed (pip install peft)")
    directory, expected = _merged_directory(tmp_path)
    torch.manual_seed(1)
    lora = peft.LoraConfig(r=2, target_modules=[], target_parameters=["mlp.experts.gate_up_proj",
                                                                       "mlp.experts.down_proj"])
    model = peft.get_peft_model(_mixtral(), lora)
    assert any(".base_layer.base_layer." in key for key in model.state_dict())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with offload.initialize(model, config(3, "cpu", 1, param_device="cpu"), weights=directory) as engine:
            loaded = engine.state_dict()
    base = {k.removeprefix("base_model.model.").replace(".base_layer", ""): v for k, v in loaded.items()
            if "lora_" not in k}
    assert base.keys() == expected.keys() and all(torch.equal(base[k], expected[k]) for k in expected)


@needs_hf
def test_a_base_models_checkpoint_loads_into_a_model_with_a_head_and_the_other_way_round(tmp_path):
    """As transformers loads them: the base model's prefix (model.) put on or
    taken off, merged experts included; the head a base checkpoint lacks
    keeps its initial values (allow_missing), and one a base model lacks is
    not read."""
    torch.manual_seed(0)
    with_head = _mixtral()
    with_head.save_pretrained(str(tmp_path / "with-head"))
    with_head.model.save_pretrained(str(tmp_path / "base"))
    for model_class, directory, allow_missing in [(transformers.MixtralForCausalLM, "base", True),
                                                  (transformers.MixtralModel, "with-head", False)]:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            expected = model_class.from_pretrained(str(tmp_path / directory)).state_dict()
            with offload.from_pretrained(model_class, str(tmp_path / directory), config(3, "cpu", 1, param_device="cpu"),
                                         allow_missing=allow_missing) as engine:
                loaded = engine.state_dict()
        assert loaded.keys() == expected.keys()
        assert [k for k in expected if k != "lm_head.weight" and not torch.equal(loaded[k], expected[k])] == []


@needs_hf
def test_a_lora_model_loads_its_base_from_a_base_models_checkpoint(tmp_path):
    """The base model's prefix is put on for the layers LoRA wraps too (their
    keys are the base's once PEFT's levels are taken off)."""
    peft = pytest.importorskip("peft", reason="peft is not installed (pip install peft)")
    torch.manual_seed(0)
    base = _llama()
    base.model.save_pretrained(str(tmp_path / "base"))
    expected = base.model.state_dict()
    model = peft.get_peft_model(_llama(), peft.LoraConfig(r=2, target_modules=["q_proj"]))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with offload.initialize(model, config(2, "cpu", 1), weights=str(tmp_path / "base"), allow_missing=True) as engine:
            loaded = engine.state_dict()
    loaded = {k.removeprefix("base_model.model.model.").replace(".base_layer", ""): v for k, v in loaded.items()}
    assert [k for k in expected if not torch.equal(loaded[k], expected[k])] == []


def _merged_load_worker(rank: int, port: int, out_dir: str) -> None:
    init_gloo(rank, 2, port)
    expected = read_safetensors(os.path.join(out_dir, "expected.safetensors"))
    results = {}
    for stage, param_device in ((2, None), (3, "nvme")):
        nvme = os.path.join(out_dir, f"nvme{rank}-{stage}")
        os.makedirs(nvme)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with offload.from_pretrained(transformers.AutoModelForCausalLM, os.path.join(out_dir, "hf"),
                                         config(stage, "cpu", 1, nvme, param_device=param_device)) as engine:
                state = engine.state_dict()
        results[stage] = [k for k in expected if not torch.equal(state[k], expected[k])]
    finish_rank(out_dir, rank, results)


@needs_hf
def test_a_checkpoint_whose_tensors_transformers_merges_loads_with_two_ranks(tmp_path):
    _, expected = _merged_directory(tmp_path)
    write_safetensors(str(tmp_path / "expected.safetensors"),
                      [(k, v.dtype, tuple(v.shape)) for k, v in expected.items()], expected.items())
    for results in spawn_ranks(_merged_load_worker, tmp_path):
        assert results == {"2": [], "3": []}


@needs_hf
@pytest.mark.parametrize("build", [_mixtral, _vit, _nomic_bert], ids=["mixtral", "vit", "nomic_bert"])
@pytest.mark.parametrize("stage,loaded", [(2, False), (3, False), (2, True)],
                         ids=["stage2", "stage3", "stage2-from-transformers-from_pretrained"])
def test_save_pretrained_writes_the_layout_transformers_writes(tmp_path, build, stage, loaded):
    """As transformers' save_pretrained (save_original_format): Mixtral's
    experts split back into one tensor each, ViT's keys under their older
    names, NomicBert's q, k and v joined into one tensor, bitwise;
    save_original_format=False writes the model's own names, which
    transformers reads too (Note [transformers' key conversions]). So does
    `offload export --hf` from a checkpoint, for the model its config.json
    describes (--model-names: the model's own)."""
    torch.manual_seed(0)
    model = build()
    if loaded:  # from its own names, it made no conversions, and writes its own names back, as it read them
        model.save_pretrained(str(tmp_path / "as-read"), save_original_format=False)
        model = type(model).from_pretrained(str(tmp_path / "as-read"))
    trained = copy.deepcopy(model)  # built from a config, as transformers' save has not recorded its class
    model.save_pretrained(str(tmp_path / "hf"))
    expected = _read_directory(tmp_path / "hf")
    own = copy.deepcopy(model).state_dict()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with offload.initialize(trained, config(stage, "cpu", 1, param_device="cpu" if stage == 3 else None)) as engine:
            engine.save_pretrained(str(tmp_path / "original"), max_shard_bytes=40_000)
            engine.save_pretrained(str(tmp_path / "own"), save_original_format=False)
            engine.save_checkpoint(str(tmp_path / "ckpt"))
        exports = [("exported", []), ("exported-own", ["--model-names"])]
        for out, flags in exports:
            assert main(["export", str(tmp_path / "ckpt"), "--hf", str(tmp_path / out), *flags]) == 0
        assert len(os.listdir(tmp_path / "original")) > 3  # shards, split at any tensor
        for directory, wanted in [("original", expected), ("own", own), ("exported-own", own)] + \
                                 [("exported", expected)] * (not loaded):  # the model's config says the layout
            saved = _read_directory(tmp_path / directory)
            assert saved.keys() == wanted.keys() and all(torch.equal(saved[k], wanted[k]) for k in wanted), directory
        loaded = type(model).from_pretrained(str(tmp_path / "own")).state_dict()
    assert all(torch.equal(loaded[k], own[k]) for k in own)


@needs_hf
def test_an_export_of_a_model_transformers_cannot_build_keeps_its_names_and_says_so():
    with pytest.warns(UserWarning, match=r"^out: written under the model's own key names, not in the older layout "
                                         r".*\(ValueError: transformers [\d.]+ has no class 'NoSuchModel'\)"):
        assert _meta_model(json.dumps({"architectures": ["NoSuchModel"]}), "out") is None


@needs_hf
def test_a_merge_the_checkpoint_cannot_give_is_named_and_one_the_model_does_not_take_is_skipped(tmp_path):
    """An expert's tensor missing: named (transformers cannot load it either);
    the last expert missing from every list: the stack is smaller than the
    model's. Tensors of a layer the model does not have are not merged at
    all, as transformers does not merge them, even where they could not be."""
    directory, expected = _merged_directory(tmp_path)
    tensors = _read_directory(directory)
    w3 = "model.layers.1.block_sparse_moe.experts.2.w3.weight"
    extra = {k.replace("layers.1.", "layers.2."): v[:, 1:] if "w3" in k else v  # whose w1 and w3 do not stack
             for k, v in tensors.items() if "layers.1." in k}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with offload.initialize(_mixtral(), config(2, "cpu", 1)) as engine:
            with pytest.raises(UsageError, match=rf"^the state dict lacks {w3}, which transformers merges with the "
                                                 r"other 23 tensors of '\.experts\.\*\.w1\.weight' \+ "
                                                 r"'\.experts\.\*\.w3\.weight' -> 'model\.layers\.1\.mlp\.experts\."
                                                 r"gate_up_proj'; it cannot load this checkpoint either$"):
                offload.load_weights(engine, {k: v for k, v in tensors.items() if k != w3})
            no_last_expert = {k: v for k, v in tensors.items() if "experts.11." not in k}
            with pytest.raises(UsageError, match=r"model\.layers\.0\.mlp\.experts\.gate_up_proj, which "
                                                 r"transformers merges from 22 tensors \('\.experts\.\*\.w1\.weight' \+ "
                                                 r"'\.experts\.\*\.w3\.weight' -> '[\w.]+'\), has shape \[11, 128, 32\] "
                                                 r"in the state dict but \[12, 128, 32\] in the model"):
                offload.load_weights(engine, no_last_expert)
            offload.load_weights(engine, {**tensors, **extra})
            loaded = engine.state_dict()
    assert all(torch.equal(loaded[k], expected[k]) for k in expected)


@needs_hf
def test_from_pretrained_takes_config_changes_and_says_what_has_no_effect_once(tmp_path):
    """As transformers' from_pretrained: keyword arguments change the config
    (an MoE's router loss), and a misspelt one is refused. The warning for
    an nvme_path no tier uses comes once, from initialize, not also from
    the model's build under offload.init."""
    torch.manual_seed(0)
    _mixtral().save_pretrained(str(tmp_path / "hf"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with offload.from_pretrained(transformers.AutoModelForCausalLM, str(tmp_path / "hf"), config(2, "cpu", 1),
                                     nvme_path=str(tmp_path), output_router_logits=True) as engine:
            assert engine.module.config.output_router_logits is True
            assert engine(input_ids=torch.tensor([[1, 2, 3]]), labels=torch.tensor([[1, 2, 3]])).aux_loss is not None
    assert [str(w.message) for w in caught if "has no effect here: no tier" in str(w.message)] == [
        f"offload: nvme_path={str(tmp_path)!r} has no effect here: no tier of this config is on nvme "
        "(zero_optimization.offload_optimizer.device, offload_param.device)"]
    with pytest.raises(UsageError, match=r"^offload.from_pretrained: output_router_logitz is not in the config of "
                                         r".*config.json \(keyword arguments change the model's config"):
        offload.from_pretrained(transformers.MixtralForCausalLM, str(tmp_path / "hf"), config(2, "cpu", 1),
                                output_router_logitz=True)
    # transformers' config would take these and change nothing the engine does, or read another config
    for argument, why in [("dtype", r"the DeepSpeed config sets the dtype .*bf16.enabled"),
                          ("subfolder", r"it reads a local directory"), ("trust_remote_code", "it builds transformers' own classes")]:
        with pytest.raises(UsageError, match=rf"^offload.from_pretrained takes no {argument}=: {why}"):
            offload.from_pretrained(transformers.MixtralForCausalLM, str(tmp_path / "hf"), config(2, "cpu", 1),
                                    **{argument: torch.bfloat16})


@needs_hf
def test_from_pretrained_names_what_it_takes(tmp_path):
    with pytest.raises(UsageError, match=r"takes a transformers model class \(LlamaForCausalLM\) or an Auto class"):
        offload.from_pretrained(str(tmp_path), config(2, "cpu", 1))
    with pytest.raises(UsageError, match=r"offload.from_pretrained\(transformers.AutoModelForCausalLM, directory, "):
        offload.initialize(str(tmp_path), config(2, "cpu", 1))
    with pytest.raises(UsageError, match=r"reads a model from a local directory; 'gpt2' is not one .*snapshot_download"):
        offload.from_pretrained(transformers.AutoModelForCausalLM, "gpt2", config(2, "cpu", 1))
    with pytest.raises(UsageError, match=rf"{tmp_path} has no config.json"):
        offload.from_pretrained(transformers.AutoModelForCausalLM, tmp_path, config(2, "cpu", 1))
    with pytest.raises(UsageError, match=r"or an Auto class .*; got '/"):  # the class and the directory swapped
        offload.from_pretrained(str(tmp_path), transformers.AutoModelForCausalLM, config(2, "cpu", 1))
    with pytest.raises(UsageError, match=r"or an Auto class .*; got None for the directory"):
        offload.from_pretrained(transformers.AutoModelForCausalLM, None, config(2, "cpu", 1))
    gpt2 = tmp_path / "gpt2"
    transformers.GPT2Config(n_layer=1, n_embd=8, n_head=2, vocab_size=16).save_pretrained(gpt2)
    with pytest.raises(UsageError, match=r"got a GPT2LMHeadModel already built: pass its class") as caught:
        offload.from_pretrained(transformers.GPT2LMHeadModel(transformers.GPT2Config.from_pretrained(gpt2)), gpt2,
                                config(2, "cpu", 1))
    assert "\n" not in str(caught.value)
    with pytest.raises(UsageError, match=r"config.json is a file: pass the directory it is in"):
        offload.from_pretrained(transformers.AutoModelForCausalLM, gpt2 / "config.json", config(2, "cpu", 1))
    # transformers would build a Llama of its default sizes (7B) from a GPT-2's config, with a warning
    with pytest.raises(UsageError, match=r"config.json describes a 'gpt2' model, and LlamaForCausalLM builds 'llama'"):
        offload.from_pretrained(transformers.LlamaForCausalLM, gpt2, config(2, "cpu", 1))
    (gpt2 / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(UsageError, match=r"holds PyTorch pickle weights \(pytorch_model.bin\), which offload does not"):
        offload.from_pretrained(transformers.AutoModelForCausalLM, gpt2, config(2, "cpu", 1))


@needs_hf
@pytest.mark.parametrize("build", [_gpt2, _llama], ids=["gpt2", "llama"])
def test_a_hugging_face_model_built_under_init_gets_its_own_initialisation(build):
    """As from_config initialises it: each matrix's spread within 20% of the
    eagerly built model's, so the model's initializer_range (0.02) and GPT-2's
    depth-scaled residual projections (0.01 at two layers), not torch's
    defaults (a 64-wide Linear: std 0.072); zero biases; GPT-2's Conv1D, which
    has no reset_parameters, needs no init_fn."""
    torch.manual_seed(0)
    eager = build().state_dict()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with offload.init(config(3, "cpu", 1, param_device="cpu")):
            model = build()
        engine = offload.initialize(model, config(3, "cpu", 1, param_device="cpu"))
    with engine:
        state = engine.state_dict()
        _train(engine)
    matrices = [k for k, v in state.items() if v.dim() == 2 and "embed" not in k and "wte" not in k and "wpe" not in k]
    assert len(matrices) >= 8
    for key in matrices:
        assert abs(state[key].std() / eager[key].std() - 1) < 0.2, key
    biases = [v for k, v in state.items() if k.endswith(".bias") and "ln" not in k]
    assert all(torch.equal(b, torch.zeros_like(b)) for b in biases)


@needs_hf
def test_hugging_faces_initialisation_keeps_a_tied_padding_row_and_names_what_it_leaves_unset():
    """The tied head does not initialise the embedding again (its padding row
    stays zero, as from_config leaves it); a module of the model's that
    neither reset_parameters nor _init_weights sets is named, not left as
    whatever memory held."""
    config_ = transformers.LlamaConfig(num_hidden_layers=1, hidden_size=64, intermediate_size=160,
                                       num_attention_heads=4, num_key_value_heads=2, vocab_size=97,
                                       max_position_embeddings=32, tie_word_embeddings=True, pad_token_id=3)
    cfg = config(3, "cpu", 1, param_device="cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with offload.init(cfg):
            model = transformers.LlamaForCausalLM(config_)
        with offload.initialize(model, cfg) as engine:
            embedding = engine.state_dict()["model.embed_tokens.weight"]
    assert torch.equal(embedding[3], torch.zeros(64)) and embedding[4].abs().sum() > 0

    class Gate(torch.nn.Module):  # no reset_parameters, and nothing _init_weights knows
        def __init__(self):
            super().__init__()
            self.scale = torch.nn.Parameter(torch.ones(64))

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with offload.init(cfg):
            model = transformers.LlamaForCausalLM(config_)
            model.model.gate = Gate()
        with pytest.raises(UsageError, match=r"Gate.scale: neither a reset_parameters\(\) nor the model's "
                                             r"_init_weights gives it a value"):
            offload.initialize(model, cfg)


def test_a_model_with_an_init_weights_of_its_own_is_not_taken_for_a_hugging_face_one():
    """A common habit: _init_weights(self) with no module argument, and a config attribute."""
    class Mine(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.config = {"width": 8}
            self.layer = torch.nn.Linear(8, 8)

        def _init_weights(self):
            torch.nn.init.zeros_(self.layer.weight)

        def forward(self, x):
            return self.layer(x).square().mean()

    cfg = config(3, "cpu", 1, param_device="cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with offload.init(cfg):
            model = Mine()
        with offload.initialize(model, cfg) as engine:
            engine.backward(engine(torch.ones(2, 8)))
            engine.step()


def test_a_deepspeed_checkpoint_is_named_as_one(tmp_path):
    step = tmp_path / "ds" / "global_step100"
    step.mkdir(parents=True)
    (tmp_path / "ds" / "latest").write_text("global_step100")
    torch.save({"module": make_model().state_dict()}, step / "mp_rank_00_model_states.pt")
    with _engine(make_model(), stage=2) as engine:
        with pytest.raises(CheckpointError, match=r"is a DeepSpeed checkpoint, which offload does not load; .*"
                                                  r"zero_to_fp32.py"):
            engine.load_checkpoint(str(tmp_path / "ds"))
        with pytest.raises(CheckpointError, match=rf"{step} is a DeepSpeed checkpoint"):  # its tag's directory
            engine.load_checkpoint(str(step))
    with _engine(make_model(), stage=2) as engine:
        with pytest.raises(UsageError, match=r"not a safetensors file .*; it looks like a torch.save file: "
                                             r"torch.load it and pass its state dict"):
            offload.load_weights(engine, str(step / "mp_rank_00_model_states.pt"))


@needs_hf
@pytest.mark.parametrize("build", [_gpt2, _llama], ids=["gpt2", "llama"])
def test_from_pretrained_loads_what_the_engine_trained(tmp_path, build):
    torch.manual_seed(0)
    ids = torch.randint(0, 97, (2, 16), generator=torch.Generator().manual_seed(99))
    with _engine(build()) as engine:
        engine.module.config.dtype = torch.float32  # as a model from from_pretrained records it
        _train(engine)
        engine.save_pretrained(str(tmp_path / "model"), max_shard_bytes=50_000)
        engine.save_pretrained(str(tmp_path / "model-bf16"), dtype=torch.bfloat16)
        engine.save_checkpoint(str(tmp_path / "ckpt"))
        trained = engine.state_dict()
        engine.module.eval()  # as from_pretrained returns it: no dropout
        with torch.no_grad():
            expected = engine(input_ids=ids).logits
    assert main(["export", str(tmp_path / "ckpt"), "--hf", str(tmp_path / "exported"), "--max-shard-size", "50000"]) == 0
    for directory in ("model", "exported"):
        assert {"config.json", "generation_config.json", INDEX} <= set(os.listdir(tmp_path / directory))
        loaded = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / directory))
        with torch.no_grad():
            assert torch.equal(loaded(input_ids=ids).logits, expected), directory
    # Saved in bf16, the model comes back in bf16, as after transformers' own save_pretrained.
    assert main(["export", str(tmp_path / "ckpt"), "--hf", str(tmp_path / "exported-bf16"), "--dtype", "bfloat16"]) == 0
    for directory in ("model-bf16", "exported-bf16"):
        loaded = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / directory))
        assert loaded.dtype == torch.bfloat16, directory
        state = loaded.state_dict()
        assert all(torch.equal(state[k], v.to(torch.bfloat16)) for k, v in trained.items()), directory


@needs_hf
def test_an_export_refuses_a_checkpoints_damaged_or_missing_config(tmp_path):
    """The config files a checkpoint keeps carry their CRC-32 in its manifest:
    a changed value (a rope_theta, a vocabulary size) is not copied into the
    exported model."""
    with _engine(_gpt2()) as engine:
        _train(engine)
        saved = engine.save_checkpoint(str(tmp_path / "ckpt"))
    config = os.path.join(saved, "config.json")
    assert main(["export", str(tmp_path / "ckpt"), "--hf", str(tmp_path / "good")]) == 0
    text = open(config).read()
    with open(config, "w") as f:
        f.write(text.replace('"n_layer": 2', '"n_layer": 3'))
    with pytest.raises(CheckpointError, match="config.json: fails its checksum"):
        offload.checkpoint.export_pretrained(str(tmp_path / "ckpt"), str(tmp_path / "bad"), torch.float32)
    os.unlink(config)
    with pytest.raises(CheckpointError, match="config.json: missing"):
        offload.checkpoint.export_pretrained(str(tmp_path / "ckpt"), str(tmp_path / "bad"), torch.float32)
    assert not os.path.exists(tmp_path / "bad" / "config.json")


_LOAD_SCRIPT = """
import sys, torch, offload
from tests.read_memory import growth_while_reading
path, layers = sys.argv[1], int(sys.argv[2])

def Wide():
    return torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(layers)])

cfg = {"zero_optimization": {"stage": 3, "sub_group_size": 250_000,
                             "offload_optimizer": {"device": "nvme", "nvme_path": path},
                             "offload_param": {"device": "nvme", "nvme_path": path, "buffer_size": 1_100_000,
                                               "max_in_cpu": 0}},
       "aio": {"block_size": 1 << 20}}
torch.manual_seed(0)
with offload.initialize(Wide(), cfg) as engine:
    engine.export(path + "/wide.safetensors")
torch.manual_seed(1)
with offload.init(cfg):
    model = Wide()
engine = offload.initialize(model, cfg)
with growth_while_reading() as growth:
    offload.load_weights(engine, path + "/wide.safetensors")
loaded = engine.state_dict()
engine.close()
torch.manual_seed(0)
print(all(torch.equal(loaded[k], v) for k, v in Wide().state_dict().items()), growth["bytes"])
"""


def test_load_weights_never_holds_the_model(tmp_path):
    """Stage 3 on NVMe, a 101 MB model built under offload.init: loading reads
    slice by slice into the engine's fixed buffers, so host memory grows by far
    less than the model (measured 0-19 MB: the pools' buffers, when not yet
    allocated). In a subprocess with glibc's mmap threshold fixed, as the
    export's test."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072", "PYTHONPATH": root}
    layers = 24
    out = subprocess.run([sys.executable, "-c", _LOAD_SCRIPT, str(tmp_path), str(layers)], capture_output=True,
                         text=True, env=env, timeout=300, check=True).stdout.split()
    assert out[-2] == "True"
    model_bytes = layers * (1024 * 1024 + 1024) * 4
    assert int(out[-1]) < model_bytes / 4, (int(out[-1]), model_bytes)
