"""One rank of a 2-rank gloo run for test_dying_rank.py, launched by hand (not
torchrun, which would stop the survivor itself). Trains a small model at stage
2 with the optimizer state on NVMe, saves checkpoint ``complete``, then goes on
stepping and saving. Rank 1 meets its end on its own schedule:

    kill-step   SIGKILL inside its 3rd optimizer step after the checkpoint
    kill-save   SIGKILL inside its 2nd save after the checkpoint, files half written
    stall       SIGSTOP inside its 3rd step: alive, but answering nobody

Rank 0, the survivor, prints one line for an OffloadError and exits with its
status; its engine is closed on the way out, and the interpreter's teardown
skipped.

    python dying_rank_main.py OUT RANK PORT MODE
"""

import os
import signal
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

import offload  # noqa: E402
from offload.checkpoint import save_load  # noqa: E402

out, rank, port, mode = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
torch.manual_seed(0)
model = torch.nn.Sequential(*[torch.nn.Linear(32, 32) for _ in range(4)])
nvme = os.path.join(out, f"nvme{rank}")
os.makedirs(nvme, exist_ok=True)
config = {"comm_timeout_s": 8, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "nvme", "nvme_path": nvme}}}


def doom(after: int, how: int):
    """A wrapper that sends ``how`` to this process on its ``after``-th call."""
    calls = [0]

    def wrap(original):
        def wrapped(*args, **kwargs):
            calls[0] += 1
            if calls[0] == after:
                os.kill(os.getpid(), how)
            return original(*args, **kwargs)
        return wrapped
    return wrap


try:
    with offload.initialize(model, config) as engine:
        def step(i):
            engine.backward(engine(torch.randn(8, 32, generator=torch.Generator().manual_seed(100 * i + rank))).square().mean())
            engine.step()

        for i in range(3):
            step(i)
        engine.save_checkpoint(os.path.join(out, "ckpt"), "complete")
        if rank == 1 and mode in ("kill-step", "stall"):
            engine.optimizer.step_shard = doom(3, signal.SIGKILL if mode == "kill-step" else signal.SIGSTOP)(
                engine.optimizer.step_shard)
        if rank == 1 and mode == "kill-save":
            save_load._write_rank = doom(2, signal.SIGKILL)(save_load._write_rank)
        print("ready", flush=True)
        started = time.monotonic()
        for i in range(3, 1000):
            step(i)
            engine.save_checkpoint(os.path.join(out, "ckpt"), f"s{i}")
except offload.OffloadError as e:
    print(f"{e} (after {time.monotonic() - started:.1f} s)", file=sys.stderr, flush=True)
    # The engine is closed; the interpreter's teardown is skipped, as harness.finish_rank
    # does: gloo's threads, their peer gone, occasionally abort it.
    os._exit(e.exit_status)
