"""Checkpoints: a resumed run is bitwise the uninterrupted one (every stage and
tier, world sizes 1 and 2); `offload export` of a checkpoint equals the live
engine's export; a damaged file is refused naming it; a failed or killed save
leaves every earlier checkpoint loadable."""

import json
import os
import random
import shutil
import subprocess
import sys
import zlib

import numpy as np
import pytest
import torch

import offload
from offload import _native, checkpoint
from offload.checkpoint import format as ckpt_format
from offload.checkpoint import save_load
from offload.cli import main
from offload.safetensors_file import read_safetensors

from .harness import TinyLM, batch, config, finish_rank, init_gloo, spawn_ranks

pytestmark = pytest.mark.skipif(not _native.status().available, reason="native library not built")


class WithState(TinyLM):
    """TinyLM plus what a checkpoint must carry beside the optimizer: a buffer
    the model updates itself, and a frozen parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("seen", torch.zeros(()))
        self.frozen = torch.nn.Parameter(torch.ones(4), requires_grad=False)

    def forward(self, tokens):
        self.seen += tokens.shape[0]
        return super().forward(tokens) * self.frozen.mean()


def model(seed=0):
    torch.manual_seed(seed)
    return WithState()


def run(engine, steps, accumulation=1, rank=0):
    for step in steps:
        for micro in range(accumulation):
            engine.backward(engine(batch(step, micro, rank)))
            engine.step()


CASES = [(1, "none", None), (2, "cpu", None), (2, "nvme", None), (3, "cpu", "none"), (3, "cpu", "cpu"), (3, "nvme", "nvme")]


def case_config(stage, device, param_device, nvme, accumulation=1, **extra):
    return config(stage, device, accumulation, nvme if "nvme" in (device, param_device) else None,
                  param_device=param_device, **extra)


@pytest.mark.parametrize("stage,device,param_device", CASES)
def test_resume_is_bitwise_the_uninterrupted_run(tmp_path, stage, device, param_device):
    cfg = case_config(stage, device, param_device, str(tmp_path), accumulation=2)
    with offload.initialize(model(), cfg) as engine:
        run(engine, range(6), 2)
        expected = engine.state_dict()
    with offload.initialize(model(), cfg) as engine:
        run(engine, range(3), 2)
        path = engine.save_checkpoint(str(tmp_path / "ckpt"), client_state={"data_position": 3})
    assert path == str(tmp_path / "ckpt" / "global_step3")
    with offload.initialize(model(seed=1), cfg) as engine:  # other initial weights: all must come from the checkpoint
        directory, client = engine.load_checkpoint(str(tmp_path / "ckpt"))
        assert directory == path and client == {"data_position": 3}
        assert engine.global_steps == 3 and engine.micro_steps == 6
        run(engine, range(3, 6), 2)
        resumed = engine.state_dict()
    assert resumed.keys() == expected.keys()
    for key in expected:
        assert torch.equal(resumed[key], expected[key]), key
    assert resumed["seen"].item() == 6 * 2 * 3  # the buffer came back too


@pytest.mark.parametrize("stage,param_device", [(2, None), (3, "nvme")])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_offload_export_equals_the_live_export(tmp_path, stage, param_device, dtype, capsys):
    cfg = case_config(stage, "nvme", param_device, str(tmp_path))
    with offload.initialize(model(), cfg) as engine:
        run(engine, range(2))
        engine.save_checkpoint(str(tmp_path / "ckpt"))
        engine.export(str(tmp_path / "live.safetensors"), dtype=getattr(torch, dtype))
    out = tmp_path / "from_checkpoint.safetensors"
    assert main(["export", str(tmp_path / "ckpt"), "--out", str(out), "--dtype", dtype]) == 0
    assert "global_step2" in capsys.readouterr().out
    assert out.read_bytes() == (tmp_path / "live.safetensors").read_bytes()


def _world2_worker(rank, port, out_dir):
    init_gloo(rank, 2, port)
    results = {}
    for stage, device, param_device in [(2, "nvme", None), (3, "cpu", "nvme")]:
        nvme = os.path.join(out_dir, f"nvme{rank}")
        os.makedirs(nvme, exist_ok=True)
        save_dir = os.path.join(out_dir, f"ckpt{stage}")
        cfg = case_config(stage, device, param_device, nvme)
        with offload.initialize(model(), cfg) as engine:
            run(engine, range(5), rank=rank)
            expected = engine.state_dict()
        with offload.initialize(model(), cfg) as engine:
            run(engine, range(2), rank=rank)
            engine.save_checkpoint(save_dir)
            engine.export(os.path.join(out_dir, f"live{stage}.safetensors"))
        with offload.initialize(model(seed=1), cfg) as engine:
            engine.load_checkpoint(save_dir)
            run(engine, range(2, 5), rank=rank)
            resumed = engine.state_dict()
        results[stage] = all(torch.equal(resumed[k], expected[k]) for k in expected)
    finish_rank(out_dir, rank, results)


def test_world_size_2_resume_and_export(tmp_path):
    assert spawn_ranks(_world2_worker, tmp_path) == [{"2": True, "3": True}] * 2
    for stage in (2, 3):
        out = tmp_path / f"exported{stage}.safetensors"
        assert main(["export", str(tmp_path / f"ckpt{stage}"), "--out", str(out)]) == 0
        assert out.read_bytes() == (tmp_path / f"live{stage}.safetensors").read_bytes()
        assert sorted(os.listdir(tmp_path / f"ckpt{stage}" / "global_step2")) == [
            "extra.safetensors", "manifest.json", "rank-00000.bin", "rank-00001.bin"]


def saved(tmp_path, tags=("a",), cfg=None):
    cfg = cfg or case_config(2, "cpu", None, None)
    engine = offload.initialize(model(), cfg)
    for i, tag in enumerate(tags):
        run(engine, [i])
        engine.save_checkpoint(str(tmp_path / "ckpt"), tag)
    return engine


def test_a_damaged_file_is_refused_naming_it(tmp_path, capsys):
    saved(tmp_path).close()
    shard = tmp_path / "ckpt" / "a" / "rank-00000.bin"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(data)
    with offload.initialize(model(), case_config(2, "cpu", None, None)) as engine:
        with pytest.raises(checkpoint.CheckpointError, match=r"rank-00000.bin: section exp_avg, bytes .* fail their checksum"):
            engine.load_checkpoint(str(tmp_path / "ckpt"))
    assert main(["export", str(tmp_path / "ckpt"), "--out", str(tmp_path / "x.safetensors")]) == 0  # master is intact
    data[10] ^= 0x01
    shard.write_bytes(data)
    assert main(["export", str(tmp_path / "ckpt"), "--out", str(tmp_path / "y.safetensors")]) == 2
    err = capsys.readouterr().err.strip()
    assert "section master" in err and "fail their checksum" in err and len(err.splitlines()) == 1
    assert not (tmp_path / "y.safetensors").exists()
    shard.write_bytes(data[:-4])
    with pytest.raises(checkpoint.CheckpointError, match="truncated or replaced"):
        checkpoint.export(str(tmp_path / "ckpt"), str(tmp_path / "z.safetensors"), torch.float32)


def test_a_failed_save_leaves_the_previous_checkpoint(tmp_path, monkeypatch):
    engine = saved(tmp_path, tags=("a",))
    real_write = ckpt_format.SectionWriter.write

    def failing(self, values):
        if self.position > 0:
            raise OSError(28, "No space left on device")
        real_write(self, values)

    monkeypatch.setattr(ckpt_format.SectionWriter, "write", failing)
    run(engine, [1])
    with pytest.raises(OSError, match="rank-00000.bin: No space left on device"):
        engine.save_checkpoint(str(tmp_path / "ckpt"), "b")
    engine.close()
    assert sorted(os.listdir(tmp_path / "ckpt")) == ["a", "latest"]  # the failed one's space was given back
    assert (tmp_path / "ckpt" / "latest").read_text() == "a"
    with offload.initialize(model(), case_config(2, "cpu", None, None)) as fresh:
        fresh.load_checkpoint(str(tmp_path / "ckpt"))
        assert fresh.global_steps == 1


def test_a_save_whose_latest_cannot_be_written_says_the_checkpoint_stands(tmp_path, monkeypatch):
    """The checkpoint is complete once its directory has its name; a full disk
    when `latest` is written next must not call it failed (a retry with its
    tag would be refused: it exists)."""
    engine = saved(tmp_path, tags=("a",))
    real = save_load.write_synced

    def full_at_latest(path, data):
        if path.endswith("latest.partial"):
            raise OSError(28, "No space left on device")
        real(path, data)

    monkeypatch.setattr(save_load, "write_synced", full_at_latest)
    run(engine, [1])
    final = str(tmp_path / "ckpt" / "b")
    with pytest.raises(OSError, match=rf"{final} is complete, but .*latest could not be made to name it "
                                      rf"\(No space left on device\); load it with tag='b'"):
        engine.save_checkpoint(str(tmp_path / "ckpt"), "b")
    engine.close()
    assert (tmp_path / "ckpt" / "latest").read_text() == "a"
    with offload.initialize(model(), case_config(2, "cpu", None, None)) as fresh:
        fresh.load_checkpoint(str(tmp_path / "ckpt"), "b")
        assert fresh.global_steps == 2


_KILLED_SAVE = """
import os, sys, torch
sys.path.insert(0, {root!r})
import offload
from offload.checkpoint import save_load
from tests.zero.test_checkpoint import case_config, model, run
engine = offload.initialize(model(), case_config(2, "nvme", None, {nvme!r}))
run(engine, [0])
engine.save_checkpoint({save_dir!r}, "a")
run(engine, [1])
real_fsync_dir = save_load.fsync_dir
def die_before_rename(path):
    real_fsync_dir(path)
    if path.endswith(".partial"):
        os.kill(os.getpid(), 9)  # everything written, manifest included; not yet renamed
