"""One fine-tuning run of a tiny GPT-2 (built from its config, dropout on)
with plain ``transformers.Trainer`` or with ``OffloadTrainer``: the same seed,
data, warm-up and decay, accumulation and clipping. tests/test_hf_trainer.py
runs it in process, and under torchrun for two ranks:

    python -m torch.distributed.run --nproc_per_node 2 tests/hf_trainer_main.py OUT STAGE [lora]
"""

from __future__ import annotations

import json
import math
import os
import sys
import warnings

import torch
import transformers

STEPS, VOCAB, SEQ = 20, 97, 16
LR, WARMUP = 2e-3, 5
WEIGHT_DECAY = 0.1  # plain Trainer exempts biases and norms: the engine must too

# A stock Hugging Face DeepSpeed config's scheduler: everything "auto".
WARMUP_DECAY = {"type": "WarmupDecayLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                    "warmup_num_steps": "auto", "total_num_steps": "auto"}}


def warmup_decay_rate(applied: int, total: int = STEPS) -> float:
    """DeepSpeed's WarmupDecayLR (log warm-up) as its documentation gives it,
    with the values Hugging Face gives the "auto"s above for ``total`` steps:
    the rate of the next step after ``applied`` applied steps (DeepSpeed
    starts one step back)."""
    position, warmup = applied - 1, max(2, WARMUP)
    if position < 0:
        return 0.0
    gamma = math.log(position + 1) / math.log(warmup) if position < warmup else \
        max(0.0, (total - position) / (total - warmup))
    return LR * gamma


def tiny_gpt2() -> transformers.GPT2LMHeadModel:
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=VOCAB, n_positions=32,
                                     bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(config)


def lora_gpt2() -> torch.nn.Module:
    """tiny_gpt2 under a PEFT LoRA adapter on its attention, the adapter's B
    drawn at random (PEFT starts it at zero) so it matters from the first step."""
    import peft

    model = peft.get_peft_model(tiny_gpt2(), peft.LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn"],
                                                             lora_dropout=0.0, fan_in_fan_out=True))
    torch.manual_seed(2)
    for name, p in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.02)
    return model


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n: int = 200) -> None:
        g = torch.Generator().manual_seed(1)
        self.ids = torch.randint(0, VOCAB, (n, SEQ), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def offload_config(stage: int) -> dict:
    """A DeepSpeed-style config as Hugging Face users write them: "auto" wherever
    the Trainer's arguments know the value."""
    zero = {"stage": stage, "offload_optimizer": {"device": "nvme", "nvme_path": "/local_nvme"},
            "reduce_bucket_size": "auto"}
    if stage == 3:
        zero.update(offload_param={"device": "nvme", "nvme_path": "/local_nvme"}, stage3_prefetch_bucket_size="auto",
                    stage3_param_persistence_threshold="auto")
        del zero["reduce_bucket_size"]
    return {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
            "gradient_clipping": "auto", "optimizer": {"type": "AdamW", "params": {
                "lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
            "zero_optimization": zero}


def arguments(out: str, max_steps: int = STEPS, save_steps: int | None = None) -> transformers.TrainingArguments:
    return transformers.TrainingArguments(
        output_dir=out, max_steps=max_steps, per_device_train_batch_size=4, gradient_accumulation_steps=2,
        learning_rate=LR, warmup_steps=WARMUP, lr_scheduler_type="linear", max_grad_norm=0.5, logging_steps=1,
        weight_decay=WEIGHT_DECAY,
        save_strategy="steps" if save_steps else "no", save_steps=save_steps or 500, report_to=[], seed=0,
        use_cpu=True, disable_tqdm=True, data_seed=0)


def train(out: str, stage: int | None, nvme: str | None = None, resume: str | None = None,
          save_steps: int | None = None, scheduler: dict | None = None, lora: bool = False) -> transformers.Trainer:
    """Plain Trainer when ``stage`` is None; else OffloadTrainer at that stage,
    swap files under ``nvme``. With ``scheduler`` (WARMUP_DECAY), the offload
    config has that section, and the plain Trainer follows warmup_decay_rate;
    with ``lora``, the model is lora_gpt2."""
    from offload.hf import OffloadTrainer

    model = lora_gpt2() if lora else tiny_gpt2()
    if nvme is not None:
        os.makedirs(nvme, exist_ok=True)
    args = arguments(out, save_steps=save_steps)
    with warnings.catch_warnings(record=True) as caught:  # kept on the trainer, as ``said``, for tests to read
        warnings.simplefilter("always")
        if stage is None:
            trainer = transformers.Trainer(model=model, args=args, train_dataset=Tokens())
            if scheduler is not None:
                adamw = trainer.create_optimizer()
                trainer.lr_scheduler = torch.optim.lr_scheduler.LambdaLR(adamw, lambda k: warmup_decay_rate(k) / LR)
        else:
            config = offload_config(stage)
            if scheduler is not None:
                config["scheduler"] = scheduler
            trainer = OffloadTrainer(model=model, args=args, train_dataset=Tokens(), offload_config=config,
                                     nvme_path=nvme)
        trainer.train(resume_from_checkpoint=resume)
    trainer.said = [str(w.message) for w in caught]
    return trainer


def logged(trainer: transformers.Trainer, key: str) -> list[float]:
    return [h.get(key) for h in trainer.state.log_history if "loss" in h]


if __name__ == "__main__":
    out, stage, lora = sys.argv[1], int(sys.argv[2]), sys.argv[3:] == ["lora"]
    transformers.logging.set_verbosity_error()
    rank = int(os.environ["RANK"])
    plain = train(os.path.join(out, "plain"), None, lora=lora)
    engine = train(os.path.join(out, "offload"), stage, nvme=os.path.join(out, f"nvme{rank}"), lora=lora)
    if lora:  # every rank gathers the adapter, rank 0 writes it
        engine.save_model(os.path.join(out, "adapter"))
    engine.engine.close()
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump({"plain": logged(plain, "loss"), "offload": logged(engine, "loss"),
                   "plain_lr": logged(plain, "learning_rate"), "offload_lr": logged(engine, "learning_rate"),
                   "plain_norm": logged(plain, "grad_norm"), "offload_norm": logged(engine, "grad_norm")}, f)
