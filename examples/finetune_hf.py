"""Fine-tune a Llama-architecture model with OffloadTrainer: ZeRO stage 3, the
weights and the optimizer state in swap files, Hugging Face's Trainer loop.

    python examples/finetune_hf.py                    # a small Llama built from a config
    python examples/finetune_hf.py --model DIR        # a model directory on this disk (weights + tokenizer)

Nothing is downloaded: the text is the Python standard library's sources (as
``offload train`` uses), the model is built from a config unless ``--model``
names a local directory. Swap files go to a temporary directory unless
``--nvme`` names one. The one line that differs from a plain Trainer script is
the ``OffloadTrainer(...)`` call, with ``offload_config=``.
"""

from __future__ import annotations

import argparse
import os
import tempfile

import torch
import transformers

import offload
from offload.data import stdlib_corpus
from offload.hf import OffloadTrainer

# A DeepSpeed config as Hugging Face users write them: "auto" takes the value
# from TrainingArguments (lr, betas, batch sizes, clipping, bf16) or from the
# model's hidden size (bucket sizes).
OFFLOAD_CONFIG = {
    "train_micro_batch_size_per_gpu": "auto",
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "bf16": {"enabled": "auto"},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
    "zero_optimization": {
        "stage": 3,
        "stage3_prefetch_bucket_size": "auto",
        "stage3_param_persistence_threshold": "auto",
        "offload_optimizer": {"device": "nvme", "nvme_path": "/local_nvme"},
        "offload_param": {"device": "nvme", "nvme_path": "/local_nvme", "max_in_cpu": 0},
    },
}


class TextWindows(torch.utils.data.Dataset):
    """Fixed windows of token ids (the labels are the inputs: the model shifts them)."""

    def __init__(self, ids: torch.Tensor, seq_len: int, count: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        starts = torch.randint(0, len(ids) - seq_len, (count,), generator=g)
        self.windows = torch.stack([ids[s : s + seq_len] for s in starts.tolist()])

    def __len__(self) -> int:
        return len(self.windows)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.windows[i], "labels": self.windows[i]}


def small_llama() -> transformers.LlamaForCausalLM:
    """About 3.6M parameters over the 256 byte values."""
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                                      bos_token_id=None, eos_token_id=None, pad_token_id=None)
    return transformers.LlamaForCausalLM(config)


def token_ids(text: bytes, model_dir: str | None) -> torch.Tensor:
    """The model directory's tokenizer, or bytes as tokens (a model this script wrote has none)."""
    if model_dir is None or not any(os.path.exists(os.path.join(model_dir, name))
                                    for name in ("tokenizer.json", "tokenizer_config.json")):
        return torch.frombuffer(bytearray(text), dtype=torch.uint8).long()
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    return torch.tensor(tokenizer(text.decode("utf-8", errors="replace"))["input_ids"])


def build_model(model_dir: str | None):
    if model_dir is None:
        torch.manual_seed(0)
        return small_llama()
    # Built on the meta device: nothing is allocated until the engine
    # materialises each module and keeps only this rank's part of it.
    config = transformers.AutoConfig.from_pretrained(model_dir)
    with offload.init():
        return transformers.AutoModelForCausalLM.from_config(config)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="a local model directory (config.json, safetensors, tokenizer)")
    parser.add_argument("--nvme", help="directory for swap files (default: a temporary one)")
    parser.add_argument("--out", default="runs/finetune_hf", help="Trainer output directory")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--seq", type=int, default=128)
    args = parser.parse_args()

    text = stdlib_corpus(2 << 20)
    ids = token_ids(text, args.model)
    split = int(len(ids) * 0.98)
    train = TextWindows(ids[:split], args.seq, 4000, seed=0)
    held_out = TextWindows(ids[split:], args.seq, 64, seed=1)

    training = transformers.TrainingArguments(
        output_dir=args.out, max_steps=args.steps, per_device_train_batch_size=8, gradient_accumulation_steps=2,
        learning_rate=2e-3, warmup_steps=args.steps // 10, lr_scheduler_type="cosine", weight_decay=0.0,
        max_grad_norm=1.0, logging_steps=10, eval_strategy="steps", eval_steps=args.steps // 2,
        per_device_eval_batch_size=16, save_steps=args.steps // 2, save_total_limit=1, report_to=[],
        bf16=torch.cuda.is_available(), use_cpu=not torch.cuda.is_available(), seed=0)

    with tempfile.TemporaryDirectory(prefix="offload-finetune-") as scratch:
        nvme = args.nvme or scratch
        trainer = OffloadTrainer(model=build_model(args.model), args=training, train_dataset=train,
                                 eval_dataset=held_out, offload_config=OFFLOAD_CONFIG, nvme_path=nvme)
        if args.model is not None:
            offload.load_weights(trainer.engine, args.model)  # straight into each rank's partitions
        print(f"offload: swap files in {nvme}")
        before = trainer.evaluate()["eval_loss"]
        trainer.train()
        after = trainer.evaluate()["eval_loss"]
        trainer.save_model(os.path.join(args.out, "final"))
        trainer.engine.close()
    print(f"held-out loss {before:.3f} -> {after:.3f}; the model is in {os.path.join(args.out, 'final')} "
          f"(transformers.AutoModelForCausalLM.from_pretrained reads it)")


if __name__ == "__main__":
    main()
