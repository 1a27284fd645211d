"""The owned gradient (Note [owned gradient dtype]): kept in the compute dtype
when each element receives one reduced part per step, so the native Adam reads
bf16 directly, with bitwise the same training as an fp32 copy; fp32 when
micro-batches are summed."""

import threading

import pytest
import torch

import offload
from offload import _native
from offload.store import AioSettings, PinnedPool
from offload.zero import optimizer as optimizer_module
from offload.zero import owned_grad
from offload.zero.landing import Lander
from offload.zero.layout import SubGroups
from offload.zero.owned_grad import OnDiskGradient
from offload.zero.transfer import SIMULATE_ENV, Transfer

from .harness import batch, config, make_model, max_difference, train_engine, train_reference

pytestmark = pytest.mark.skipif(not _native.status().available, reason="native library not built")


def _run(monkeypatch, cfg: dict, accumulation: int, force_fp32: bool):
    if force_fp32:
        monkeypatch.setattr(offload.engine, "gradient_dtype", lambda *args: torch.float32)
    fed = set()
    real = optimizer_module.adam_step

    def spy(param, grad, *args, **kwargs):
        fed.add(grad.dtype)
        return real(param, grad, *args, **kwargs)

    monkeypatch.setattr(optimizer_module, "adam_step", spy)
    with train_engine(make_model(), 6, accumulation, cfg) as engine:
        state, dtype = engine.state_dict(), engine.gradient.dtype
    monkeypatch.undo()
    return state, dtype, fed


@pytest.mark.parametrize("stage,on_disk", [(1, False), (2, False), (2, True), (3, False)])
def test_a_bf16_owned_gradient_trains_bitwise_like_an_fp32_one(tmp_path, monkeypatch, stage, on_disk):
    cfg = config(stage, "nvme" if on_disk else "cpu", 1, str(tmp_path), bf16={"enabled": True},
                 param_device="cpu" if stage == 3 else None,
                 offload_optimizer={"gradients_on_nvme": True} if on_disk else {})
    compact, dtype, fed = _run(monkeypatch, cfg, 1, force_fp32=False)
    wide, wide_dtype, wide_fed = _run(monkeypatch, cfg, 1, force_fp32=True)
    assert dtype == torch.bfloat16 and fed == {torch.bfloat16}  # the kernel read bf16 gradients
    assert wide_dtype == torch.float32 and wide_fed == {torch.float32}
    assert all(torch.equal(compact[k], wide[k]) for k in compact)


def test_summed_micro_batches_stay_fp32():
    assert owned_grad.gradient_dtype(torch.bfloat16, 2, 4) == torch.float32
    assert owned_grad.gradient_dtype(torch.bfloat16, 1, 4) == torch.bfloat16  # stage 1 sums in its buckets, reduces once
    assert owned_grad.gradient_dtype(torch.float16, 3, 1) == torch.float16


@pytest.mark.parametrize("accumulation", [1, 2])
def test_clipping_reads_nothing_more_from_a_gradient_on_disk(tmp_path, accumulation):
    """The gradient's sum of squares is taken as each sub-group is written back,
    so a step with clipping reads the same bytes as one without (a separate
    pass read the whole fp32 gradient again: 12.9 GB a step at 3.23B). That
    the norm and the training are unchanged, test_equivalence.py shows."""
    reads = []
    for clip in (0.5, 0.0):
        cfg = config(2, "nvme", accumulation, str(tmp_path), gradient_clipping=clip,
                     offload_optimizer={"gradients_on_nvme": True, "buffer_count": 2})
        with train_engine(make_model(), 3, accumulation, cfg) as engine:
            assert len(engine.optimizer.groups) > 4  # more sub-groups than the pool holds
            before = engine.disk_traffic()
            for micro in range(accumulation):
                engine.backward(engine(batch(9, micro, 0)))
                engine.step()
            after = engine.disk_traffic()
            # A sub-group whose write-back is still in flight when needed is taken
            # from its buffer, not read (bytes_kept): which ones, the disk's pace decides.
            reads.append(after.bytes_read + after.bytes_kept - before.bytes_read - before.bytes_kept)
    assert reads[0] == reads[1]  # the read pass was 32 KiB


def test_a_gradient_on_disk_writes_each_sub_group_once_when_parts_come_low_before_high(tmp_path):
    """Sub-groups of 100: a part over three of them (a weight's gradient), then
    one just above it (its bias's, after it), then lower ones. Each sub-group
    is written back once, nothing is read back, and the sums are exact."""
    groups = SubGroups.of(400, 100)
    gradient = OnDiskGradient(groups, torch.float32, str(tmp_path), AioSettings(block_size=4096, queue_depth=4), 2,
                              Transfer(torch.device("cpu"), PinnedPool(1 << 16, "staging", False)))
    before = (gradient.store.traffic.reads, gradient.store.traffic.writes)  # construction wrote zeros
    parts = [(150, 350), (350, 360), (100, 150), (0, 100)]
    expected = torch.zeros(400)
    for k, (lo, hi) in enumerate(parts):
        values = torch.arange(lo, hi, dtype=torch.float32) * (k + 1)
        gradient.add(lo, hi, values)
        expected[lo:hi] += values
    squares, finite = gradient.stats()
    traffic = (gradient.store.traffic.reads - before[0], gradient.store.traffic.writes - before[1])
    assert traffic == (0, 4)  # one sub-group open at a time, or none written back on completion: 5-6 writes, and reads
    assert finite and squares == sum(expected[lo:hi].double().square().sum().item() for lo, hi in groups)
    for i, (lo, hi) in enumerate(groups):
        assert torch.equal(gradient.read(i), expected[lo:hi])
        gradient.done(i)
    gradient.close()


@pytest.mark.parametrize("simulated", [True, False])
def test_parts_land_off_the_thread_that_runs_backward(tmp_path, monkeypatch, simulated):
    """Note [landing off backward's thread]: with an asynchronous accelerator,
    the later micro-batches' parts are added in on the landing thread, never
    on the thread that runs backward's hooks; with the CPU as the accelerator,
    at once where they are sent. Either way training matches AdamW."""
    monkeypatch.setenv(SIMULATE_ENV, "1" if simulated else "0")
    added_on = []
    real = Lander._land

    def spy(self, pending, add_into):
        if add_into is not None:
            added_on.append(threading.current_thread().name)
        real(self, pending, add_into)

    monkeypatch.setattr(Lander, "_land", spy)
    cfg = config(2, "cpu", 2, str(tmp_path))
    with train_engine(make_model(), 3, 2, cfg) as engine:
        state = engine.state_dict()
    assert set(added_on) == ({"offload-landing"} if simulated else {threading.current_thread().name})
    assert len(added_on) == 3 * len(engine.layout.buckets)  # each step's second micro-batch, every bucket
    assert max_difference(state, train_reference(make_model(), 3, 1, 2, cfg)) < 1e-5
