"""Run by test_torchrun.py under `torchrun --nproc_per_node 2`: trains with the
engine on gloo (env:// rendezvous) and checks the result against AdamW."""

import os
import sys

import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from tests.zero.harness import config, make_model, max_difference, train_engine, train_reference  # noqa: E402

dist.init_process_group("gloo")
rank = dist.get_rank()
cfg = config(2, "nvme", 2, nvme_path=sys.argv[1])
ref = train_reference(make_model(), 5, dist.get_world_size(), 2, cfg)
with train_engine(make_model(), 5, 2, cfg, rank=rank) as engine:
    difference = max_difference(engine.state_dict(), ref)
print(f"rank {rank} of {dist.get_world_size()}: max difference {difference:.2e}", flush=True)
dist.destroy_process_group()
# os._exit skips interpreter teardown, where gloo's worker threads can abort the
# process (a known gloo issue); the engine is closed and the result printed.
os._exit(0 if difference < 1e-5 else 1)
