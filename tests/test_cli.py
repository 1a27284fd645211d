"""The command line: `offload bench adam` reports every promised figure, and
bad arguments exit with status 2 and one line, without a traceback."""

import io
import json
import os
import subprocess
import sys
import sysconfig
import time

import pytest

import offload
from offload import _native
from offload.cli import bench_adam, bench_step, cpu_times, main
from offload.errors import ConfigError, SwapIOError
from offload.models.gpt import GPT, SIZES
from offload.store import State
from offload.zero.layout import FlatLayout, SubGroups

BENCH_KEYS = {
    "offload_params_per_s", "torch_fused_params_per_s", "torch_foreach_params_per_s",
    "offload_mixed_params_per_s", "torch_mixed_params_per_s", "offload_codes_params_per_s", "stream_copy_gbps",
    "stream_triad_gbps", "offload_gbps", "max_rel_err",
}


@pytest.mark.skipif(not _native.status().available, reason="native library not built")
def test_bench_adam_json_has_every_figure(capsys):
    assert main(["bench", "adam", "--params", "200K", "--rounds", "2", "--threads", "1", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert BENCH_KEYS <= result.keys()
    assert result["max_rel_err"] < 1e-5  # one step, our kernel against torch's fused AdamW
    assert result["params"] == 200_000 and result["threads"] == 1
    # Every figure follows from the measured throughputs by the stated byte counts:
    approx = lambda key, value: pytest.approx(value, rel=1e-9)  # noqa: E731
    assert result["offload_gbps"] == approx("", bench_adam.FP32_BYTES * result["offload_params_per_s"] / 1e9)
    assert result["offload_mixed_gbps"] == approx("", bench_adam.MIXED_BYTES * result["offload_mixed_params_per_s"] / 1e9)
    assert result["offload_codes_gbps"] == approx("", bench_adam.CODES_BYTES * result["offload_codes_params_per_s"] / 1e9)
    assert result["offload_codes_vs_offload"] == approx(
        "", result["offload_codes_params_per_s"] / result["offload_params_per_s"])
    assert result["offload_vs_fused"] == approx("", result["offload_params_per_s"] / result["torch_fused_params_per_s"])
    assert result["offload_vs_foreach"] == approx("", result["offload_params_per_s"] / result["torch_foreach_params_per_s"])
    assert result["offload_mixed_vs_torch_mixed"] == approx(
        "", result["offload_mixed_params_per_s"] / result["torch_mixed_params_per_s"])
    best_stream = max(result["stream_copy_gbps"], result["stream_triad_gbps"])
    assert result["offload_fraction_of_stream"] == approx("", result["offload_gbps"] / best_stream)
    # Adam reads and writes 28 B/param: no 2-core machine does that at 1e12 params/s.
    assert 1e6 < result["offload_params_per_s"] < 1e12


@pytest.mark.skipif(not _native.status().available, reason="native library not built")
def test_bench_adam_table_names_every_contender(capsys):
    assert main(["bench", "adam", "--params", "100000", "--rounds", "1"]) == 0
    out = capsys.readouterr().out
    for label in ("offload, fp32", "torch AdamW fused", "torch AdamW foreach", "bf16 grad", "STREAM copy", "STREAM triad"):
        assert label in out


@pytest.mark.parametrize(
    "argv,message",
    [
        (["bench", "adam", "--params", "lots"], "is not a count"),
        (["bench", "adam", "--params", "0"], "must be a whole number >= 1"),
        (["bench", "adam", "--threads", "-2"], "must be >= 1"),
        (["bench", "nothing"], "invalid choice"),
    ],
)
def test_bad_arguments_exit_2_with_one_line(argv, message):
    proc = subprocess.run([sys.executable, "-m", "offload", *argv], capture_output=True, text=True)
    assert proc.returncode == 2
    assert message in proc.stderr
    assert "Traceback" not in proc.stderr


def test_console_script_is_installed():
    script = os.path.join(sysconfig.get_path("scripts"), "offload")
    assert os.path.exists(script), f"no console script at {script}; install with pip install -e ."
    proc = subprocess.run([script, "--help"], capture_output=True, text=True)
    assert proc.returncode == 0 and "bench" in proc.stdout


@pytest.mark.skipif(not _native.status().available, reason="native library not built")
def test_bench_step_reports_every_setups_critical_path(tmp_path, capsys):
    argv = ["bench", "step", "--model", "tiny", "--setups", "nvme,nvme+overlap,cpu,cpu+dpu", "--steps", "2",
            "--nvme-path", str(tmp_path), "--sub-group-size", "20000", "--json"]
    assert main(argv) == 0
    result = json.loads(capsys.readouterr().out)
    setups = result["setups"]
    assert list(setups) == ["nvme", "nvme+overlap", "cpu", "cpu+dpu"]
    # The optimizer's own traffic per step: every sub-group's state (12 B per owned
    # element, padded to 4 KiB) and its 4 KiB header, read once and written once.
    owned = FlatLayout.of_model(list(GPT(SIZES["tiny"]).named_parameters()), 0, 1, 20_000).owned
    expected = sum(4096 + -(-12 * (hi - lo) // 4096) * 4096 for lo, hi in SubGroups.of(owned, 20_000))
    nvme = setups["nvme"]
    # A sub-group whose write-back is still in flight when the next step gets it
    # is kept, not read; two steps' median is their mean, so the sum is exact.
    assert nvme["bytes_read"] + nvme["bytes_kept"] == expected
    # Every write-back counts, though a step returns with the last ones in flight (it once said 7.9% less).
    assert nvme["bytes_written"] == setups["nvme+overlap"]["bytes_written"] == expected
    assert nvme["io"]["bytes_read"] == nvme["io"]["bytes_written"] == expected  # these steps wait for the last one
    assert setups["cpu"]["bytes_read"] == 0
    # Initializing writes each sub-group once, master and zero moments, and reads none back.
    assert (nvme["initialize_bytes_read"], nvme["initialize_bytes_written"]) == (0, expected)
    assert setups["cpu"]["initialize_bytes_read"] == setups["cpu"]["initialize_bytes_written"] == 0
    # The checksums cover every data byte read and written (no CRC-32C beats
    # 100 GB/s on a core); the cpu setups' turns move nothing.
    data = expected - 4096 * len(SubGroups.of(owned, 20_000))
    for name in ("nvme", "nvme+overlap"):
        assert 2 * data / 100e9 <= setups[name]["checksum_cpu_s"] <= setups[name]["wall_s"], name
    assert setups["cpu"]["checksum_cpu_s"] == setups["cpu+dpu"]["checksum_cpu_s"] == 0.0
    assert setups["nvme"]["hidden"]["optimizer"] == setups["cpu"]["hidden"]["optimizer"] == 0.0  # no worker
    for name, setup in setups.items():
        critical = setup["critical"]
        # two steps: their medians are their means, so the work is the step's and the hidden part's
        assert setup["hidden"]["optimizer"] == pytest.approx(setup["optimizer_work"] - critical["optimizer"])
        assert setup["hidden_fraction"] == pytest.approx(bench_step.hidden_fraction(setup))
        assert critical["forward"] + critical["backward"] + critical["optimizer"] <= setup["wall_s"] * 1.001, name
    # Note [stolen time]: every core's time in the steps is busy, idle or stolen, to
    # within the kernel's tick on each core; the mean step is the mean of the walls.
    tick = 1 / os.sysconf("SC_CLK_TCK")
    for name, setup in setups.items():
        if cpu_times.now() is None:  # no /proc/stat: none reported
            assert "core_s" not in setup
            continue
        counted = sum(setup["core_s"].values())
        assert abs(counted - os.cpu_count() * setup["core_s_step_s"]) <= 2 * os.cpu_count() * tick, (name, setup["core_s"])
        assert setup["core_s_step_s"] == pytest.approx(setup["wall_s"])  # two steps: the median is the mean
    assert result["ratios"] == pytest.approx({"nvme+overlap / nvme": setups["nvme+overlap"]["wall_s"] / nvme["wall_s"],
                                              "cpu+dpu / cpu": setups["cpu+dpu"]["wall_s"] / setups["cpu"]["wall_s"]})
    disk = max(expected / (result["disk_read_gbps"] * 1e9), expected / (result["disk_write_gbps"] * 1e9))
    assert result["disk_seconds"] == pytest.approx(disk)
    assert result["pipeline_efficiency"] == pytest.approx(disk / nvme["io"]["window"])
    assert result["pipeline_efficiency"] < 1.25  # the disk cannot beat its own speed; the margin is measurement noise
    assert os.listdir(tmp_path) == []


def test_bench_step_measures_each_setup_after_its_own_step_on_a_quiet_disk(tmp_path, capsys, monkeypatch):
    """Note [a turn of two steps]: no measured step starts while another
    setup's write-backs are in flight, and each follows a step of its own."""
    calls, one_step = [], bench_step._one_step

    def watched(engine, tokens):
        others = [e for e in stores if e is not engine]
        busy = any(stores[e].state(key) is State.WRITING for e in others for key in stores[e].keys())
        calls.append((engine, busy))
        return one_step(engine, tokens)

    stores = {}
    initialize = bench_step.offload.initialize

    def tracked(*args, **kwargs):
        engine = initialize(*args, **kwargs)
        stores[engine] = engine.optimizer.store
        return engine

    monkeypatch.setattr(bench_step, "_one_step", watched)
    monkeypatch.setattr(bench_step.offload, "initialize", tracked)
    argv = ["bench", "step", "--model", "tiny", "--setups", "nvme,nvme+overlap,cpu", "--steps", "1",
            "--nvme-path", str(tmp_path), "--sub-group-size", "20000", "--json"]
    assert main(argv) == 0
    json.loads(capsys.readouterr().out)
    turns = [calls[i : i + 2] for i in range(0, 3 * 3 * 2, 2)]  # 3 rounds (2 warm-up) x 3 setups, 2 steps each
    assert [len({engine for engine, _ in turn}) for turn in turns] == [1] * 9
    assert [turn[0][0] for turn in turns] == list(stores) * 3
    assert len(calls) == 9 * 2 and not [busy for _, busy in calls if busy]


def test_bench_step_counts_the_cores_over_the_measured_step_only(tmp_path, capsys, monkeypatch):
    """A machine whose two cores are busy in forward, idle in backward and
    stolen in the step, measured on perf_counter's clock, not in ticks."""
    spent = {kind: 0.0 for kind in ("forward", "backward", "optimizer")}

    def charged(name, method):
        def run(self, *args, **kwargs):
            start = time.perf_counter()
            try:
                return method(self, *args, **kwargs)
            finally:
                spent[name] += time.perf_counter() - start
        return run

    def now():
        return cpu_times.CoreSeconds(2 * spent["forward"], 2 * spent["backward"], 2 * spent["optimizer"])

    engine_class = offload.Engine
    monkeypatch.setattr(engine_class, "__call__", charged("forward", engine_class.__call__))
    monkeypatch.setattr(engine_class, "backward", charged("backward", engine_class.backward))
    monkeypatch.setattr(engine_class, "step", charged("optimizer", engine_class.step))
    monkeypatch.setattr(cpu_times, "now", now)
    argv = ["bench", "step", "--model", "tiny", "--setups", "cpu", "--steps", "2", "--json"]
    assert main(argv) == 0
    got = json.loads(capsys.readouterr().out)["setups"]["cpu"]
    critical = got["critical"]  # two steps: the medians are the means
    assert got["core_s"] == pytest.approx({"busy": 2 * critical["forward"], "idle": 2 * critical["backward"],
                                           "stolen": 2 * critical["optimizer"]}, rel=0.05)


def test_core_seconds_come_from_the_aggregate_cpu_line():
    tick = 1 / os.sysconf("SC_CLK_TCK")
    text = "cpu  100 5 20 300 7 1 2 40 0 0\ncpu0 50 5 10 150 3 1 1 20 0 0\nintr 12345\n"
    assert cpu_times.parse(text) == pytest.approx(cpu_times.CoreSeconds(128 * tick, 307 * tick, 40 * tick))
    assert cpu_times.parse(text) - cpu_times.parse(text.replace("cpu  100", "cpu  110")) == pytest.approx((-10 * tick, 0, 0))


def test_the_hidden_share_is_not_clamped():
    assert bench_step.hidden_fraction({"optimizer_work": 0.4, "critical": {"optimizer": 0.1}}) == pytest.approx(0.75)
    # Waiting for the worker cost more than the plain step would have:
    assert bench_step.hidden_fraction({"optimizer_work": 0.4, "critical": {"optimizer": 0.6}}) == pytest.approx(-0.5)


@pytest.mark.skipif(not _native.status().available, reason="native library not built")
def test_bench_step_stage_3_with_weights_on_nvme(tmp_path, capsys):
    argv = ["bench", "step", "--model", "tiny", "--stage", "3", "--setups", "cpu", "--offload-param", "nvme",
            "--steps", "1", "--nvme-path", str(tmp_path), "--json"]
    assert main(argv) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["stage"] == 3 and result["offload_param"] == "nvme" and result["setups"]["cpu"]["bytes_read"] > 0
    assert os.listdir(tmp_path) == []


def test_bench_step_refuses_an_unknown_setup():
    proc = subprocess.run([sys.executable, "-m", "offload", "bench", "step", "--setups", "cpu,gpu"],
                          capture_output=True, text=True)
    assert proc.returncode == 2 and "--setups: unknown ['gpu']" in proc.stderr


def test_bench_step_refuses_a_setup_its_stage_rules_out_before_building_any(monkeypatch, capsys):
    monkeypatch.setattr(offload, "initialize", lambda *a, **k: pytest.fail("an engine was built"))
    assert main(["bench", "step", "--model", "tiny", "--stage", "3", "--setups", "cpu,cpu+dpu"]) == 2
    assert "--setups cpu+dpu: zero_optimization.offload_optimizer.delayed_update is for stages 1 and 2" in \
        capsys.readouterr().err


@pytest.mark.parametrize("error,status,one_line", [
    (ConfigError("zero_optimization.stage must be one of [1, 2, 3], got 4"), 2, True),
    (SwapIOError("write /nvme/x.swap at offset 4096: No space left on device (errno 28)"), 1, True),
    (ValueError("a bug somewhere"), None, False),
    (OSError(5, "Input/output error"), None, False),
])
def test_only_offload_errors_become_one_line(monkeypatch, capsys, error, status, one_line):
    """An OffloadError is the user's to fix: one line and its exit status.
    Anything else is a bug: it propagates with its traceback."""
    from offload.cli import export

    def fail(args):
        raise error

    monkeypatch.setattr(export, "run", fail)
    argv = ["export", "somewhere", "--out", "model.safetensors"]
    if not one_line:
        with pytest.raises(type(error)):
            main(argv)
        return
    assert main(argv) == status
    err = capsys.readouterr().err
    assert err == f"offload export: error: {error}\n"


@pytest.mark.parametrize("argv,attr,expected", [
    (["train", "--model", "5m"], "model", "5M"),
    (["train", "--model", "TINY"], "model", "tiny"),
    (["bench", "step", "--model", "25m"], "model", "25M"),
])
def test_model_names_in_any_case(argv, attr, expected):
    """A size name is read in any case, as counts are (`--params 13b`), and reported in its own spelling."""
    from offload.cli import build_parser

    assert getattr(build_parser().parse_args(argv), attr) == expected


def test_estimate_takes_a_size_name_in_any_case(capsys):
    from offload.models.gpt import SIZES

    assert main(["estimate", "--model-config", "85m", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["params"] == SIZES["85M"].params()


def test_estimate_reads_a_config_that_leaves_its_swap_directory_to_the_command_line(capsys):
    """offload train's default config names no nvme_path (train gives one); the
    estimate touches no disk, and reads the config's dtype and buffers alike."""
    shipped = os.path.join(os.path.dirname(__file__), "..", "configs", "train_default.json")
    assert main(["estimate", "--params", "10M", "--config", shipped, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["compute_dtype"] == "float32"  # the config's: no bf16 section


def test_estimate_for_training_on_the_cpu_counts_no_staging_copy_of_the_weights(capsys):
    """On the CPU stages 1-2 write new weights into the model's a sub-group at
    a time (the engine's own figures: tests/test_estimate.py); a GPU's come
    back through a staging copy of the rank's whole part."""
    staging = {}
    for accelerator in ("gpu", "cpu"):
        assert main(["estimate", "--params", "1B", "--stage", "2", "--accelerator", accelerator, "--json"]) == 0
        setups = json.loads(capsys.readouterr().out)["setups"]
        staging[accelerator] = next(s for s in setups if s["setup"]["name"] == "stage 2, optimizer cpu")["per_rank"]["host"]["staging"]
    assert staging == {"gpu": 2 * 10**9, "cpu": 2 * 10**8}  # bf16: the rank's part, or one sub-group (default 1e8)


def test_an_error_under_torchrun_names_its_rank(tmp_path, monkeypatch, capsys):
    """A rank may fail alone (a --resume directory only rank 0 sees); lines from every rank interleave."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    missing = tmp_path / "nowhere.json"
    assert main(["estimate", "--params", "10M", "--config", str(missing)]) == 2
    assert capsys.readouterr().err.startswith(f"offload estimate (rank 1): error: cannot read config '{missing}'")


class _Terminal(io.StringIO):
    def isatty(self):
        return True

    def fileno(self):
        return 2


NOTE = "loss 3.142 | 12,345 tok/s | compute 12ms optim 3ms swap 0ms | device 942.0 KiB host 2.3 MiB nvme 1.4 MiB"


@pytest.mark.parametrize("columns", [80, 40, 200])
def test_progress_bar_fits_the_terminal(monkeypatch, columns):
    """On a terminal the bar is redrawn in place, one column narrower than the
    terminal: a wider line wraps, and each redraw then scrolls a new line."""
    from offload.cli.progress import Progress

    err = _Terminal()
    monkeypatch.setattr(sys, "stderr", err)
    monkeypatch.setenv("COLUMNS", str(columns))
    bar = Progress(3, "train")
    for _ in range(3):
        bar.advance(NOTE)
    drawn = err.getvalue().split("\r")[1:]
    assert [len(line.rstrip("\n")) for line in drawn] == [columns - 1] * 3
    assert drawn[-1].startswith("train [") and " 3/3 " in drawn[-1] and drawn[-1].endswith("\n")
    assert ("nvme 1.4 MiB" in drawn[-1]) == (columns == 200)  # the note is cut to fit, not wrapped


def test_progress_bar_measures_the_terminal_it_draws_on(monkeypatch):
    """With stdout piped (`offload train | tee log`) the width is stderr's terminal's."""
    from offload.cli import progress

    def terminal_size(fd):
        if fd != 2:
            raise OSError("not a terminal")
        return os.terminal_size((57, 24))

    monkeypatch.setattr(sys, "stderr", _Terminal())
    monkeypatch.delenv("COLUMNS", raising=False)
    monkeypatch.setattr(os, "get_terminal_size", terminal_size)
    assert progress.terminal_columns() == 57


@pytest.mark.parametrize("argv,line", [
    (["train", "--stpes", "5"],
     "offload train: error: unrecognized arguments: --stpes 5; did you mean --steps? (see offload train --help)"),
    (["train", "--steps=5", "--seq-lenn=3"],
     "offload train: error: unrecognized arguments: --seq-lenn=3; did you mean --seq-len? (see offload train --help)"),
    (["bench", "step", "--setpus", "nvme"],
     "offload bench step: error: unrecognized arguments: --setpus nvme; did you mean --setups? "
     "(see offload bench step --help)"),
    (["trian"], "offload: error: argument COMMAND: invalid choice: 'trian'; did you mean 'train'? (see offload --help)"),
    (["bench", "stpe"],
     "offload bench: error: argument BENCHMARK: invalid choice: 'stpe'; did you mean 'step'? (see offload bench --help)"),
    (["estimate", "--parms", "7B"],  # argparse finds the required option missing before the misspelt one unknown
     "offload estimate: error: one of the arguments --params --model-config is required; unrecognized: --parms "
     "(did you mean --params?) (see offload estimate --help)"),
])
def test_a_typo_gets_the_nearest_name_and_the_help_page_that_lists_it(capsys, argv, line):
    """One line, status 2, the nearest valid name, and the help page of the
    subcommand at fault: the top-level one lists no subcommand's options."""
    from offload.cli import build_parser

    with pytest.raises(SystemExit) as exit:
        build_parser().parse_args(argv)
    assert exit.value.code == 2
    assert capsys.readouterr().err == line + "\n"
    # the help page the line names lists the name it suggests
    help_page = line[line.rindex("(see ") + 5:-len(" --help)")].split()[1:]
    suggestion = line.split("did you mean ")[1].split("?")[0].strip("'")
    with pytest.raises(SystemExit):
        build_parser().parse_args(help_page + ["--help"])
    assert suggestion in capsys.readouterr().out


def test_a_reader_that_leaves_early_ends_the_command_quietly():
    """`offload estimate ... | head -1`: no traceback when the pipe closes, and
    the status a shell tool killed by SIGPIPE gives."""
    command = [sys.executable, "-m", "offload", "estimate", "--params", "1B"]
    child = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    child.stdout.close()  # before the child, still importing torch, writes its first line
    _, err = child.communicate(timeout=120)
    assert (child.returncode, err.decode()) == (141, "")


def test_a_broken_pipe_other_than_the_output_is_a_bug(monkeypatch):
    """Only a closed reader of our output ends a command quietly; a socket or a
    child's pipe breaking is a traceback to report."""
    from offload.cli import estimate

    def broken(args):
        raise BrokenPipeError(32, "a child's pipe")

    monkeypatch.setattr(estimate, "run", broken)
    with pytest.raises(BrokenPipeError, match="a child's pipe"):
        main(["estimate", "--params", "1B"])


def test_only_the_first_sigint_raises():
    """torchrun passes the terminal's Ctrl-C on to every rank, and users press it
    twice: after the first, SIGINT no longer cuts cleanup short (Note [Ctrl-C])."""
    import signal

    from offload.cli.interrupt import Sigint

    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        sigint = Sigint()
        with pytest.raises(KeyboardInterrupt):
            signal.raise_signal(signal.SIGINT)
        signal.raise_signal(signal.SIGINT)
        assert sigint.finish()
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # `offload train &`: the shell keeps Ctrl-C from it
        ignored = Sigint()
        signal.raise_signal(signal.SIGINT)
        assert not ignored.finish() and signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, previous)


def test_bench_step_sizes_the_nvme_pipeline_by_buffer_count(tmp_path, capsys, monkeypatch):
    counts, initialize = {}, bench_step.offload.initialize

    def tracked(*args, **kwargs):
        engine = initialize(*args, **kwargs)
        counts[engine.config.zero_optimization.offload_optimizer.overlap_step] = (
            engine.config.zero_optimization.offload_optimizer.buffer_count)
        return engine

    monkeypatch.setattr(bench_step.offload, "initialize", tracked)
    argv = ["bench", "step", "--model", "tiny", "--setups", "nvme,nvme+overlap", "--steps", "1",
            "--nvme-path", str(tmp_path), "--sub-group-size", "20000", "--buffer-count", "3", "--json"]
    assert main(argv) == 0
    json.loads(capsys.readouterr().out)
    assert counts == {False: 3, True: 3}


def test_a_warning_under_the_command_line_is_what_it_says_without_offloads_lines(tmp_path):
    """The place Python names for a warning is offload's own code (or runpy's
    under ``python -m``): a user reads only the message. (A process of its
    own: pytest records warnings instead of printing them.)"""
    config = tmp_path / "c.json"
    config.write_text(json.dumps({"train_micro_batch_size_per_gpu": 2, "wall_clock_breakdown": True,
                                  "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
                                  "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}))
    run = subprocess.run([sys.executable, "-m", "offload", "train", "--model", "tiny", "--steps", "1", "--config",
                          str(config), "--out", str(tmp_path / "o")], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    err = run.stderr.splitlines()
    said = [line for line in err if "wall_clock_breakdown" in line]
    assert said == ["UserWarning: offload: these settings have no effect here: wall_clock_breakdown (they tune "
                    "DeepSpeed's own internals)"], err
    assert not any(".py:" in line or "runpy" in line for line in err), err
