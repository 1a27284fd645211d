"""An engine dropped without close() (a notebook cell run again) is garbage
collected with its model: its threads end and its swap files go (Note [hooks
on tensors hold weakly]). Its parameters' gradient hooks, kept by torch where
the collector cannot see them, used to hold it for the life of the process:
each run again kept a worker thread, 62 open files and 64 swap files."""

import gc
import os
import threading
import time
import weakref

import pytest

from offload import _native

from .harness import config, make_model, train_engine

pytestmark = pytest.mark.skipif(not _native.status().available, reason="native library not built")


def _settled(count, expected: int) -> int:
    """``count()`` once it reaches ``expected`` (a worker thread ends when it
    next looks at its queue), or what it is after 10 s."""
    deadline = time.monotonic() + 10
    while count() != expected and time.monotonic() < deadline:
        time.sleep(0.01)
    return count()


@pytest.mark.parametrize("stage", [2, 3])
def test_an_engine_dropped_without_close_is_collected_with_its_threads_and_swap_files(tmp_path, stage):
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    cfg = config(stage, "nvme", 1, str(nvme), param_device="nvme" if stage == 3 else None,
                 offload_optimizer={"overlap_step": True})
    threads, files = threading.active_count(), len(os.listdir("/proc/self/fd"))
    for _ in range(3):
        engine = train_engine(make_model(), 2, 1, cfg)
        assert any(os.scandir(nvme))  # its run directory, holding swap files
        dropped = weakref.ref(engine)
        del engine
        gc.collect()
        assert dropped() is None
    assert _settled(threading.active_count, threads) == threads
    assert len(os.listdir("/proc/self/fd")) == files
    assert os.listdir(nvme) == []
