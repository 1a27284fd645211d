"""What the shared reduction order (Note [reduction order] in
offload/zero/grads.py) costs in bucket memory: stage 2 on two gloo ranks, the
peak bytes of gradient buckets held at once in a step, with the shared order
(the first step's, and the one learned from it) against reducing each bucket
as soon as it is complete (the order before it, wrong when ranks get
gradients for different parameters, kept here as the baseline).

    python benchmarks/reduction_order.py

Models: the bundled GPT (registration order matches backward's) and a small
Hugging Face Llama built from its config (each layer registers its norms
after its projections), at two bucket sizes each.
"""

from __future__ import annotations

import datetime
import json
import os
import socket
import sys
import tempfile

import torch
import torch.multiprocessing as mp


def _model(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if name == "llama":
        import transformers
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(
            hidden_size=128, intermediate_size=344, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=512))
    from offload.models.gpt import GPT, SIZES
    return GPT(SIZES[name])


def _loss(engine, name: str, rank: int) -> torch.Tensor:
    vocab, length = (512, 64) if name == "llama" else (engine.module.config.vocab_size, engine.module.config.block_size + 1)
    tokens = torch.randint(0, vocab, (2, length), generator=torch.Generator().manual_seed(rank))
    return engine(input_ids=tokens, labels=tokens).loss if name == "llama" else engine(tokens)


def _rank(rank: int, port: int, name: str, bucket: int, ordered: bool, out: str) -> None:
    import offload
    from offload.zero import grads
    if not ordered:
        init = grads.GradientReducer.__init__

        def on_completion(self, *args, **kwargs):
            init(self, *args, **{**kwargs, "ordered": False})

        grads.GradientReducer.__init__ = on_completion
    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                                         timeout=datetime.timedelta(seconds=120))
    engine = offload.initialize(_model(name), {
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": 2, "reduce_bucket_size": bucket, "offload_optimizer": {"device": "cpu"}}})
    peaks = []
    for _ in range(3):
        engine.reducer.peak_bucket_bytes = engine.reducer.bucket_bytes  # each step's own peak
        engine.backward(_loss(engine, name, rank))
        engine.step()
        peaks.append(engine.reducer.peak_bucket_bytes)
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"first": peaks[0], "after": max(peaks[1:]), "buckets": len(engine.layout.buckets),
                       "model": sum(p.numel() * p.element_size() for p in engine.module.parameters())}, f)
    engine.close(restore_model=False)
    torch.distributed.destroy_process_group()
    os._exit(0)  # gloo's threads can abort the interpreter's teardown ("terminate called without an active exception")


def measure(name: str, bucket: int, ordered: bool) -> dict:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "result.json")
        mp.spawn(_rank, args=(port, name, bucket, ordered, out), nprocs=2)
        with open(out) as f:
            return json.load(f)


def main() -> int:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    print("peak MB of gradient buckets held at once, per step: the shared order in the first step (last bucket "
          "first) and in steps 2-3 (learned from rank 0's first backward), against reducing on completion")
    print(f"{'model':8}{'bucket':>10}{'buckets':>9}{'model MB':>10}{'first step':>12}{'learned':>9}{'on completion':>15}"
          f"{'ratio':>7}")
    for name, buckets in (("25M", (500_000, 2_000_000)), ("llama", (20_000, 100_000))):
        for bucket in buckets:
            shared, baseline = measure(name, bucket, True), measure(name, bucket, False)
            print(f"{name:8}{bucket:>10,}{shared['buckets']:>9}{shared['model'] / 1e6:>10.1f}{shared['first'] / 1e6:>12.2f}"
                  f"{shared['after'] / 1e6:>9.2f}{baseline['after'] / 1e6:>15.2f}{shared['after'] / baseline['after']:>7.2f}",
                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
