"""The shard optimizer's NVMe pipeline: reading ahead (pipeline_read) and
writing back behind (pipeline_write) change when the disk works, never what
the step computes."""

import itertools

import pytest
import torch

import offload
from offload import _native
from offload.models.gpt import GPT, SIZES
from offload.store.aio import WRITE
from offload.zero.optimizer import StoreOptimizer

from .harness import batch, config, make_model, train_engine

pytestmark = pytest.mark.skipif(not _native.status().available, reason="native library not built")

STEPS = 4


def _train(tmp_path, read: bool, write: bool):
    cfg = config(2, "nvme", 2, str(tmp_path), offload_optimizer={"pipeline_read": read, "pipeline_write": write})
    cfg["zero_optimization"]["sub_group_size"] = 300
    cfg["zero_optimization"]["offload_optimizer"]["buffer_count"] = 8  # room to read ahead while write-backs lag
    engine = train_engine(make_model(), 1, 2, cfg)  # a first step, then count
    store = engine.optimizer.store
    flushes = []
    real_flush = store.flush
    store.flush = lambda: (flushes.append(1), real_flush())[1]
    before = dict(store.stats()["io"])
    for step in range(1, STEPS):
        for micro in range(2):
            engine.backward(engine(batch(step, micro, 0)))
            engine.step()
    io = store.stats()["io"]
    counts = {k: io[k] - before[k] for k in ("reads", "demand_reads", "prefetch_skipped")}
    counts["flushes"] = len(flushes)
    state = engine.state_dict()
    engine.close()
    return state, counts, len(engine.optimizer.groups)


def test_pipelining_changes_when_not_what(tmp_path):
    results = {(r, w): _train(tmp_path, r, w) for r, w in itertools.product([True, False], repeat=2)}
    state, _, groups = results[(True, True)]
    assert groups >= 10  # enough sub-groups for a pipeline
    for key, (other, counts, _) in results.items():
        assert all(torch.equal(state[k], other[k]) for k in state), key  # bitwise the same training
    steps = STEPS - 1
    for write in (True, False):
        _, on, _ = results[(True, write)]
        _, off, _ = results[(False, write)]
        assert off["demand_reads"] == off["reads"] == steps * groups  # every read waited for in full
        # Read ahead, so in flight when needed; a prefetch finding every buffer held
        # by write-backs still in flight is skipped (the disk sets the pace, so how
        # often depends on its speed), and only then is the sub-group read on demand.
        assert on["reads"] == steps * groups and on["demand_reads"] < off["demand_reads"]
        assert on["demand_reads"] <= on["prefetch_skipped"]
    for read in (True, False):
        assert results[(read, False)][1]["flushes"] == steps * groups  # each write-back waited for before the next
        assert results[(read, True)][1]["flushes"] == 0


@pytest.mark.parametrize("overlap_step", [False, True], ids=["plain", "overlap_step"])
@pytest.mark.usefixtures("worker_finishes_its_queue")  # counts what the worker stepped
def test_every_write_back_of_a_step_brings_its_adam_pass_crcs(tmp_path, overlap_step):
    """Note [checksums in the Adam pass]: a stepped sub-group's state is not
    read once more to checksum it, whether its step ran in step() or during
    backward (kept), and every byte of it was checksummed in the pass."""
    cfg = config(2, "nvme", 2, str(tmp_path), offload_optimizer={"overlap_step": overlap_step, "buffer_count": 6})
    cfg["gradient_clipping"] = 1e6  # never binds: the speculated steps are kept
    cfg["zero_optimization"]["sub_group_size"] = 300
    engine = train_engine(make_model(), 1, 2, cfg)
    store = engine.optimizer.store
    writes = []
    real_submit = store.engine.submit

    def submit(op, file, header, data, nbytes, chunk_crcs=None):
        if op == WRITE:
            writes.append(chunk_crcs is not None)
        return real_submit(op, file, header, data, nbytes, chunk_crcs)

    store.engine.submit = submit
    from_memory = _native.lib().offload_checksum_from_memory_bytes()
    for step in range(1, STEPS):
        for micro in range(2):
            engine.backward(engine(batch(step, micro, 0)))
            engine.step()
    engine.optimizer.flush()
    for key in store.keys():  # the last step's write-backs read back verified
        store.get([key])
        store.release([key])
    kept = engine.update.kept if overlap_step else 0
    engine.close()
    assert len(writes) == (STEPS - 1) * len(engine.optimizer.groups) and all(writes)
    assert _native.lib().offload_checksum_from_memory_bytes() == from_memory
    assert (kept >= 3 * (STEPS - 1)) == overlap_step  # several sub-groups a step were stepped during backward


@pytest.mark.parametrize("stage,meta", [(2, False), (3, False), (3, True)], ids=["stage2", "stage3", "stage3-meta"])
def test_set_up_writes_each_sub_group_once_and_reads_only_to_return(tmp_path, monkeypatch, stage, meta):
    """Note [one write per sub-group at set-up]: before the first step the state
    crosses the disk once, as master weights beside zero moments. A model built
    under offload.init hands its tied embedding over last: each return to a
    sub-group already written costs one read and one more write, no more."""
    cfg = config(stage, "nvme", 1, str(tmp_path), param_device="cpu" if stage == 3 else None)
    cfg["zero_optimization"]["sub_group_size"] = 5000 if meta else 300
    opened = []
    real_write_master = StoreOptimizer.write_master

    def write_master(self, lo, hi, values):
        opened.extend(i for i, *_ in self.groups.meeting(lo, hi) if not opened or opened[-1] != i)
        real_write_master(self, lo, hi, values)

    monkeypatch.setattr(StoreOptimizer, "write_master", write_master)
    if meta:
        with offload.init(cfg):
            model = GPT(SIZES["tiny"])
        engine = offload.initialize(model, cfg, init_fn=model.init_module)
    else:
        model = make_model()
        initial = torch.cat([p.detach().flatten() for p in model.parameters()]).sort().values
        engine = offload.initialize(model, cfg)
    optimizer = engine.optimizer
    optimizer.flush()
    stats = optimizer.store.stats()
    groups = len(optimizer.groups)
    returns = len(opened) - len(set(opened))
    assert groups >= 10 and (returns > 0) == meta  # the meta build does return, the eager ones do not
    assert (stats["io"]["reads"], stats["io"]["writes"]) == (returns, groups + returns)
    state = torch.cat([chunk.clone() for _, _, chunk in optimizer.state_chunks(engine.weights)], dim=1)
    engine.close()
    assert not state[1:].any()
    if not meta:
        assert stats["io"]["bytes_written"] == stats["nvme"]["bytes"]  # headers and padding included
        padding = torch.zeros(state.shape[1] - initial.numel())  # the layout aligns buckets
        assert torch.equal(state[0].sort().values, torch.cat([initial, padding]).sort().values)  # world 1 owns it all
