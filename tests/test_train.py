"""`offload train`: the main job end to end at a tiny size, every ready config
in configs/ (the default among them), two ranks under torchrun, Ctrl-C, and
one-line errors for bad input."""

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import warnings

import pytest
import torch

import offload
from offload import _native
from offload.cli import main
from offload.zero import optimizer as optimizer_module
from offload.zero.overlap import OverlappedStep

from .zero.harness import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = sorted(f for f in os.listdir(os.path.join(ROOT, "configs")) if f.endswith(".json"))
native = pytest.mark.skipif(not _native.status().available, reason="native library not built")
PNG = b"\x89PNG\r\n\x1a\n"


def summary_of(out_dir):
    with open(os.path.join(out_dir, "summary.json")) as f:
        return json.load(f)


@native
@pytest.mark.parametrize("batch,flags,expected", [
    ({"train_batch_size": 8}, [], (8, 1)),
    ({"train_batch_size": 8, "gradient_accumulation_steps": 2}, [], (4, 2)),
    # --batch-size sets the micro batch; the config's global batch stands and the accumulation follows
    ({"train_batch_size": 16, "train_micro_batch_size_per_gpu": 4}, ["--batch-size", "8"], (8, 2)),
    ({"train_batch_size": 16, "gradient_accumulation_steps": 4}, ["--batch-size", "2"], (2, 8)),
    ({"gradient_accumulation_steps": 3}, ["--batch-size", "2"], (2, 3)),
])
def test_train_takes_a_deepspeed_batch_size_as_deepspeed_does(tmp_path, batch, flags, expected):
    """Note [batch sizes]: no default micro batch overrides train_batch_size's."""
    config = tmp_path / "ds.json"
    config.write_text(json.dumps({**batch, "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}))
    assert main(["train", "--config", str(config), "--model", "tiny", "--steps", "1", "--out", str(tmp_path / "o"),
                 *flags]) == 0
    s = summary_of(tmp_path / "o")
    assert (s["micro_batch"], s["accumulation"]) == expected


@native
def test_train_end_to_end(tmp_path, capsys, monkeypatch):
    nvme, out = tmp_path / "nvme", tmp_path / "out"
    nvme.mkdir()
    given = []
    initialize = offload.initialize
    monkeypatch.setattr(offload, "initialize", lambda *a, **kw: given.append(kw) or initialize(*a, **kw))
    assert main(["train", "--model", "tiny", "--steps", "8", "--nvme-path", str(nvme), "--out", str(out)]) == 0
    # GPT-2's recipe: weight decay on the matrices, none on biases and norm gains.
    decayed, exempt = given[0]["param_groups"]
    assert "weight_decay" not in decayed and {p.dim() for p in decayed["params"]} == {2}
    assert exempt["weight_decay"] == 0.0 and {p.dim() for p in exempt["params"]} == {1}
    printed = capsys.readouterr().out
    assert str(out / "summary.json") in printed and str(out / "loss.png") in printed
    s = summary_of(out)
    assert len(s["losses"]) == 8
    assert s["losses"][-1] < s["losses"][0] - 0.2 and s["eval_loss_end"] < s["eval_loss_start"] - 0.2
    split = s["seconds_per_step"]
    assert set(split) == {"wall", "compute", "optimizer", "swap", "other", "optimizer_hidden"}
    assert s["tokens_per_s"] == pytest.approx(s["tokens_per_step"] / split["wall"])
    # The median step's own split: its parts add up to its time, as the printed percentages do to 100%.
    assert split["compute"] + split["optimizer"] + split["swap"] + split["other"] == pytest.approx(split["wall"])
    # The state was on disk. (Reads can be 0: a sub-group whose write-back is still
    # in flight when the next step wants it is taken from its buffer, not reread.)
    assert s["disk_bytes_per_step"]["bytes_written"] > 0 and s["bytes_per_tier"]["nvme"] > 0
    assert s["config"]["zero_optimization"]["offload_optimizer"]["device"] == "nvme"
    assert s["weight_decay"] == "0.01 on weight matrices, none on biases and norm gains"
    assert (out / "loss.png").read_bytes()[:8] == PNG
    assert os.listdir(nvme) == []


@native
@pytest.mark.parametrize("extra", [{"delayed_update": True, "delayed_update_warmup": 1}, {"overlap_step": True}])
def test_optimizer_work_beside_compute_is_given_apart_from_the_step(tmp_path, capsys, monkeypatch, extra):
    """The delayed update's Adam runs during the next forward and backward, the
    overlapped step's during backward: counted in the step's split as well, the
    parts added up to more than the step. Each sub-group's Adam is made 10 ms
    longer, and backward waits 15 ms after handing the overlapped step's
    worker a sub-group, so there is work beside compute to count in every
    step however busy the machine is (the waits are sleeps)."""
    adam_step, reduced = optimizer_module.adam_step, OverlappedStep.reduced

    def slower(*args, **kwargs):
        time.sleep(0.01)
        return adam_step(*args, **kwargs)

    def reduced_then_wait(self, lo, hi):
        reduced(self, lo, hi)
        time.sleep(0.015)

    monkeypatch.setattr(optimizer_module, "adam_step", slower)
    monkeypatch.setattr(OverlappedStep, "reduced", reduced_then_wait)
    config = tmp_path / "c.json"
    config.write_text(json.dumps({"zero_optimization": {"stage": 2, "sub_group_size": 20_000, "reduce_bucket_size": 20_000,
                                                        "offload_optimizer": {"device": "cpu", **extra}}}))
    assert main(["train", "--config", str(config), "--model", "tiny", "--steps", "6", "--out", str(tmp_path / "o")]) == 0
    split = summary_of(tmp_path / "o")["seconds_per_step"]
    assert split["compute"] + split["optimizer"] + split["swap"] + split["other"] == pytest.approx(split["wall"])
    assert min(split.values()) >= 0.0
    assert split["optimizer_hidden"] >= 0.003, split  # most of one sub-group's
    assert f"beside compute, {split['optimizer_hidden']:.3f}s more of optimizer work" in capsys.readouterr().out


def _temporary_directory(tmp_path) -> dict:
    """An environment whose temporary directory is tmp_path/tmp."""
    (tmp_path / "tmp").mkdir(exist_ok=True)
    # torch makes its compile cache there on first import unless told where it is: not ours to remove
    return {**os.environ, "TMPDIR": str(tmp_path / "tmp"), "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "torch-cache")}


@native
def test_the_default_temporary_directory_is_named_and_removed(tmp_path):
    """With no --config, the first line names configs/train_default.json and the
    temporary swap directory; the run trains with that file, and removes the directory."""
    scratch = tmp_path / "tmp"
    proc = subprocess.run([sys.executable, "-m", "offload", "train", "--model", "tiny", "--steps", "2",
                           "--out", str(tmp_path / "out")],
                          capture_output=True, text=True, env=_temporary_directory(tmp_path), timeout=300,
                          cwd=ROOT)  # so that `-m offload` is this checkout's, and names its configs relative to it
    assert proc.returncode == 0, proc.stderr
    first = proc.stderr.splitlines()[0]
    assert first.startswith("offload train: config configs/train_default.json (ZeRO stage 2, optimizer on nvme, ")
    assert f"swap files in a directory of their own in {scratch} (temporary, removed at the end; a killed run's: " \
           f"offload clean --nvme-path {scratch})" in first, first
    s = summary_of(tmp_path / "out")
    with open(os.path.join(ROOT, "configs", "train_default.json")) as f:
        default = json.load(f)
    assert s["config"]["optimizer"]["params"]["lr"] == default["optimizer"]["params"]["lr"]
    assert s["config"]["zero_optimization"]["sub_group_size"] == default["zero_optimization"]["sub_group_size"]
    assert s["config"]["bf16"]["enabled"] == torch.cuda.is_available()  # the file leaves the precision to train
    assert os.listdir(scratch) == []


def test_an_nvme_section_without_a_path_shares_the_others_disk():
    """Not the temporary directory, which the first line then did not name."""
    from offload.cli import train

    raw = {"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": "/data/nvme"},
                                 "offload_param": {"device": "nvme"}}}
    made = train._Made(reporting=True)
    assert train._place_swap_files(argparse.Namespace(nvme_path=None), raw, made) == "/data/nvme"
    assert raw["zero_optimization"]["offload_param"]["nvme_path"] == "/data/nvme" and not made.temporary


@native
def test_what_a_killed_default_run_leaves_is_found_by_offload_clean(tmp_path, capsys):
    """SIGKILL leaves the swap files; the first line names the command that
    finds them, and it does (they were a level deeper, in a directory of
    offload train's own, where neither it nor the next run's warning looked)."""
    status, lines = _interrupt([sys.executable, "-m", "offload", "train", "--model", "tiny", "--steps", "100000",
                                "--out", str(tmp_path / "out")], tmp_path, signal.SIGKILL)
    assert status == -signal.SIGKILL, lines
    tmp = tmp_path / "tmp"
    assert f"a killed run's: offload clean --nvme-path {tmp})" in lines[0]
    assert len(os.listdir(tmp)) == 1
    assert main(["clean", "--nvme-path", str(tmp)]) == 0
    assert "removed 1 run directory" in capsys.readouterr().out and os.listdir(tmp) == []


def test_help_names_the_default_config_and_where_swap_files_go(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "configs/train_default.json" in text
    assert f"a directory of their own in {tempfile.gettempdir()}" in text


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


def _interrupt(argv, tmp_path, signum=signal.SIGINT, reports=1):
    """Runs argv, sends it ``signum`` (SIGINT as Ctrl-C does; SIGTERM as kill,
    SLURM and docker do) once rank 0 has reported its progress ``reports``
    times (the first after the first step, then every 5 s), and returns (exit
    status, stderr lines)."""
    env = {**_temporary_directory(tmp_path), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            # as at a terminal: a runner started in the background may have SIGINT ignored
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    watchdog = threading.Timer(300, proc.kill)
    watchdog.start()
    try:
        lines = []
        for line in proc.stderr:
            lines.append(line.rstrip("\n"))
            reports -= line.startswith("train [")
            if reports == 0:
                break
        proc.send_signal(signum)
        _, rest = proc.communicate()
    finally:
        watchdog.cancel()
    return proc.returncode, lines + rest.splitlines()


INTERRUPTED = r"offload train: interrupted after step \d+ of 100000; removed its swap files and the empty {}"


@native
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_ctrl_c_prints_one_line_and_leaves_nothing_behind(tmp_path, signum):
    """Exit status 128 + the signal (130, 143), no traceback, and what the run
    made is gone: the temporary swap directory and the --out directory, still
    empty. SIGTERM used to kill the run at once and leave its swap files."""
    out = tmp_path / "out"
    status, lines = _interrupt([sys.executable, "-m", "offload", "train", "--model", "tiny", "--steps", "100000",
                                "--out", str(out)], tmp_path, signum)
    assert status == 128 + signum, lines
    said = [line for line in lines if not line.startswith("train [")]
    assert len(said) == 2 and said[0].startswith("offload train: config "), lines
    assert re.fullmatch(INTERRUPTED.format(re.escape(str(out))), said[1]), said[1]
    assert os.listdir(tmp_path / "tmp") == [] and not out.exists()


@native
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_ctrl_c_under_torchrun_leaves_one_line_from_the_ranks(tmp_path, signum):
    """torchrun passes Ctrl-C on to each rank; a rank then may be waiting in a
    collective for one that has already left. Rank 0 says one line, the other
    rank nothing, neither a traceback. torchrun's own report (a warning per
    rank and its traceback, exit status 1) is its own."""
    out = tmp_path / "out"
    status, lines = _interrupt(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
         "-m", "offload", "train", "--model", "tiny", "--steps", "100000", "--out", str(out)], tmp_path, signum)
    assert status != 0
    text = "\n".join(lines)
    assert "KeyboardInterrupt" not in text and os.sep + "offload" + os.sep not in text, text  # no frame of ours
    said = [line for line in lines if line.startswith("offload train: interrupted")]
    from_torchrun = ("; under torchrun a SIGTERM is what it sends every rank when one has failed (its report names "
                     "the rank and its exit status), or when it is stopped itself")
    expected = INTERRUPTED.format(re.escape(str(out))) + (re.escape(from_torchrun) if signum == signal.SIGTERM else "")
    assert len(said) == 1 and re.fullmatch(expected, said[0]), text
    assert [name for name in os.listdir(tmp_path / "tmp") if not name.startswith("torchelastic_")] == []
    assert not out.exists()


def test_an_error_after_ctrl_c_is_reported_as_the_interruption(monkeypatch, capsys, default_sigint):
    """A rank waiting in a collective when Ctrl-C comes raises the collective's
    error first (its peer has left) and handles the SIGINT later, in cleanup.
    Cleanup runs to its end anyway, and the run ends as interrupted: Note [Ctrl-C]."""
    from offload.cli import train

    closed = []

    class Engine:
        def close(self, restore_model=True):
            signal.raise_signal(signal.SIGINT)  # handled here, at the first call after it arrived
            closed.append(restore_model)

    def run(args, model_config, seq_len, raw, made, *plan):
        made.engine = Engine()
        raise RuntimeError("[gloo] Connection closed by peer")

    monkeypatch.setattr(train, "_run", run)
    assert main(["train", "--model", "tiny"]) == 130
    assert closed == [False]  # no collective gathering of the model back: the peer is gone
    assert capsys.readouterr().err == "offload train: interrupted before training; nothing to remove\n"
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_an_error_without_ctrl_c_keeps_its_traceback(monkeypatch, default_sigint):
    from offload.cli import train

    def run(args, model_config, seq_len, raw, made, *plan):
        raise RuntimeError("[gloo] Connection closed by peer")

    monkeypatch.setattr(train, "_run", run)
    with pytest.raises(RuntimeError, match="closed by peer"):
        main(["train", "--model", "tiny"])


def _write(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


@pytest.mark.parametrize("case", ["steps", "model", "model_json", "config_missing", "config_json", "config_key",
                                  "seq_len", "nvme_path", "config_nvme_path", "export_missing", "config_array",
                                  "config_directory", "model_vocab", "model_bool", "out_is_a_file", "seed",
                                  "export_out_directory", "export_out_new_directory", "export_hf_file",
                                  "model_empty"])
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
        "model_empty": (["train", "--model", _write(tmp_path, "e.json", "{}")], "give a JSON object with some of"),
        "out_is_a_file": (["train", "--out", _write(tmp_path, "file", "")], "cannot create it"),
        "seed": (["train", "--seed", str(10**20)], "must be in [0, 2**32)"),
        "export_out_directory": (["export", str(tmp_path), "--out", str(tmp_path)], "is a directory; name the file"),
        "export_out_new_directory": (["export", str(tmp_path), "--out", str(tmp_path / "new") + os.sep],
                                     "is a directory; name the file"),
        "export_hf_file": (["export", str(tmp_path), "--hf", _write(tmp_path, "config.json", "{}")],
                           "is not a directory; name a directory to write into"),
    }[case]
    proc = subprocess.run([sys.executable, "-m", "offload", *argv], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert message in proc.stderr and "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr


def test_the_largest_seed_gives_batches():
    from offload.data import ByteBatches

    data = ByteBatches(bytes(range(256)) * 64, 16, 2, seed=2**32 - 1)
    assert data.batch(10**6, 3, 7).shape == (2, 17)


def test_steps_skipped_for_an_fp16_overflow_are_said_and_left_out_of_the_figures(tmp_path, capsys):
    """A loss scale of 2^20 overflows fp16 at first: the skipped steps are
    counted and said, with the loss scale they leave; the disk figures are
    per step applied (each writes the whole state once), the timing split a
    step applied's."""
    config = tmp_path / "fp16.json"
    config.write_text(json.dumps({
        "train_micro_batch_size_per_gpu": 2, "fp16": {"enabled": True, "initial_scale_power": 20, "hysteresis": 1},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "nvme", "nvme_path": str(tmp_path)}}}))
    assert main(["train", "--model", "tiny", "--steps", "8", "--config", str(config), "--out", str(tmp_path / "o")]) == 0
    s = summary_of(tmp_path / "o")
    assert 1 <= s["skipped_steps"] < 8 and s["loss_scale"] == 2.0 ** (20 - s["skipped_steps"])
    assert f"{s['skipped_steps']} of 8 steps skipped for an fp16 overflow" in capsys.readouterr().out
    state = s["bytes_per_tier"]["nvme"]
    assert s["disk_bytes_per_step"]["bytes_written"] == state


def _exported(checkpoint, path):
    from offload.safetensors_file import read_safetensors

    assert main(["export", str(checkpoint), "--out", str(path)]) == 0
    return read_safetensors(str(path))


@native
def test_a_run_resumed_from_its_checkpoint_takes_the_uninterrupted_runs_steps(tmp_path, capsys):
    """--save-interval leaves a checkpoint halfway; resumed from it (the default
    config: optimizer state on NVMe), the run takes the steps of the run that
    went on, bit for bit: the same losses, held-out loss and final weights."""
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    assert main(["train", "--model", "tiny", "--steps", "6", "--save-interval", "3", "--save", str(whole),
                 "--out", str(tmp_path / "o1")]) == 0
    assert sorted(os.listdir(whole)) == ["global_step3", "global_step6", "latest"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the same options: nothing to say
        assert main(["train", "--model", "tiny", "--steps", "6", "--resume", str(whole / "global_step3"),
                     "--save", str(resumed), "--out", str(tmp_path / "o2")]) == 0
    report = capsys.readouterr().out
    assert f"for steps 4-6 (resumed from {whole / 'global_step3'})" in report
    assert f"checkpoint: {resumed / 'global_step6'}" in report
    first, second = summary_of(tmp_path / "o1"), summary_of(tmp_path / "o2")
    assert main(["train", "--model", "tiny", "--steps", "6", "--out", str(tmp_path / "o3")]) == 0
    unsaved = summary_of(tmp_path / "o3")  # saving changes neither the steps nor the disk traffic they are said to make

    def needed(summary):  # a read a write-back still held is kept, not read: how many depends on the disk's pace
        disk = summary["disk_bytes_per_step"]
        return disk["bytes_read"] + disk["bytes_kept"], disk["bytes_written"]

    assert unsaved["losses"] == first["losses"] and needed(unsaved) == needed(first)
    assert len(second["losses"]) == 6 and second["losses"] == first["losses"]
    assert (second["eval_loss_start"], second["eval_loss_end"]) == (first["eval_loss_start"], first["eval_loss_end"])
    a, b = _exported(whole, tmp_path / "a.safetensors"), _exported(resumed, tmp_path / "b.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # the export is the trained model: loaded into a plain GPT, it gives the held-out loss the run reported
    from offload.cli.train import EVAL_BATCHES
    from offload.data import ByteBatches, stdlib_corpus
    from offload.models.gpt import GPT, SIZES

    model = GPT(SIZES["tiny"])
    model.load_state_dict(a)
    evals = ByteBatches(stdlib_corpus(), first["seq_len"], first["micro_batch"], first["seed"]).eval_batches(EVAL_BATCHES)
    with torch.no_grad():
        held_out = sum(model(batch).item() for batch in evals) / len(evals)
    assert held_out == pytest.approx(first["eval_loss_end"], rel=1e-6)
    assert "in place of" not in capsys.readouterr().out
    _exported(resumed, tmp_path / "a.safetensors")
    assert f"{tmp_path / 'a.safetensors'} (in place of the file that was there)" in capsys.readouterr().out
    for _ in range(2):  # the bundled GPT is no Hugging Face model: from_pretrained will want a config.json
        with pytest.warns(UserWarning, match=r"kept no config.json \(its model was no Hugging Face model\)"):
            assert main(["export", str(resumed), "--hf", str(tmp_path / "hf")]) == 0
    assert capsys.readouterr().out.count("(in place of the model that was there)") == 1


@native
def test_save_and_resume_refuse_before_training_what_they_cannot_do(tmp_path, capsys):
    saved = tmp_path / "saved"
    assert main(["train", "--model", "tiny", "--steps", "2", "--save", str(saved), "--out", str(tmp_path / "o")]) == 0
    foreign = tmp_path / "foreign"
    with offload.initialize(torch.nn.Linear(4, 4), {"zero_optimization": {"stage": 1}}) as engine:
        engine.save_checkpoint(str(foreign))
    (tmp_path / "empty").mkdir()
    with pytest.warns(UserWarning, match=r"its steps are not those that run would have taken: --steps: the learning "
                                         r"rate's warm-up and decay follow it \(2 then, 3 now\); --seed: other "
                                         r"batches \(0 then, 1 now\)$"):
        assert main(["train", "--model", "tiny", "--steps", "3", "--seed", "1", "--resume", str(saved),
                     "--out", str(tmp_path / "o3")]) == 0
    for argv, message in [
        (["--steps", "2", "--resume", str(saved)], "the checkpoint is at step 2, so --steps 2 leaves nothing"),
        (["--model", "small", "--steps", "4", "--resume", str(saved)], "pass the --model it was trained with"),
        (["--steps", "2", "--save", str(saved)], "holds global_step2 already"),
        (["--save-interval", "2"], "--save-interval needs --save DIR"),
        (["--resume", str(tmp_path / "empty")], "no checkpoint here"),
        (["--resume", str(foreign)], "was not saved by offload train"),
        (["--save", str(tmp_path / "o" / "summary.json")], "is not a directory"),
        (["--save", str(saved / "global_step2")], f"is a checkpoint itself; name the directory checkpoints go in ({saved}"),
    ]:
        argv = ["train", "--model", "tiny", *argv, "--out", str(tmp_path / "never")]
        assert main(argv) == 2, argv
        assert message in capsys.readouterr().err, argv
        assert not (tmp_path / "never").exists()


@native
def test_an_interrupted_run_names_its_last_checkpoint_which_resumes_it(tmp_path):
    """Ctrl-C keeps what --save wrote: the line names the newest complete
    checkpoint (the one ``latest`` names), and --resume continues from it."""
    saved = tmp_path / "saved"
    status, lines = _interrupt([sys.executable, "-m", "offload", "train", "--model", "tiny", "--steps", "100000",
                                "--save-interval", "1", "--save", str(saved), "--out", str(tmp_path / "o")],
                               tmp_path, reports=2)
    assert status == 130, lines
    named = re.search(r"; the last checkpoint, (\S+), takes --resume$", lines[-1])
    assert named, lines[-1]
    step = int(named.group(1).rsplit("global_step", 1)[1])
    assert named.group(1) == str(saved / (saved / "latest").read_text().strip())
    assert main(["train", "--model", "tiny", "--steps", str(step + 1), "--resume", str(saved),
                 "--out", str(tmp_path / "o2")]) == 0
    assert len(summary_of(tmp_path / "o2")["losses"]) == step + 1
    # resumed without --save, nothing this run does is kept, and the line says so
    status, lines = _interrupt([sys.executable, "-m", "offload", "train", "--model", "tiny", "--steps", "100000",
                                "--resume", named.group(1), "--out", str(tmp_path / "o3")], tmp_path)
    assert status == 130, lines
    said = re.search(r"interrupted after step (\d+) of 100000; .*; nothing saved since (\S+) \(--save DIR keeps a "
                     r"run's steps\)$", lines[-1])
    assert said and int(said.group(1)) > step and said.group(2) == named.group(1), lines[-1]
