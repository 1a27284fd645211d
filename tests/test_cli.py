"""The command line: `offload bench adam` reports every promised figure, and
bad arguments exit with status 2 and one line, without a traceback."""

import json
import shutil
import subprocess
import sys

import pytest

from offload import _native
from offload.cli import main

BENCH_KEYS = {
    "offload_params_per_s", "torch_fused_params_per_s", "torch_foreach_params_per_s",
    "offload_mixed_params_per_s", "torch_mixed_params_per_s", "stream_copy_gbps",
    "stream_triad_gbps", "offload_gbps", "max_rel_err",
}


@pytest.mark.skipif(not _native.status().available, reason="native library not built")
def test_bench_adam_json_has_every_figure(capsys):
    assert main(["bench", "adam", "--params", "200K", "--rounds", "2", "--threads", "1", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert BENCH_KEYS <= result.keys()
    for key in BENCH_KEYS - {"max_rel_err"}:
        assert result[key] > 0, key
    assert result["max_rel_err"] < 1e-5  # one step, our kernel against torch's fused AdamW
    assert result["params"] == 200_000 and result["threads"] == 1


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
    assert shutil.which("offload") is not None
    proc = subprocess.run(["offload", "--help"], capture_output=True, text=True)
    assert proc.returncode == 0 and "bench" in proc.stdout
