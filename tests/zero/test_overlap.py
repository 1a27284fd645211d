"""The overlapped step (Note [overlapped step]): sub-groups stepped during the
last backward, kept when the plain step would have computed them alike and
rolled back otherwise, so the training is bitwise the plain one in every case:
clipping that binds or not, accumulation, fp16 overflow, a learning rate set
after backward, stages 2 and 3, cpu and nvme, world sizes 1 and 2."""

import concurrent.futures
import itertools
import os
import sys
import threading
import time
import warnings

import pytest
import torch

import offload
from offload import _native
from offload.optim.grad_stats import sum_squares
from offload.zero import overlap
from offload.zero.grads import GradientReducer

from .harness import (TinyLM, batch, config, finish_rank, init_gloo, let_the_worker_finish, make_model,
                      max_difference, spawn_ranks, train_reference)

pytestmark = [pytest.mark.skipif(not _native.status().available, reason="native library not built"),
              pytest.mark.usefixtures("worker_finishes_its_queue")]  # these tests count what the worker stepped

STEPS = 6
CASES = list(itertools.product([2, 3], ["cpu", "nvme"], [1, 2], [0.5, 1e6]))  # stage, tier, accumulation, clip


def _config(tmp_path, stage, device, accumulation, clip, overlap_step, **extra):
    cfg = config(stage, device, accumulation, str(tmp_path), param_device="cpu" if stage == 3 else None,
                 offload_optimizer={"overlap_step": overlap_step, "buffer_count": 6}, **extra)
    cfg["gradient_clipping"] = clip
    cfg["zero_optimization"]["sub_group_size"] = 300  # a dozen sub-groups: some complete early in backward
    return cfg


def _train(cfg, accumulation, rank=0, lr_after_backward=None):
    engine = offload.initialize(make_model(), cfg)
    for step in range(STEPS):
        for micro in range(accumulation):
            engine.backward(engine(batch(step, micro, rank)))
            if lr_after_backward is not None and micro == accumulation - 1:
                engine.lr = lr_after_backward(step)
            engine.step()
    return engine


@pytest.mark.parametrize("stage,device,accumulation,clip", CASES)
def test_bitwise_the_plain_step(tmp_path, stage, device, accumulation, clip):
    plain = _train(_config(tmp_path, stage, device, accumulation, clip, False), accumulation)
    over = _train(_config(tmp_path, stage, device, accumulation, clip, True), accumulation)
    expected, state = plain.state_dict(), over.state_dict()
    assert all(torch.equal(state[k], expected[k]) for k in expected)
    ref = train_reference(make_model(), STEPS, 1, accumulation, _config(tmp_path, stage, device, accumulation, clip, False))
    assert max_difference(state, ref) < 1e-5
    step = over.update
    binds = clip < 1.0  # TinyLM's gradient norm is about 2-6
    assert step.speculated_steps == STEPS
    if binds:
        assert step.rollbacks == STEPS and step.kept == 0
    else:
        assert step.rollbacks == 0 and step.kept >= STEPS * 3  # several sub-groups a step ran during backward
    plain.close()
    over.close()


@pytest.mark.parametrize("stage,device,overlap_step", [(2, "cpu", False), (2, "cpu", True), (2, "nvme", True),
                                                       (3, "nvme", True)])
@pytest.mark.parametrize("clip", [0.5, 1e6])  # binds (the speculated steps roll back) or not (they are kept)
def test_a_second_backward_before_step_adds_to_the_window(tmp_path, stage, device, overlap_step, clip):
    """Two losses, each given to backward, then one step (at accumulation 1):
    the step applies the sum of their gradients, as DeepSpeed's and as
    backward twice with torch's AdamW. The overlapped step had speculated on
    the first backward's gradient alone (and on nvme its worker was still in
    the store when the second began)."""
    cfg = _config(tmp_path, stage, device, 1, clip, overlap_step)
    ref = make_model()
    p = cfg["optimizer"]["params"]
    adamw = torch.optim.AdamW(ref.parameters(), lr=p["lr"], betas=p["betas"], eps=p["eps"],
                              weight_decay=p["weight_decay"], foreach=False)
    with offload.initialize(make_model(), cfg) as engine:
        for step in range(STEPS):
            for micro in range(2):
                engine.backward(engine(batch(step, micro, 0)))
                ref(batch(step, micro, 0)).backward()
            engine.step()
            torch.nn.utils.clip_grad_norm_(ref.parameters(), cfg["gradient_clipping"])
            adamw.step()
            adamw.zero_grad()
        assert engine.applied_steps == STEPS
        assert max_difference(engine.state_dict(), ref) < 1e-5


