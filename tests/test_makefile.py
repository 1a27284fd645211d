"""`make test` and `make train` install only when something the install depends
on changed: a second run skips pip, a fresh clone installs."""

import os
import shutil
import subprocess
import sys
import sysconfig
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Stands in for the interpreter: runs Python for the Makefile's own questions,
# logs pip instead of running it, and says torch is there.
FAKE_PYTHON = """#!/bin/sh
case "$*" in
  "-m pip "*) echo "$*" >> "$(dirname "$0")/pip.log"; exit 0 ;;
  *"import torch"*) echo 2.13.0; exit 0 ;;
esac
exec {python} "$@"
"""


@pytest.fixture
def clone(tmp_path):
    """A fresh clone as far as the install is concerned: the Makefile, pyproject.toml and native/."""
    for name in ("Makefile", "pyproject.toml"):
        shutil.copy(os.path.join(ROOT, name), tmp_path)
    shutil.copytree(os.path.join(ROOT, "native"), tmp_path / "native")
    long_ago = time.time() - 1000
    for path in [tmp_path / "Makefile", tmp_path / "pyproject.toml", *(tmp_path / "native").iterdir()]:
        os.utime(path, (long_ago, long_ago))
    python = tmp_path / "python"
    python.write_text(FAKE_PYTHON.format(python=sys.executable))
    python.chmod(0o755)
    return tmp_path


NATIVE_LIB = f"offload/_native_lib{sysconfig.get_config_var('EXT_SUFFIX')}"


def installs(clone) -> int:
    """Runs `make install`; how many times it ran pip."""
    log = clone / "pip.log"
    before = len(log.read_text().splitlines()) if log.exists() else 0
    subprocess.run(["make", "-s", "install", f"PYTHON={clone / 'python'}"], cwd=clone, check=True,
                   capture_output=True, text=True, timeout=60)
    ran = (len(log.read_text().splitlines()) if log.exists() else 0) - before
    if ran:  # what pip install -e leaves: the native library built in place
        (clone / NATIVE_LIB).parent.mkdir(exist_ok=True)
        (clone / NATIVE_LIB).touch()
    return ran


def edit(clone, name):
    """Makes ``name``, and nothing else, newer than the last install."""
    (stamp,) = (clone / "build").glob("install-*.stamp")
    now = time.time()
    os.utime(stamp, (now - 600, now - 600))
    os.utime(clone / name, (now - 500, now - 500))


@pytest.mark.skipif(shutil.which("make") is None, reason="no make")
def test_install_runs_pip_only_when_its_inputs_change(clone):
    assert installs(clone) == 1  # a fresh clone installs
    assert installs(clone) == 0  # nothing changed
    edit(clone, "native/aio.cpp")
    assert installs(clone) == 1
    assert installs(clone) == 0
    edit(clone, "pyproject.toml")
    assert installs(clone) == 1
    os.remove(clone / NATIVE_LIB)
    assert installs(clone) == 1  # the built library is gone
    assert installs(clone) == 0
