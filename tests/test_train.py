"""`offload train`: the main job end to end at a tiny size, every ready config
in configs/, two ranks under torchrun, and one-line errors for bad input."""

import json
import os
import subprocess
import sys

import pytest

from offload import _native
from offload.cli import main

from .zero.harness import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = sorted(f for f in os.listdir(os.path.join(ROOT, "configs")) if f.endswith(".json"))
native = pytest.mark.skipif(not _native.status().available, reason="native library not built")
PNG = b"\x89PNG\r\n\x1a\n"


def summary_of(out_dir):
    with open(os.path.join(out_dir, "summary.json")) as f:
        return json.load(f)


@native
def test_train_end_to_end(tmp_path, capsys):
    nvme, out = tmp_path / "nvme", tmp_path / "out"
    nvme.mkdir()
    assert main(["train", "--model", "tiny", "--steps", "8", "--nvme-path", str(nvme), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert str(out / "summary.json") in printed and str(out / "loss.png") in printed
    s = summary_of(out)
    assert len(s["losses"]) == 8
    assert s["losses"][-1] < s["losses"][0] - 0.2 and s["eval_loss_end"] < s["eval_loss_start"] - 0.2
    assert s["tokens_per_s"] > 0 and set(s["seconds_per_step"]) == {"wall", "compute", "optimizer", "swap", "other"}
    assert s["disk_bytes_per_step"]["bytes_read"] > 0 and s["bytes_per_tier"]["nvme"] > 0  # the state was on disk
    assert s["config"]["zero_optimization"]["offload_optimizer"]["device"] == "nvme"
    assert (out / "loss.png").read_bytes()[:8] == PNG
    assert os.listdir(nvme) == []


@native
def test_the_default_temporary_directory_is_removed(tmp_path):
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    proc = subprocess.run([sys.executable, "-m", "offload", "train", "--model", "tiny", "--steps", "2",
                           "--out", str(tmp_path / "out")],
                          capture_output=True, text=True, env={**os.environ, "TMPDIR": str(scratch)}, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert summary_of(tmp_path / "out")["steps"] == 2
    assert os.listdir(scratch) == []


@native
@pytest.mark.parametrize("name", CONFIGS)
def test_every_ready_config_trains(tmp_path, name):
    with open(os.path.join(ROOT, "configs", name)) as f:
        raw = json.load(f)
    nvme, out = tmp_path / "nvme", tmp_path / "out"
    nvme.mkdir()
    argv = ["train", "--config", os.path.join(ROOT, "configs", name), "--model", "tiny", "--steps", "4",
            "--nvme-path", str(nvme), "--out", str(out)]
    assert main(argv) == 0
    s = summary_of(out)
    zero = s["config"]["zero_optimization"]
    assert zero["stage"] == raw["zero_optimization"]["stage"]
    assert zero["offload_optimizer"]["device"] == raw["zero_optimization"]["offload_optimizer"]["device"]
    if "offload_param" in raw["zero_optimization"]:
        assert zero["offload_param"]["device"] == raw["zero_optimization"]["offload_param"]["device"]
    assert s["eval_loss_end"] < s["eval_loss_start"]
    assert os.listdir(nvme) == []


def test_configs_cover_the_four_setups():
    setups = set()
    for name in CONFIGS:
        with open(os.path.join(ROOT, "configs", name)) as f:
            zero = json.load(f)["zero_optimization"]
        setups.add((zero["stage"], zero["offload_optimizer"]["device"], zero.get("offload_param", {}).get("device")))
    assert {(2, "cpu", None), (2, "nvme", None), (3, "cpu", "cpu"), (3, "nvme", "nvme")} <= setups


@native
def test_two_ranks_under_torchrun(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
         "-m", "offload", "train", "--model", "tiny", "--steps", "4", "--out", str(tmp_path / "out")],
        capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    s = summary_of(tmp_path / "out")
    assert s["world_size"] == 2 and s["tokens_per_step"] == 2 * 8 * 64
    assert s["eval_loss_end"] < s["eval_loss_start"]
    assert proc.stdout.count("trained GPT") == 1  # rank 0 reports


def _write(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


@pytest.mark.parametrize("case", ["steps", "model", "model_json", "config_missing", "config_json", "config_key",
                                  "seq_len", "nvme_path", "config_nvme_path", "export_missing", "config_array",
                                  "config_directory", "model_vocab", "model_bool", "out_is_a_file", "seed",
                                  "export_out_directory"])
def test_bad_input_exits_2_with_one_line(tmp_path, case):
    argv, message = {
        "steps": (["train", "--steps", "0"], "must be >= 1"),
        "model": (["train", "--model", "7B"], "neither a bundled size"),
        "model_json": (["train", "--model", _write(tmp_path, "m.json", '{"n_layers": 2}')], "unknown keys ['n_layers']"),
        "config_missing": (["train", "--config", "/nonexistent.json"], "cannot read config '/nonexistent.json': No such file or directory"),
        "config_json": (["train", "--config", _write(tmp_path, "c.json", "{")], "is not valid JSON"),
        "config_key": (["train", "--config", _write(tmp_path, "k.json", '{"zero_optimisation": {}}')], "zero_optimization"),
        "seq_len": (["train", "--model", "tiny", "--seq-len", "65"], "exceeds the model's block_size 64"),
        "nvme_path": (["train", "--nvme-path", "/nonexistent"], "--nvme-path '/nonexistent' is not a directory"),
        "config_nvme_path": (["train", "--config", os.path.join(ROOT, "configs", "zero2_nvme.json")],
                             "offload_optimizer.nvme_path '/local_nvme' is not a directory"),
        "export_missing": (["export", str(tmp_path), "--out", str(tmp_path / "x.safetensors")], "no checkpoint here"),
        "config_array": (["train", "--config", _write(tmp_path, "a.json", "[]")], "must hold a JSON object"),
        "config_directory": (["train", "--config", str(tmp_path)], "Is a directory"),
        "model_vocab": (["train", "--model", _write(tmp_path, "v.json", '{"vocab_size": 100}')], "below 256"),
        "model_bool": (["train", "--model", _write(tmp_path, "b.json", '{"n_layer": true}')], "whole number"),
        "out_is_a_file": (["train", "--out", _write(tmp_path, "file", "")], "cannot create it"),
        "seed": (["train", "--seed", str(10**20)], "must be in [0, 2**32)"),
        "export_out_directory": (["export", str(tmp_path), "--out", str(tmp_path)], "is a directory; name the file"),
    }[case]
    proc = subprocess.run([sys.executable, "-m", "offload", *argv], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert message in proc.stderr and "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr


def test_the_largest_seed_gives_batches():
    from offload.data import ByteBatches

    data = ByteBatches(bytes(range(256)) * 64, 16, 2, seed=2**32 - 1)
    assert data.batch(10**6, 3, 7).shape == (2, 17)
