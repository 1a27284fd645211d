"""Run by test_host_memory.py in a fresh process: trains a small GPT at stage 3
with weights and optimizer state on NVMe and prints, after every step, the
process's RSS and its live heap bytes (glibc's mallinfo2: in use, arena and
mmapped; -1 without glibc), as JSON."""

import json
import os
import sys

import psutil
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

import offload  # noqa: E402
from offload.models.gpt import GPT, GPTConfig  # noqa: E402
from offload.report import live_heap_bytes  # noqa: E402


nvme, steps = sys.argv[1], int(sys.argv[2])
BATCH, SEQ, VOCAB = 4, 128, 8192
torch.set_num_threads(1)
torch.manual_seed(0)
# A wide vocabulary: the embedding, its gradient and the logits are the
# multi-megabyte tensors whose churn fragments glibc's heap.
model = GPT(GPTConfig(n_layer=2, n_head=4, n_embd=128, block_size=SEQ, vocab_size=VOCAB))
config = {
    "train_micro_batch_size_per_gpu": BATCH,
    "gradient_clipping": 1.0,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
    "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": nvme},
                          "offload_param": {"device": "nvme", "nvme_path": nvme, "max_in_cpu": 0}},
}
process = psutil.Process()
rss, heap = [], []
generator = torch.Generator().manual_seed(1)
with offload.initialize(model, config) as engine:
    for _ in range(steps):
        engine.backward(engine(torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=generator)))
        engine.step()
        rss.append(process.memory_info().rss)
        heap.append(live_heap_bytes())
print(json.dumps({"rss": rss, "heap": heap}))