@pytest.mark.parametrize("device", ["cpu", "nvme"])  # the old state copied, or kept in its swap file
def test_an_overflow_or_a_late_learning_rate_rolls_back(tmp_path, device):
    fp16 = {"fp16": {"enabled": True, "initial_scale_power": 8, "hysteresis": 1}}

    def run(overlap_step):
        engine = offload.initialize(make_model(), _config(tmp_path, 2, device, 1, 1e6, overlap_step, **fp16))
        for step in range(STEPS):
            loss = engine(batch(step, 0, 0))
            engine.backward(loss * float("inf") if step == 2 else loss)  # step 2 overflows
            if step == 4:
                engine.lr = 1e-3  # set after backward: the speculated steps used the old rate
            engine.step()
        return engine

    plain, over = run(False), run(True)
    expected, state = plain.state_dict(), over.state_dict()
    assert all(torch.equal(state[k], expected[k]) for k in expected)
    assert over.skipped_steps == plain.skipped_steps == 1
    assert over.update.rollbacks == 2
    plain.close()
    over.close()


@pytest.mark.parametrize("device", ["cpu", "nvme"])
def test_a_state_dict_between_backward_and_step_sees_the_state_before_the_step(tmp_path, device):
    """Reading the weights mid-window undoes the speculation: the reader sees
    the state the plain engine has then, and the step is still the plain one."""
    engines = [offload.initialize(make_model(), _config(tmp_path, 2, device, 1, 1e6, overlap_step))
               for overlap_step in (False, True)]
    for step in range(3):
        middles = []
        for engine in engines:
            engine.backward(engine(batch(step, 0, 0)))
            middles.append(engine.state_dict())
            engine.step()
        assert all(torch.equal(middles[1][k], middles[0][k]) for k in middles[0])
    plain, over = (engine.state_dict() for engine in engines)
    assert all(torch.equal(over[k], plain[k]) for k in plain)
    assert engines[1].update.rollbacks == 3
    for engine in engines:
        engine.close()


@pytest.mark.parametrize("device", ["cpu", "nvme"])
def test_a_worker_error_rolls_back_what_the_others_speculated(tmp_path, monkeypatch, device):
    """One sub-group's step fails on the worker (its read, say) after others
    were stepped: step() raises it with nothing kept, so the next steps are
    those of a plain engine whose step failed before touching anything."""
    let_the_worker_finish(monkeypatch.setattr)  # else step() may take back every sub-group before the worker fails
    engines = [offload.initialize(make_model(), _config(tmp_path, 2, device, 1, 1e6, overlap_step))
               for overlap_step in (False, True)]
    plain, over = engines
    speculate, apply = over.optimizer.speculate, plain.update.apply
    calls = []

    def failing_read(i, *args):
        calls.append(i)
        if len(calls) == 1:  # the first the worker takes: the others follow it
            raise OSError(f"sub-group {i}: read failed")
        return speculate(i, *args)

    def failing_step(*args):
        raise OSError("the step failed before it began")

    for step in range(5):
        if step == 2:  # before the backward: the worker speculates while it runs
            over.optimizer.speculate, plain.update.apply = failing_read, failing_step
        for engine in engines:
            engine.backward(engine(batch(step, 0, 0)))
        if step == 2:
            for engine, message in ((over, r"sub-group \d+: read failed"), (plain, "before it began")):
                with pytest.raises(OSError, match=message):
                    engine.step()
            assert len(calls) > 1  # others were stepped, and must not stand
            over.optimizer.speculate, plain.update.apply = speculate, apply
            continue  # the next backward adds to the gradient the failed step left
        for engine in engines:
            engine.step()
    a, b = plain.state_dict(), over.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert over.update.kept > 0
    for engine in engines:
        engine.close()


@pytest.mark.parametrize("device", ["cpu", "nvme"])
def test_a_report_between_backward_and_step_keeps_the_speculation(tmp_path, device):
    """A report only reads counters: the worker is waited for, but what it
    stepped stands, and the step is still bitwise the plain one."""
    engines = [offload.initialize(make_model(), _config(tmp_path, 2, device, 1, 1e6, overlap_step))
               for overlap_step in (False, True)]
    for step in range(3):
        for engine in engines:
            engine.backward(engine(batch(step, 0, 0)))
            engine.memory_report()
            engine.disk_traffic()
            engine.step()
    plain, over = (engine.state_dict() for engine in engines)
    assert all(torch.equal(over[k], plain[k]) for k in plain)
    assert engines[1].update.rollbacks == 0 and engines[1].update.kept >= 3 * 3
    for engine in engines:
        engine.close()