save_load.fsync_dir = die_before_rename
engine.save_checkpoint({save_dir!r}, "b")
"""


def test_a_killed_save_loses_nothing_complete_before(tmp_path):
    save_dir, nvme = str(tmp_path / "ckpt"), str(tmp_path / "nvme")
    os.mkdir(nvme)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    proc = subprocess.run([sys.executable, "-c", _KILLED_SAVE.format(root=root, nvme=nvme, save_dir=save_dir)],
                          capture_output=True, text=True)
    assert proc.returncode == -9, proc.stderr
    assert sorted(os.listdir(save_dir)) == [".b.partial", "a", "latest"]
    with offload.initialize(model(), case_config(2, "cpu", None, None)) as engine:
        assert engine.load_checkpoint(save_dir)[0].endswith("/a")
        assert engine.global_steps == 1
        run(engine, [1])
        engine.save_checkpoint(save_dir, "b")  # the leftover partial directory is replaced
    assert sorted(os.listdir(save_dir)) == ["a", "b", "latest"]
    assert (tmp_path / "ckpt" / "latest").read_text() == "b"


def test_a_save_replaces_its_tag_as_deepspeeds_does(tmp_path):
    """A script saving tag="last" every N steps keeps the newest only."""
    engine = saved(tmp_path, tags=("last", "last"))
    expected = engine.state_dict()
    engine.close()
    assert sorted(os.listdir(tmp_path / "ckpt")) == ["last", "latest"]
    with offload.initialize(model(), case_config(2, "cpu", None, None)) as engine:
        engine.load_checkpoint(str(tmp_path / "ckpt"))
        assert engine.global_steps == 2
        state = engine.state_dict()
        assert all(torch.equal(state[k], expected[k]) for k in expected)


def test_a_replaced_checkpoint_left_behind_never_loads_as_its_tag(tmp_path):
    """A save killed after the new checkpoint took the name, before the old
    one was removed, leaves a twin that is stale: deleting the tag later must
    not bring the old checkpoint back, and the next save removes it."""
    engine = saved(tmp_path, tags=("last", "last"))
    save_dir = tmp_path / "ckpt"
    shutil.copytree(save_dir / "last", save_dir / ".last.replaced")
    assert checkpoint.resolve(str(save_dir), "last") == str(save_dir / "last")
    run(engine, [2])
    engine.save_checkpoint(str(save_dir), "other")
    engine.save_checkpoint(str(save_dir), "last")
    assert sorted(os.listdir(save_dir)) == ["last", "latest", "other"]
    shutil.copytree(save_dir / "last", save_dir / ".last.replaced")
    shutil.rmtree(save_dir / "last")
    with pytest.raises(checkpoint.CheckpointError, match="has no checkpoint tagged 'last'; its tags: other$"):
        checkpoint.resolve(str(save_dir), "last")
    engine.close()


def test_odd_tags_are_replaced_as_any_other(tmp_path):
    """A tag that is a link to another checkpoint, and one named as the file
    `latest` is written through."""
    engine = saved(tmp_path, tags=("a",))
    save_dir = tmp_path / "ckpt"
    os.symlink("a", save_dir / "best")
    for step in (1, 2):
        run(engine, [step])
        engine.save_checkpoint(str(save_dir), "best")
        assert checkpoint.read_manifest(str(save_dir / "best")).training.global_steps == step + 1
    assert not (save_dir / "best").is_symlink() and (save_dir / "a").is_dir()
    engine.save_checkpoint(str(save_dir), "latest.partial")
    run(engine, [3])
    engine.save_checkpoint(str(save_dir), "b")
    assert (save_dir / "latest").read_text() == "b"
    assert sorted(os.listdir(save_dir)) == ["a", "b", "best", "latest", "latest.partial"]
    engine.close()


_KILLED_REPLACING = """
import os, sys
sys.path.insert(0, {root!r})
from tests.zero.test_checkpoint import case_config, model, offload, run
engine = offload.initialize(model(), case_config(2, "cpu", None, None))
run(engine, [0])
engine.save_checkpoint({save_dir!r}, "last")
run(engine, [1])
real_rename = os.rename
def die_before_the_new_takes_its_name(src, dst):
    if src.endswith(".partial"):
        os.kill(os.getpid(), 9)  # the old checkpoint already set aside
    real_rename(src, dst)
