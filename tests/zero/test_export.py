"""Export: the consolidated fp32 or bf16 weights, streamed tensor by tensor to a
safetensors file that appears complete or not at all, equal to state_dict()."""

import os
import subprocess
import sys

import pytest
import torch

from offload import _native
from offload.safetensors_file import read_safetensors

from .harness import config, make_model, train_engine
from .test_engine import Wide

pytestmark = pytest.mark.skipif(not _native.status().available, reason="native library not built")


@pytest.mark.parametrize("stage,param_device", [(2, None), (3, "nvme")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_export_equals_state_dict(tmp_path, stage, param_device, dtype):
    cfg = config(stage, "nvme", 1, str(tmp_path), param_device=param_device)
    with train_engine(make_model(), 3, 1, cfg) as engine:
        expected = engine.state_dict()
        path = str(tmp_path / "model.safetensors")
        engine.export(path, dtype=dtype)
        plan = [key for key, _, _ in engine.export_plan(dtype)]
    exported = read_safetensors(path)
    assert list(exported) == plan  # the header lists tensors in the order they were streamed
    assert set(exported) == set(expected)  # tied weights under both keys
    for key, value in expected.items():
        want = value.to(dtype) if value.is_floating_point() else value
        assert exported[key].dtype == want.dtype and torch.equal(exported[key], want), key
    assert not os.path.exists(path + ".partial")


@pytest.mark.parametrize("filename", ["pytorch_model.bin", "model.safetensors"])
@pytest.mark.parametrize("stage,param_device", [(2, None), (3, "nvme")])
def test_save_16bit_model_writes_the_state_dict_in_the_compute_dtype(tmp_path, stage, param_device, filename):
    """DeepSpeed's ``save_16bit_model``: the model's keys in its order, every
    floating value the fp32 master rounded once to bf16."""
    cfg = config(stage, "nvme", 1, str(tmp_path), param_device=param_device, bf16={"enabled": True})
    model = make_model()
    keys = list(model.state_dict())
    with train_engine(model, 2, 1, cfg) as engine:
        expected = engine.state_dict()
        assert engine.save_16bit_model(str(tmp_path / "out"), filename) is True
    path = tmp_path / "out" / filename
    saved = read_safetensors(str(path)) if filename.endswith(".safetensors") else torch.load(path)
    assert set(saved) == set(keys)
    if filename.endswith(".bin"):
        assert list(saved) == keys
    for key, value in expected.items():
        assert saved[key].dtype == torch.bfloat16 and torch.equal(saved[key], value.to(torch.bfloat16)), key
    assert os.listdir(tmp_path / "out") == [filename]


def test_save_16bit_model_leaves_frozen_parameters_out_if_asked(tmp_path):
    model = make_model()
    model.norm.weight.requires_grad_(False)
    with train_engine(model, 1, 1, config(2, "cpu", 1)) as engine:
        engine.save_16bit_model(str(tmp_path), "all.bin")
        engine.save_16bit_model(str(tmp_path), "trained.safetensors", exclude_frozen_parameters=True)
    assert "norm.weight" in torch.load(tmp_path / "all.bin")
    trained = read_safetensors(str(tmp_path / "trained.safetensors"))
    assert "norm.weight" not in trained and "norm.bias" in trained
    assert trained["gain"].dtype == torch.float32  # fp32 training saves fp32, as DeepSpeed does


def test_a_failed_export_leaves_no_file(tmp_path, monkeypatch):
    cfg = config(2, "cpu", 1)
    with train_engine(make_model(), 1, 1, cfg) as engine:
        first = next(iter(engine.full_weights()))

        def broken(dtype=torch.float32):
            yield first
            raise OSError("disk gone")
        monkeypatch.setattr(engine, "full_weights", broken)
        with pytest.raises(OSError, match="disk gone"):
            engine.export(str(tmp_path / "m.safetensors"))
    assert os.listdir(tmp_path) == []


_STREAM_SCRIPT = """
import sys, psutil, torch, offload
from tests.zero.test_engine import Wide
stage, path = int(sys.argv[1]), sys.argv[2]
torch.manual_seed(0)
cfg = {"zero_optimization": {"stage": stage, "sub_group_size": 1_000_000,
                             "offload_optimizer": {"device": "nvme", "nvme_path": path}},
       "aio": {"block_size": 1 << 20}}
if stage == 3:
    cfg["zero_optimization"]["offload_param"] = {"device": "nvme", "nvme_path": path, "buffer_size": 1_100_000, "max_in_cpu": 0}
engine = offload.initialize(Wide(), cfg)
rss_before = psutil.Process().memory_info().rss
peak = rss_before
original = engine.full_weights

def sampled(dtype=torch.float32):
    global peak
    for item in original(dtype):
        peak = max(peak, psutil.Process().memory_info().rss)
        yield item

engine.full_weights = sampled
engine.export(path + "/wide.safetensors")
engine.close()
print(peak - rss_before)
"""


@pytest.mark.parametrize("stage", [2, 3])
def test_export_streams_one_parameter_at_a_time(tmp_path, stage):
    """Stage 2's default bucket (5e8 elements) holds the whole model: the export
    must still assemble one parameter at a time. In a subprocess with glibc's
    mmap threshold fixed, so RSS measures what is held, not the allocator's history."""
    model_bytes = sum(p.numel() * 4 for p in Wide().parameters())  # 34 MB
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072", "PYTHONPATH": root}
    out = subprocess.run([sys.executable, "-c", _STREAM_SCRIPT, str(stage), str(tmp_path)], capture_output=True,
                         text=True, env=env, timeout=300, check=True).stdout
    growth = int(out.split()[-1])
    assert growth < model_bytes / 2, (growth, model_bytes)


_CHECKPOINT_STREAM_SCRIPT = """
import sys, torch, offload
from offload.checkpoint.export import export
from offload.safetensors_file import read_safetensors
from tests.read_memory import growth_while_reading
from tests.zero.test_engine import Wide
path = sys.argv[1]
torch.manual_seed(0)
model = Wide()
for layer in model.layers[1:]:
    layer.requires_grad_(False)
cfg = {"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}}}
with offload.initialize(model, cfg) as engine:
    engine.save_checkpoint(path + "/checkpoint")
    expected = engine.state_dict()
with growth_while_reading() as growth:
    export(path + "/checkpoint", path + "/wide.safetensors", torch.float32)
exported = read_safetensors(path + "/wide.safetensors")
print(exported.keys() == expected.keys() and all(torch.equal(exported[k], v) for k, v in expected.items()),
      growth["bytes"])
"""


def test_a_checkpoints_export_reads_its_frozen_parameters_one_at_a_time(tmp_path):
    """Seven of Wide's eight layers frozen (a LoRA's base, in miniature): their
    29 MB are in the checkpoint's extras, which ``offload export`` reads as it
    writes each (it read them all first). In a subprocess with glibc's mmap
    threshold fixed, as the test above."""
    frozen_bytes = 7 * (1024 * 1024 + 1024) * 4
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072", "PYTHONPATH": root}
    out = subprocess.run([sys.executable, "-c", _CHECKPOINT_STREAM_SCRIPT, str(tmp_path)], capture_output=True,
                         text=True, env=env, timeout=300, check=True).stdout.split()
    assert out[-2] == "True"
    assert int(out[-1]) < frozen_bytes / 3, (int(out[-1]), frozen_bytes)