def test_frequent_rollbacks_stop_speculation_once_said(tmp_path, monkeypatch):
    monkeypatch.setattr(overlap, "WINDOW", 4)
    monkeypatch.setattr(overlap, "RETRY_EVERY", 3)
    cfg = _config(tmp_path, 2, "cpu", 1, 0.5, True)  # clipping binds on every step
    with pytest.warns(UserWarning, match="overlap_step rolled back most of the last 4 steps") as caught:
        engine = _train(cfg, 1)
        for step in range(STEPS, 3 * STEPS):
            engine.backward(engine(batch(step, 0, 0)))
            engine.step()
    assert len([w for w in caught if "rolled back" in str(w.message)]) == 1
    # Four speculated steps, then one try every third step (steps 6, 9, 12, 15): eight in all.
    assert engine.update.speculated_steps == engine.update.rollbacks == 8
    engine.close()


def _nice_of_threads() -> dict[int, int]:
    """Every thread of this process -> its nice value (field 19 of /proc's stat)."""
    nices = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                nices[int(tid)] = int(f.read().rsplit(")", 1)[1].split()[16])
        except FileNotFoundError:  # it ended since the listing (a collected engine's worker)
            continue
    return nices


@pytest.mark.skipif(sys.platform != "linux", reason="per-thread priorities are Linux's")
def test_the_worker_and_its_adam_threads_run_below_backward(tmp_path):
    """Note [worker priority]: the worker, and the OpenMP threads it starts for
    the CPU Adam, run WORKER_NICE below the thread that computes backward."""
    base = os.getpriority(os.PRIO_PROCESS, 0)
    engine = _train(_config(tmp_path, 2, "cpu", 1, 1e6, True), 1)
    assert engine.update.kept >= STEPS * 3  # the worker stepped sub-groups
    (worker,) = engine.update._worker._threads
    lowered = min(19, base + overlap.WORKER_NICE)
    nices = _nice_of_threads()
    assert nices[worker.native_id] == lowered
    assert nices[threading.get_native_id()] == base
    # A pass large enough for a team of two, started on the worker: its OpenMP thread inherits the worker's nice.
    engine.update._worker.submit(sum_squares, torch.ones(1 << 22), 2).result()
    started_there = {tid: nice for tid, nice in _nice_of_threads().items() if tid not in nices}
    assert len(started_there) >= 1 and set(started_there.values()) == {lowered}, started_there
    engine.close()


# At accumulation 2 the held worker's sub-groups must not keep the staging buffers backward's later parts
# need (Note [landing off backward's thread]): under the simulated device, backward would wait out the hold.
@pytest.mark.parametrize("stage,device,accumulation", [(2, "cpu", 1), (2, "nvme", 1), (3, "nvme", 1), (2, "cpu", 2)])
@pytest.mark.parametrize("clip", [0.5, 1e6])
def test_step_takes_back_what_the_worker_has_not_started(tmp_path, monkeypatch, stage, device, accumulation, clip):
    """Note [what the worker has not started]: the worker starts the first
    sub-group of each backward, and is held there until the step has taken
    back the others, so that one alone is speculated; the step is still
    bitwise the plain one."""
    monkeypatch.undo()  # the module's worker_finishes_its_queue: not here
    take, join, held_for = overlap.OverlappedStep._take, overlap.OverlappedStep._join, []

    def held(self, i, mark, bases):
        tasks = self._tasks
        if not any(t is tasks for t in held_for):  # this backward's first sub-group
            held_for.append(tasks)
            deadline = time.monotonic() + 5
            while not (len(tasks) > 1 and all(task.cancelled() for task, _ in tasks[1:])) \
                    and time.monotonic() < deadline:
                time.sleep(0.001)
        take(self, i, mark, bases)

    def once_started(self):
        tasks = self._tasks
        while tasks and not any(t is tasks for t in held_for):
            time.sleep(0.001)
        join(self)

    monkeypatch.setattr(overlap.OverlappedStep, "_take", held)
    monkeypatch.setattr(overlap.OverlappedStep, "_join", once_started)
    plain = _train(_config(tmp_path, stage, device, accumulation, clip, False), accumulation)
    over = _train(_config(tmp_path, stage, device, accumulation, clip, True), accumulation)
    expected, state = plain.state_dict(), over.state_dict()
    assert all(torch.equal(state[k], expected[k]) for k in expected)
    ref = train_reference(make_model(), STEPS, 1, accumulation,
                          _config(tmp_path, stage, device, accumulation, clip, False))
    assert max_difference(state, ref) < 1e-5
    assert len(held_for) == STEPS
    if clip < 1.0:
        assert over.update.rollbacks == STEPS and over.update.kept == 0
    else:
        assert over.update.rollbacks == 0 and over.update.kept == STEPS
    plain.close()
    over.close()


