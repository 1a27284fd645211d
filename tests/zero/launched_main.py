"""Run by test_torchrun.py under `torchrun --nproc_per_node 2`: offload.initialize
makes the process group; the program ends without leaving it."""

import atexit
import sys

import torch
import torch.distributed as dist

import offload

# Registered first, so it runs after offload's own exit hooks.
atexit.register(lambda: print(f"group left at exit: {not dist.is_initialized()}", flush=True))
engine = offload.initialize(torch.nn.Linear(4, 4), {"optimizer": {"type": "AdamW"}, "zero_optimization": {
    "stage": 2, "offload_optimizer": {"device": "nvme", "nvme_path": sys.argv[1]}}})
engine.backward(engine(torch.ones(2, 4)).sum())
engine.step()
engine.close()
print(f"rank {dist.get_rank()} of {dist.get_world_size()} trained", flush=True)