os.rename = die_before_the_new_takes_its_name
engine.save_checkpoint({save_dir!r}, "last")
"""


def test_a_save_killed_while_replacing_its_tag_keeps_the_old_checkpoint(tmp_path):
    save_dir = str(tmp_path / "ckpt")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    proc = subprocess.run([sys.executable, "-c", _KILLED_REPLACING.format(root=root, save_dir=save_dir)],
                          capture_output=True, text=True)
    assert proc.returncode == -9, proc.stderr
    assert sorted(os.listdir(save_dir)) == [".last.partial", ".last.replaced", "latest"]
    assert checkpoint.resolve(save_dir, "last") == os.path.join(save_dir, ".last.replaced")
    with pytest.raises(checkpoint.CheckpointError, match="has no checkpoint tagged 'zzz'; its tags: last$"):
        checkpoint.resolve(save_dir, "zzz")
    assert checkpoint.read_manifest(checkpoint.resolve(os.path.join(save_dir, "last"))).training.global_steps == 1
    with offload.initialize(model(), case_config(2, "cpu", None, None)) as engine:
        engine.load_checkpoint(save_dir)
        assert engine.global_steps == 1
        run(engine, [1])
        def full_disk(*args):
            raise OSError(28, "No space left on device")

        with pytest.MonkeyPatch.context() as patch:  # the next save fails too, while writing
            patch.setattr(save_load, "_write_rank", full_disk)
            with pytest.raises(OSError, match="No space left"):
                engine.save_checkpoint(save_dir, "last")
        assert checkpoint.read_manifest(checkpoint.resolve(save_dir, "last")).training.global_steps == 1
        engine.save_checkpoint(save_dir, "last")
        expected = engine.state_dict()
    assert sorted(os.listdir(save_dir)) == ["last", "latest"]
    with offload.initialize(model(), case_config(2, "cpu", None, None)) as engine:
        engine.load_checkpoint(save_dir, "last")
        assert engine.global_steps == 2
        state = engine.state_dict()
        assert all(torch.equal(state[k], expected[k]) for k in expected)


def _looped() -> list:
    loop = [1]
    loop.append(loop)
    return loop


def test_wrong_uses_are_refused_with_the_fix(tmp_path):
    engine = saved(tmp_path, tags=("a",))
    (tmp_path / "ckpt" / "mine").mkdir()
    (tmp_path / "ckpt" / "mine" / "notes.txt").write_text("not a checkpoint")
    with pytest.raises(checkpoint.CheckpointError, match="mine exists and is not an offload checkpoint"):
        engine.save_checkpoint(str(tmp_path / "ckpt"), "mine")
    assert os.listdir(tmp_path / "ckpt" / "mine") == ["notes.txt"]
    with pytest.raises(ValueError, match="plain name"):
        engine.save_checkpoint(str(tmp_path / "ckpt"), "../x")
    for client, message in [
        ({"x": object()}, r"client_state\['x'\] is a builtins.object, which a checkpoint's JSON cannot hold"),
        ({"best": [torch.tensor(0.5)]}, r"client_state\['best'\]\[0\] is a torch.Tensor, .*\(a tensor's \.item\(\)"),
        ({"n": np.int64(3)}, r"client_state\['n'\] is a numpy.int64"),
        ({"seen": {3: 10}}, r"client_state\['seen'\] has the key 3 \(int\), which .* as the string '3'"),
        ({"pair": (1, 2)}, r"client_state\['pair'\] is a tuple, which .* as a list: pass a list"),
        ({"loop": _looped()}, r"client_state\['loop'\]\[1\] contains itself"),
    ]:
        with pytest.raises(ValueError, match=message):
            engine.save_checkpoint(str(tmp_path / "ckpt"), "c", client_state=client)
    assert not (tmp_path / "ckpt" / "c").exists()
    engine.backward(engine(batch(9, 0, 0)))  # accumulation 1: the boundary, but no step yet
    with pytest.raises(ValueError, match="middle of gradient accumulation"):
        engine.save_checkpoint(str(tmp_path / "ckpt"), "c")
    engine.close()
    with pytest.raises(checkpoint.CheckpointError, match="no checkpoint here"):
        checkpoint.resolve(str(tmp_path))
    with pytest.raises(checkpoint.CheckpointError, match="ckpt has no checkpoint tagged 'zzz'; its tags: a$"):
        checkpoint.resolve(str(tmp_path / "ckpt"), "zzz")
    (tmp_path / "ckpt" / "half").mkdir()  # a tag directory without a manifest
    with pytest.raises(checkpoint.CheckpointError, match="half: no manifest.json; this tag was never completed"):
        checkpoint.resolve(str(tmp_path / "ckpt"), "half")
    torch.manual_seed(0)
    other = TinyLM(layers=2)
    with offload.initialize(other, case_config(2, "cpu", None, None)) as engine:
        with pytest.raises(checkpoint.CheckpointError, match="differ from this model|this model lacks"):
            engine.load_checkpoint(str(tmp_path / "ckpt"))
    manifest_path = tmp_path / "ckpt" / "a" / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    manifest.pop("crc32")
    manifest["world_size"] = 2
    manifest_path.write_text(json.dumps({**manifest, "crc32": zlib.crc32(ckpt_format._canonical(manifest))}))
    with offload.initialize(model(), case_config(2, "cpu", None, None)) as engine:
        with pytest.raises(checkpoint.CheckpointError, match="the manifest is damaged"):  # no rank 1 file
            engine.load_checkpoint(str(tmp_path / "ckpt"))


def test_an_integer_tag_loads_as_it_saved(tmp_path):
    """DeepSpeed scripts pass the step as the tag, to both calls."""
    engine = saved(tmp_path, tags=(100, 200))
    expected = engine.state_dict()
    engine.close()
    with offload.initialize(model(), case_config(2, "cpu", None, None)) as engine:
        directory, _ = engine.load_checkpoint(str(tmp_path / "ckpt"), tag=200)
        assert directory == str(tmp_path / "ckpt" / "200")
        state = engine.state_dict()
        assert all(torch.equal(state[k], expected[k]) for k in expected)


def test_fp16_loss_scale_survives(tmp_path):
    cfg = case_config(2, "cpu", None, None, fp16={"enabled": True, "initial_scale_power": 8, "loss_scale_window": 2})
    engine = offload.initialize(model(), cfg)
    run(engine, range(3))
    scale = engine.scaler.scale
    assert scale != 2**8  # the window grew it
    engine.save_checkpoint(str(tmp_path / "ckpt"))
    engine.close()
    with offload.initialize(model(), cfg) as fresh:
        fresh.load_checkpoint(str(tmp_path / "ckpt"))
        assert fresh.scaler.scale == scale and fresh.scaler.state_dict() == engine.scaler.state_dict()


@pytest.mark.parametrize("name,damage", [("manifest.json", "edit"), ("extra.safetensors", "flip"),
                                         ("extra.safetensors", "truncate")])
def test_a_damaged_manifest_or_extra_file_is_refused(tmp_path, name, damage, capsys):
    saved(tmp_path).close()
    path = tmp_path / "ckpt" / "a" / name
    data = bytearray(path.read_bytes())
    if damage == "edit":
        data = data.replace(b'"global_steps": 1', b'"global_steps": 7')
    elif damage == "flip":
        data[-3] ^= 0x01
    else:
        data = data[:-2]
    path.write_bytes(data)
    with offload.initialize(model(), case_config(2, "cpu", None, None)) as engine:
        with pytest.raises(checkpoint.CheckpointError, match=f"{name}: fails its checksum"):
            engine.load_checkpoint(str(tmp_path / "ckpt"))
    assert main(["export", str(tmp_path / "ckpt"), "--out", str(tmp_path / "x.safetensors")]) == 2
    assert "fails its checksum" in capsys.readouterr().err


def test_with_the_delayed_update_resuming_equals_continuing(tmp_path):
    """Saving applies the update in flight (Note [checkpoint atomicity] in the
    save docstring): from there, the run that goes on and the resumed one agree bitwise."""
    cfg = case_config(2, "cpu", None, None, offload_optimizer={"delayed_update": True, "delayed_update_warmup": 1})
    with offload.initialize(model(), cfg) as engine:
        run(engine, range(4))
        engine.save_checkpoint(str(tmp_path / "ckpt"))
        run(engine, range(4, 8))
        expected = engine.state_dict()
    with offload.initialize(model(seed=1), cfg) as engine:
        engine.load_checkpoint(str(tmp_path / "ckpt"))
        run(engine, range(4, 8))
        resumed = engine.state_dict()
    for key in expected:
        assert torch.equal(resumed[key], expected[key]), key


def test_a_bf16_run_exports_every_floating_value_in_the_asked_dtype(tmp_path):
    cfg = case_config(3, "cpu", "cpu", None, bf16={"enabled": True})
    with offload.initialize(model(), cfg) as engine:
        run(engine, range(2))
        engine.save_checkpoint(str(tmp_path / "ckpt"))
        assert engine.module.seen.dtype == torch.bfloat16  # buffers run in the compute dtype
        state = engine.state_dict()
    assert all(v.dtype == torch.float32 for v in state.values())
    checkpoint.export(str(tmp_path / "ckpt"), str(tmp_path / "m.safetensors"), torch.float32)
    exported = read_safetensors(str(tmp_path / "m.safetensors"))
    assert {k: v.dtype for k, v in exported.items()} == {k: torch.float32 for k in state}
    for key in state:
        assert torch.equal(exported[key], state[key]), key


def test_another_accumulation_and_the_learning_rate_carry_over(tmp_path):
    engine = offload.initialize(model(), case_config(2, "cpu", None, None, accumulation=4))
    run(engine, range(2), 4)
    engine.lr = 1.5e-3
    engine.save_checkpoint(str(tmp_path / "ckpt"))
    engine.close()
    with offload.initialize(model(), case_config(2, "cpu", None, None, accumulation=2)) as engine:
        engine.load_checkpoint(str(tmp_path / "ckpt"))
        assert engine.global_steps == 2 and engine.micro_steps == 4 and engine.lr == 1.5e-3
        run(engine, [2], 2)
        assert engine.global_steps == 3
        engine.save_checkpoint(str(tmp_path / "ckpt"))  # at a boundary of this run's accumulation


class WithDropout(WithState):
    """Dropout and a numpy draw in every step: a resume must continue every
    random generator where the saving run stood."""

    def __init__(self) -> None:
        super().__init__()
        self.drop = torch.nn.Dropout(0.3)

    def forward(self, tokens):
        noise = float(np.random.rand()) + random.random()  # the host RNGs a data pipeline would draw from
        return super().forward(tokens) + self.drop(self.frozen).sum() * noise


@pytest.mark.parametrize("stage,device,param_device", [(2, "nvme", None), (3, "cpu", "cpu")])
def test_a_resumed_run_draws_the_same_random_numbers(tmp_path, stage, device, param_device):
    cfg = case_config(stage, device, param_device, str(tmp_path))

    def build(seed=0):
        torch.manual_seed(seed)
        return WithDropout()

    torch.manual_seed(5), np.random.seed(5), random.seed(5)
    with offload.initialize(build(), cfg) as engine:
        losses = []
        for step in range(6):
            losses.append(engine(batch(step, 0, 0)))
            engine.backward(losses[-1])
            engine.step()
        expected = engine.state_dict()
    torch.manual_seed(5), np.random.seed(5), random.seed(5)
    with offload.initialize(build(), cfg) as engine:
        run(engine, range(3))
        engine.save_checkpoint(str(tmp_path / "ckpt"))
    torch.manual_seed(9), np.random.seed(9), random.seed(9)  # the resuming process starts from other states
    with offload.initialize(build(seed=1), cfg) as engine:
        engine.load_checkpoint(str(tmp_path / "ckpt"))
        resumed_losses = []
        for step in range(3, 6):
            resumed_losses.append(engine(batch(step, 0, 0)))
            engine.backward(resumed_losses[-1])
            engine.step()
        resumed = engine.state_dict()
    assert [l.item() for l in resumed_losses] == [l.item() for l in losses[3:]]  # noqa: E741
    for key in expected:
        assert torch.equal(resumed[key], expected[key]), key