class _Reentrant(TinyLM):
    """blocks[0] runs in two reentrant checkpointed segments: its weights get
    their gradient twice in one backward, so their bucket is reduced twice."""

    def _block(self, block: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        return x + torch.utils.checkpoint.checkpoint(block, x, use_reentrant=True)


@pytest.mark.parametrize("stage,device", [(2, "cpu"), (2, "nvme"), (3, "cpu")])
@pytest.mark.parametrize("clip", [0.5, 1e6])
def test_a_gradient_that_comes_twice_rolls_back_to_the_plain_step(tmp_path, monkeypatch, stage, device, clip):
    """Note [a gradient that comes twice]. Each reduction first waits for the
    worker to finish what it was given, so a sub-group taken before its
    second part arrives would be summed and stepped without it."""
    engines = []
    real = GradientReducer._reduce

    def after_the_worker(self, bucket, full):
        if engines and isinstance(engines[-1].update, overlap.OverlappedStep):
            concurrent.futures.wait([task for task, _ in engines[-1].update._tasks])
        real(self, bucket, full)

    monkeypatch.setattr(GradientReducer, "_reduce", after_the_worker)
    results = []
    for overlap_step in (False, True):
        torch.manual_seed(0)
        engines.append(offload.initialize(_Reentrant(), _config(tmp_path, stage, device, 1, clip, overlap_step)))
        for step in range(STEPS):
            engines[-1].backward(engines[-1](batch(step, 0, 0)))
            engines[-1].step()
        results.append(engines[-1].state_dict())
    torch.manual_seed(0)
    ref = train_reference(_Reentrant(), STEPS, 1, 1, _config(tmp_path, stage, device, 1, clip, False))
    assert all(torch.equal(results[1][k], results[0][k]) for k in results[0])
    assert max_difference(results[1], ref) < 1e-5
    assert engines[1].update.rollbacks == STEPS and engines[1].update.kept == 0
    for engine in engines:
        engine.close()


def _world2_worker(rank: int, port: int, out_dir: str) -> None:
    init_gloo(rank, 2, port)
    let_the_worker_finish()
    results = {}
    for stage, device, clip in [(2, "nvme", 1e6), (3, "cpu", 0.5), (3, "nvme", 1e6)]:
        nvme = os.path.join(out_dir, f"nvme{rank}")
        os.makedirs(nvme, exist_ok=True)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            plain = _train(_config(nvme, stage, device, 2, clip, False), 2, rank)
            over = _train(_config(nvme, stage, device, 2, clip, True), 2, rank)
        a, b = plain.state_dict(), over.state_dict()
        ref = train_reference(make_model(), STEPS, 2, 2, _config(nvme, stage, device, 2, clip, False))
        results[f"{stage}-{device}-{clip}"] = [all(torch.equal(a[k], b[k]) for k in a), max_difference(b, ref),
                                               over.update.kept, over.update.rollbacks]
        plain.close()
        over.close()
    finish_rank(out_dir, rank, results)


def test_world_size_2(tmp_path):
    for rank, results in enumerate(spawn_ranks(_world2_worker, tmp_path)):
        for name, (bitwise, difference, kept, rollbacks) in results.items():
            assert bitwise and difference < 1e-5, (rank, name, difference)
            assert (rollbacks == STEPS) if name.endswith("0.5") else (kept > 0 and rollbacks == 0), (rank, name)


def test_a_second_backward_before_step_adds_to_the_window_under_the_delayed_update(tmp_path):
    """The delayed update's step of the last window runs during this one's
    backwards: two backwards then a step (accumulation 1) are, bitwise, a
    window of two undivided backwards (accumulation 2)."""
    def train(accumulation):
        cfg = config(2, "cpu", accumulation, offload_optimizer={"delayed_update": True, "delayed_update_warmup": 1})
        with offload.initialize(make_model(), cfg) as engine:
            for step in range(STEPS):
                for micro in range(2):
                    engine.backward(engine(batch(step, micro, 0)), scale_wrt_gas=False)
                engine.step()
            return engine.state_dict()

    twice, window = train(1), train(2)
    assert all(torch.equal(twice[k], window[k]) for k in window)
