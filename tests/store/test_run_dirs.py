"""Run directories and their owners (Note [run directory ownership]): a store
killed with SIGKILL leaves its directory behind; the next store in the same
nvme_path warns about it with its size, and ``offload clean`` removes it and
never the directory of a live process, a directory being made, or another
host's."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from offload.cli import main
from offload.errors import StorageError, UsageError
from offload.store import TieredStore, run_dirs

CHILD = """
import sys, time, torch
from offload.store import TieredStore
store = TieredStore(sys.argv[1])
store.put("x", torch.ones(300_000), "nvme")
store.flush()
print(store.run_dir, flush=True)
time.sleep(600)
"""


def _child(nvme) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, "-c", CHILD, str(nvme)], stdout=subprocess.PIPE, text=True)
    return proc, proc.stdout.readline().strip()


def test_clean_removes_what_a_killed_process_left_and_never_a_live_ones(tmp_path, capsys):
    dead, dead_dir = _child(tmp_path)
    dead.send_signal(signal.SIGKILL)
    dead.wait()
    alive, alive_dir = _child(tmp_path)
    try:
        assert os.path.isdir(dead_dir) and os.path.isdir(alive_dir)
        with pytest.warns(UserWarning, match=rf"1 run directory in {tmp_path} \(1\.\d MiB\) left by processes that "
                                             rf"are gone \({os.path.basename(dead_dir)}\); remove them with: "
                                             rf"offload clean --nvme-path"):
            store = TieredStore(str(tmp_path))
        assert main(["clean", "--nvme-path", str(tmp_path), "--dry-run"]) == 0
        assert os.path.isdir(dead_dir)
        assert main(["clean", "--nvme-path", str(tmp_path)]) == 0
        out = capsys.readouterr().out
        assert f"removed {dead_dir} (1.1 MiB; process {dead.pid}, gone)" in out
        assert "removed 1 run directory" in out
        # what it leaves is said, with why: silence read as "nothing there"
        assert f"kept {alive_dir} (" in out and f"; process {alive.pid} is alive)" in out
        assert f"kept {store.run_dir} (" in out and "; kept 2 whose owner may be alive" in out
        assert not os.path.exists(dead_dir) and os.path.isdir(alive_dir) and os.path.isdir(store.run_dir)
        store.close()
    finally:
        alive.kill()
        alive.wait()
    assert [s.path for s in run_dirs.remove_stale(str(tmp_path))[0]] == [alive_dir]  # now it is gone too
    assert os.listdir(tmp_path) == []


def test_a_directory_without_an_owner_is_stale_only_once_it_is_old(tmp_path):
    fresh, old = tmp_path / "offload-run-fresh", tmp_path / "offload-run-old"
    fresh.mkdir()
    old.mkdir()
    (old / "owner.json").write_text("{half a reco")  # unreadable: as good as none
    past = time.time() - 2 * run_dirs.OWNERLESS_GRACE_S
    os.utime(old, (past, past))
    found, kept = run_dirs.survey(str(tmp_path))
    assert [s.path for s in found] == [str(old)] and [s.path for s in kept] == [str(fresh)]
    assert "no owner recorded yet" in kept[0].why and "run offload clean again after that" in kept[0].why


def test_another_hosts_directory_is_never_stale(tmp_path):
    other = tmp_path / "offload-run-elsewhere"
    other.mkdir()
    (other / "owner.json").write_text(json.dumps({"host": "not-" + os.uname().nodename, "pid": 1, "started": 0}))
    past = time.time() - 2 * run_dirs.OWNERLESS_GRACE_S
    os.utime(other, (past, past))
    found, kept = run_dirs.survey(str(tmp_path))
    assert found == [] and kept[0].why == f"made on host not-{os.uname().nodename}, whose processes cannot be seen from here"


def test_an_owner_file_this_process_may_not_read_is_not_stale(tmp_path, monkeypatch):
    """Another user's run: its owner.json is 0600, so it cannot be read here,
    which says nothing about whether its owner is gone."""
    theirs = tmp_path / "offload-run-theirs"
    theirs.mkdir()
    (theirs / "owner.json").write_text("{}")
    past = time.time() - 2 * run_dirs.OWNERLESS_GRACE_S
    os.utime(theirs, (past, past))

    def refuse(path, *args, **kwargs):
        raise PermissionError(13, "Permission denied", path)

    monkeypatch.setattr(run_dirs, "open", refuse, raising=False)
    found, kept = run_dirs.survey(str(tmp_path))
    assert found == [] and kept[0].why == "its owner file cannot be read (Permission denied): another user's, maybe"


def test_clean_says_what_it_could_not_remove_and_fails(tmp_path, monkeypatch, capsys):
    left, removed = tmp_path / "offload-run-left", tmp_path / "offload-run-removed"
    for directory in (left, removed):
        directory.mkdir()
        (directory / "swap").write_bytes(b"x" * 4096)
        past = time.time() - 2 * run_dirs.OWNERLESS_GRACE_S
        os.utime(directory, (past, past))
    real = run_dirs.shutil.rmtree

    def refuse_one(path, *args, **kwargs):
        if path == str(left):
            raise PermissionError(13, "Permission denied", os.path.join(path, "swap"))
        real(path, *args, **kwargs)

    monkeypatch.setattr(run_dirs.shutil, "rmtree", refuse_one)
    assert main(["clean", "--nvme-path", str(tmp_path)]) == 1
    out, err = capsys.readouterr()
    assert f"removed {removed} " in out and f"removed {left} " not in out
    assert "removed 1 run directory" in out and "1 could not be removed" in out
    assert f"could not remove {left} " in err and f"{left}/swap: Permission denied" in err
    assert os.path.isdir(left) and not os.path.exists(removed)


def test_a_closed_store_leaves_nothing_and_a_reused_pid_is_not_its_owner(tmp_path):
    store = TieredStore(str(tmp_path))
    with open(os.path.join(store.run_dir, run_dirs.OWNER)) as f:
        owner = json.load(f)
    assert owner["pid"] == os.getpid() and run_dirs.stale(str(tmp_path)) == []
    owner["started"] -= 100  # the same pid, started at another time: another process
    with open(os.path.join(store.run_dir, run_dirs.OWNER), "w") as f:
        json.dump(owner, f)
    assert [s.why for s in run_dirs.stale(str(tmp_path))] == [f"process {os.getpid()}, gone"]
    store.close()
    assert os.listdir(tmp_path) == []


def test_a_directory_the_filesystem_refuses_to_write_is_named_with_the_fix(tmp_path, monkeypatch, capsys):
    """os.access lets root pass where a read-only or virtual filesystem then
    refuses (sysfs: EPERM); the store and the command line name nvme_path."""
    def refuse(**kwargs):
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(run_dirs.tempfile, "mkdtemp", refuse)
    with pytest.raises(UsageError, match=rf"nvme_path '{tmp_path}': cannot make a run directory there \(Operation "
                                         "not permitted\\); point nvme_path at a writable directory on a local disk"):
        TieredStore(nvme_path=str(tmp_path))
    assert main(["train", "--model", "tiny", "--steps", "1", "--nvme-path", str(tmp_path)]) == 2
    assert "cannot make a run directory there" in capsys.readouterr().err


def test_an_owner_file_that_cannot_be_written_is_named_and_leaves_no_directory(tmp_path, monkeypatch):
    def full_disk(fd, mode):
        os.close(fd)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(run_dirs.os, "fdopen", full_disk)
    with pytest.raises(StorageError, match=rf"nvme_path '{tmp_path}': cannot write {tmp_path}/offload-run-\w+/"
                                           r"owner\.json \(No space left on device\); free space on that disk"):
        TieredStore(nvme_path=str(tmp_path))
    assert os.listdir(tmp_path) == []
