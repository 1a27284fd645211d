"""Where a LoRA's weights live: the accelerator-resident weight bytes of a
Hugging Face GPT-2 under a PEFT LoRA, at stage 2 (every rank holds the frozen
base whole) against stage 3 (the base is paged like any weight, one module
at a time), measured in the same run, with the losses of both.

    python benchmarks/lora_memory.py --layers 12 --width 768 --nvme-path /work/scratch

Needs transformers and peft (the [hf] extra). Prints, for each stage, the
memory report's accelerator bytes (peak) by line, their sum, and the ratio of
stage 3's to stage 2's; the adapter trains in both (the losses must agree).
"""

from __future__ import annotations

import argparse
import tempfile

import peft
import torch
import transformers

import offload


def lora_gpt2(layers: int, width: int) -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=layers, n_embd=width, n_head=max(1, width // 64), n_positions=256)
    model = transformers.GPT2LMHeadModel(config)
    return peft.get_peft_model(model, peft.LoraConfig(r=8, target_modules=["c_attn"], fan_in_fan_out=True))


def run(stage: int, args: argparse.Namespace, nvme: str) -> tuple[dict[str, int], list[float]]:
    zero = {"stage": stage, "offload_optimizer": {"device": "cpu"}}
    if stage == 3:
        zero["offload_param"] = {"device": "nvme", "nvme_path": nvme, "max_in_cpu": 0}
    config = {"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True}, "zero_optimization": zero,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
    g = torch.Generator().manual_seed(1)
    losses = []
    with offload.initialize(lora_gpt2(args.layers, args.width), config) as engine:
        for _ in range(args.steps):
            tokens = torch.randint(0, 50257, (1, args.seq), generator=g)
            out = engine(input_ids=tokens, labels=tokens)
            engine.backward(out)
            engine.step()
            losses.append(out.loss.item())
        device = {what: v["peak_bytes"] for (what, tier), v in engine.memory_report().items() if tier == "device"}
    return device, losses


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--width", type=int, default=768)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--nvme-path", default=None, help="a directory on the disk for stage 3's swap files")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(dir=args.nvme_path) as nvme:
        results = {stage: run(stage, args, nvme) for stage in (2, 3)}
    for stage, (device, losses) in results.items():
        print(f"stage {stage}: accelerator weight bytes, peak, by line")
        for what, n in device.items():
            print(f"  {what:32} {n / 2**20:10.1f} MiB")
        print(f"  {'total':32} {sum(device.values()) / 2**20:10.1f} MiB   losses {[round(x, 4) for x in losses]}")
    two, three = (sum(results[s][0].values()) for s in (2, 3))
    print(f"stage 3 / stage 2 accelerator bytes: {three / two:.3f}")


if __name__ == "__main__":
    main()
