"""``OffloadTrainer`` (offload/hf.py): a tiny GPT-2 fine-tuned for 20 steps
(warm-up and linear decay, accumulation 2, clipping, dropout on) gives the
losses of plain ``transformers.Trainer`` within 1e-4 relative, at stages 2 and
3 with NVMe tiers, on one rank and on two; resuming from the checkpoint of
step 10 continues bitwise; a DeepSpeed scheduler section sets the rate as
under DeepSpeed; "auto" values come from ``TrainingArguments`` and
disagreements are errors that name both sides."""

import copy
import dataclasses
import json
import math
import os
import shutil
import subprocess
import sys
import types
import warnings

import pytest
import torch

import offload
from offload.peft_models import checkpoint_names
from offload.config import Config
from offload.errors import CheckpointError, CommError, ConfigError, UsageError
from offload.optim.group_runs import GroupHyper
from offload.safetensors_file import write_safetensors

transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install -e .[hf])")
pytest.importorskip("accelerate", reason="the Trainer needs accelerate (pip install -e .[hf])")

from offload.hf import AppliedStepsSchedule, OffloadTrainer, resolve_config  # noqa: E402

from . import hf_trainer_main as run  # noqa: E402
from .kill_points import Killed, KillPoints  # noqa: E402

TOLERANCE = 1e-4  # relative, on each logged loss; measured: about 2e-7


def _relative(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b) == run.STEPS
    return max(abs(x - y) / abs(x) for x, y in zip(a, b))


@pytest.mark.parametrize("stage", [2, 3])
def test_offload_trainer_gives_the_losses_of_plain_trainer(tmp_path, stage):
    plain = run.train(str(tmp_path / "plain"), None)
    trainer = run.train(str(tmp_path / "offload"), stage, nvme=str(tmp_path / "nvme"))
    assert _relative(run.logged(plain, "loss"), run.logged(trainer, "loss")) < TOLERANCE
    # the Trainer's schedule drove the engine (warm-up, then linear decay): the
    # last step took the last rate logged
    assert run.logged(trainer, "learning_rate") == run.logged(plain, "learning_rate")
    assert trainer.engine.lr == run.logged(plain, "learning_rate")[-1]
    assert _relative(run.logged(plain, "grad_norm"), run.logged(trainer, "grad_norm")) < TOLERANCE
    # Weight decay on biases and norms as well moves the losses by only ~2e-5, the weights by 2e-3.
    weights = trainer.engine.state_dict()
    assert max((plain.model.state_dict()[k] - v).abs().max().item() for k, v in weights.items()) < 1e-4  # ~3e-6
    trainer.engine.close()
    assert os.listdir(tmp_path / "nvme") == []


def test_train_called_again_starts_the_schedule_over_as_plain_trainers_does(tmp_path):
    """Each train() makes a new schedule, counted from there (the engine's applied steps went on): it
    started at the first call's end, and so trained at rate 0."""
    plain = run.train(str(tmp_path / "plain"), None)
    trainer = run.train(str(tmp_path / "offload"), 2, nvme=str(tmp_path / "nvme"))
    for again in (plain, trainer):
        torch.manual_seed(1)  # the same dropout: the first calls left torch's generator in other states
        again.train()
    assert run.logged(trainer, "learning_rate") == run.logged(plain, "learning_rate")
    assert run.logged(plain, "learning_rate")[run.WARMUP] == run.LR
    assert _relative(run.logged(plain, "loss"), run.logged(trainer, "loss")) < TOLERANCE
    trainer.engine.close()


def test_a_trainer_that_fails_to_start_gives_the_model_back_for_another_try(tmp_path):
    """Trainer.__init__ raising after the engine partitioned the model (a
    stage 3 one) closes it: the model is whole again, as the plain Trainer
    leaves it, and a mended call takes it."""
    model = run.tiny_gpt2()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    args = run.arguments(str(tmp_path / "out"))
    wrong = dataclasses.replace(args, eval_strategy="steps")  # with no eval_dataset
    with pytest.raises(ValueError, match="eval_dataset"):
        OffloadTrainer(model=model, args=wrong, train_dataset=run.Tokens(), offload_config=run.offload_config(3),
                       nvme_path=str(tmp_path))
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    trainer = OffloadTrainer(model=model, args=args, train_dataset=run.Tokens(), offload_config=run.offload_config(3),
                             nvme_path=str(tmp_path))
    assert trainer.engine.state_dict().keys() == before.keys()
    trainer.engine.close()


def test_the_trainers_own_error_is_raised_when_closing_the_engine_fails_too(tmp_path, monkeypatch):
    """A close that cannot gather (another rank never joins) does not hide it."""
    def cannot_gather(engine):
        raise CommError("rank 0: all_gather failed")

    monkeypatch.setattr(offload.engine.Engine, "_restore_model", cannot_gather)
    args = dataclasses.replace(run.arguments(str(tmp_path / "out")), eval_strategy="steps")  # with no eval_dataset
    with pytest.raises(ValueError, match="eval_dataset"):
        OffloadTrainer(model=run.tiny_gpt2(), args=args, train_dataset=run.Tokens(),
                       offload_config=run.offload_config(2), nvme_path=str(tmp_path))


def test_a_schedule_saved_before_it_kept_its_start_counts_from_zero():
    """A scheduler.pt an earlier version wrote, loaded by a trainer whose
    first train() call has run (resume_from_checkpoint on the second)."""
    engine = types.SimpleNamespace(applied_steps=40)
    adamw = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    schedule = AppliedStepsSchedule(adamw, lambda n: [float(n)], engine)
    saved = {k: v for k, v in schedule.state_dict().items() if k != "start"}
    engine.applied_steps = 3  # the checkpoint's, restored
    schedule.load_state_dict(saved)
    assert schedule.get_lr() == [3.0]


@pytest.mark.parametrize("lora", [False, True], ids=["gpt2", "lora"])
def test_label_smoothing_shifts_a_causal_lms_labels_as_plain_trainer_does(tmp_path, lora):
    """The Trainer shifts the labels for label smoothing by the class name of
    the model it unwraps: under OffloadTrainer, the held model's."""
    args = run.arguments(str(tmp_path))
    args.label_smoothing_factor = 0.1
    model = run.lora_gpt2() if lora else run.tiny_gpt2()
    plain = transformers.Trainer(model=copy.deepcopy(model), args=args, eval_dataset=run.Tokens())
    (tmp_path / "nvme").mkdir()
    trainer = OffloadTrainer(model=model, args=args, eval_dataset=run.Tokens(), offload_config=run.offload_config(2),
                             nvme_path=str(tmp_path / "nvme"))
    expected, loss = plain.evaluate()["eval_loss"], trainer.evaluate()["eval_loss"]
    assert math.isclose(loss, expected, rel_tol=1e-5), (loss, expected)
    trainer.engine.close()


def test_a_peft_models_weights_are_not_saved_as_a_transformers_model(tmp_path):
    """Its keys (base_model.model.*, adapters beside base layers) would load
    into transformers as a freshly initialised model, with only a report."""
    config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}
    with offload.initialize(run.lora_gpt2(), config) as engine:
        with pytest.raises(UsageError, match="these are a PEFT model's weights .* save the adapter with PEFT's own"):
            engine.save_pretrained(str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()


def test_an_override_of_get_decay_parameter_names_is_honoured(tmp_path):
    from offload.hf import OffloadTrainer

    class AllDecayed(OffloadTrainer):
        def get_decay_parameter_names(self, model):
            assert self.args.weight_decay == run.WEIGHT_DECAY  # an override may read the trainer's state
            return [n for n, _ in model.named_parameters()]

    trainers = [cls(model=run.tiny_gpt2(), args=run.arguments(str(tmp_path)), train_dataset=run.Tokens(),
                    offload_config=run.offload_config(2), nvme_path=str(tmp_path)) for cls in (AllDecayed, OffloadTrainer)]
    runs = [trainer.engine.optimizer.runs.runs for trainer in trainers]
    for trainer in trainers:
        trainer.engine.close()
    assert runs[0] == () and runs[1] and all(group == GroupHyper(0.0) for *_, group in runs[1])


@pytest.mark.parametrize("stage, lora", [(2, False), (3, False), (3, True)], ids=["stage2", "stage3", "stage3-lora"])
def test_two_ranks_give_the_losses_of_plain_trainer_under_ddp(tmp_path, stage, lora):
    if lora:
        pytest.importorskip("peft", reason="peft is not installed (pip install peft)")
    script = os.path.join(os.path.dirname(__file__), "hf_trainer_main.py")
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", script,
                           str(tmp_path), str(stage), *(["lora"] if lora else [])], capture_output=True, text=True,
                          timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-4000:]
    for rank in range(2):
        result = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert _relative(result["plain"], result["offload"]) < TOLERANCE
        assert result["plain_lr"] == result["offload_lr"]
    if lora:
        assert {"adapter_config.json", "adapter_model.safetensors"} <= set(os.listdir(tmp_path / "adapter"))


def test_a_deepspeed_scheduler_section_sets_the_rate_as_under_deepspeed(tmp_path):
    """A stock Hugging Face DeepSpeed config's WarmupDecayLR, all "auto": the
    rates are DeepSpeed's (two steps at warmup_min_lr, log warm-up over the
    arguments' warmup_steps, linear decay to 0 at max_steps), not the
    arguments' linear schedule, and the losses are plain AdamW's under them."""
    plain = run.train(str(tmp_path / "plain"), None, scheduler=run.WARMUP_DECAY)
    trainer = run.train(str(tmp_path / "offload"), 2, nvme=str(tmp_path / "nvme"), scheduler=run.WARMUP_DECAY)
    expected = [run.warmup_decay_rate(k) for k in range(run.STEPS)]
    assert run.logged(plain, "learning_rate") == pytest.approx(expected, rel=1e-12)
    assert run.logged(trainer, "learning_rate") == pytest.approx(expected, rel=1e-12)
    assert _relative(run.logged(plain, "loss"), run.logged(trainer, "loss")) < TOLERANCE
    trainer.engine.close()


@pytest.mark.parametrize("scheduler", [None, run.WARMUP_DECAY], ids=["arguments-schedule", "deepspeed-schedule"])
def test_a_step_skipped_for_an_fp16_overflow_leaves_the_schedule_where_it_was(tmp_path, scheduler):
    """As the Trainer holds its schedule when AMP skips a step, and DeepSpeed
    its own: the step after an overflow runs at the skipped step's rate."""
    from offload.hf import OffloadTrainer

    class Overflowing(OffloadTrainer):
        losses = 0

        def compute_loss(self, *args, **kwargs):
            Overflowing.losses += 1
            loss = super().compute_loss(*args, **kwargs)
            return loss * 1e6 if Overflowing.losses == 5 else loss  # the third step's first micro-batch

    config = {**run.offload_config(2), "fp16": {"enabled": "auto", "hysteresis": 1}}
    if scheduler is not None:
        config["scheduler"] = scheduler
    args = dataclasses.replace(run.arguments(str(tmp_path / "out"), max_steps=6), fp16=True)
    trainer = Overflowing(model=run.tiny_gpt2(), args=args, train_dataset=run.Tokens(), offload_config=config,
                          nvme_path=str(tmp_path))
    trainer.train()
    assert (trainer.engine.applied_steps, trainer.engine.skipped_steps) == (5, 1)
    rates = run.logged(trainer, "learning_rate")
    if scheduler is None:
        schedule = transformers.get_linear_schedule_with_warmup(torch.optim.SGD([torch.zeros(1)], lr=run.LR),
                                                                run.WARMUP, 6)
        applied = [run.LR * schedule.lr_lambdas[0](k) for k in range(5)]
    else:
        applied = [run.warmup_decay_rate(k, total=6) for k in range(5)]
    assert rates == pytest.approx(applied[:3] + applied[2:], rel=1e-12)  # step 3 skipped: step 4 at its rate
    trainer.engine.close()


@pytest.mark.parametrize("stage, scheduler", [(2, None), (3, None), (2, run.WARMUP_DECAY)],
                         ids=["stage2", "stage3", "stage2-deepspeed-schedule"])
def test_resuming_from_the_middle_continues_bitwise(tmp_path, stage, scheduler):
    whole = run.train(str(tmp_path / "run"), stage, nvme=str(tmp_path / "nvme1"), save_steps=10, scheduler=scheduler)
    checkpoint = tmp_path / "run" / "checkpoint-10"
    assert (checkpoint / "offload").is_dir() and (checkpoint / "scheduler.pt").is_file()
    resumed = run.train(str(tmp_path / "again"), stage, nvme=str(tmp_path / "nvme2"), resume=str(checkpoint),
                        scheduler=scheduler)
    assert run.logged(resumed, "loss")[10:] == run.logged(whole, "loss")[10:]
    assert run.logged(resumed, "learning_rate") == run.logged(whole, "learning_rate")
    assert not [m for m in resumed.said if "learning rate resumes" in m]  # the Trainer's scheduler sets it
    a, b = whole.engine.state_dict(), resumed.engine.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # the checkpoint's weights are a model directory Hugging Face reads
    model = transformers.AutoModelForCausalLM.from_pretrained(str(checkpoint))
    assert model.transformer.h[0].attn.c_attn.weight.shape == (64, 192)
    whole.engine.close()
    resumed.engine.close()


def test_a_checkpoint_an_earlier_offload_wrote_again_resumes_and_is_written_as_now(tmp_path):
    """An OffloadTrainer before this version named an engine checkpoint written
    again `offload.next`: such a checkpoint resumes, and writing it again
    leaves `offload` alone."""
    whole = run.train(str(tmp_path / "run"), 2, nvme=str(tmp_path / "nvme1"), save_steps=10)
    whole.engine.close()
    for step in (10, 20):
        earlier = tmp_path / "run" / f"checkpoint-{step}"
        os.rename(earlier / "offload", earlier / "offload.next")
        (earlier / "latest").write_text("offload.next")
    resumed = run.train(str(tmp_path / "run"), 2, nvme=str(tmp_path / "nvme2"), save_steps=10,
                        resume=str(tmp_path / "run" / "checkpoint-10"))
    resumed.engine.close()
    assert run.logged(resumed, "loss")[10:] == run.logged(whole, "loss")[10:]
    later = tmp_path / "run" / "checkpoint-20"
    assert (later / "latest").read_text() == "offload" and not (later / "offload.next").exists()


def test_resuming_from_an_earlier_checkpoint_of_the_same_run_writes_the_later_ones_again(tmp_path):
    """As plain Trainer: checkpoint-20 exists when the run resumed from checkpoint-10 reaches step 20."""
    whole = run.train(str(tmp_path / "run"), 2, nvme=str(tmp_path / "nvme1"), save_steps=10)
    whole.engine.close()
    later = tmp_path / "run" / "checkpoint-20"
    assert (later / "latest").read_text() == "offload"
    resumed = run.train(str(tmp_path / "run"), 2, nvme=str(tmp_path / "nvme2"), save_steps=10,
                        resume=str(tmp_path / "run" / "checkpoint-10"))
    resumed.engine.close()
    assert run.logged(resumed, "loss")[10:] == run.logged(whole, "loss")[10:]
    assert (later / "latest").read_text() == "offload"
    assert offload.checkpoint.read_manifest(str(later / "offload")).training.global_steps == 20
    assert not [name for name in os.listdir(later) if name.startswith(".")]


def test_resuming_from_a_checkpoint_saved_with_save_only_model_names_it(tmp_path):
    def trainer():
        args = run.arguments(str(tmp_path / "run"), save_steps=10)
        args.save_only_model = True
        return OffloadTrainer(model=run.tiny_gpt2(), args=args, train_dataset=run.Tokens(),
                              offload_config=run.offload_config(2), nvme_path=str(tmp_path))

    first = trainer()
    first.train()
    first.engine.close()
    again = trainer()
    with pytest.raises(CheckpointError, match="checkpoint-10 has no engine checkpoint .*saved with "
                                              "TrainingArguments.save_only_model, which keeps the weights alone"):
        again.train(resume_from_checkpoint=str(tmp_path / "run" / "checkpoint-10"))
    again.engine.close()


def test_a_checkpoint_written_again_and_killed_anywhere_keeps_one_complete(tmp_path, monkeypatch):
    """Writing checkpoint-N again (a run resumed from an earlier checkpoint
    reaching N), killed at each rename, replace or tree removal: `latest` still
    names a complete engine checkpoint, which a resumed run loads."""
    trainer = run.train(str(tmp_path / "run"), 2, nvme=str(tmp_path / "nvme1"), save_steps=20)
    directory = str(tmp_path / "run" / "checkpoint-20")
    kill = KillPoints(monkeypatch, [(os, "rename"), (os, "replace"), (shutil, "rmtree")])
    killed = 0
    while True:
        kill.arm(killed + 1)
        try:
            trainer._save_optimizer_and_scheduler(directory)
        except Killed:
            killed += 1
            manifest = offload.checkpoint.read_manifest(offload.checkpoint.resolve(directory))
            assert manifest.training.global_steps == 20, killed
        else:
            break
    assert killed >= 4
    kill.arm(0)
    assert "offload" in os.listdir(directory) and not [n for n in os.listdir(directory) if n.startswith(".")]
    expected = trainer.engine.state_dict()
    trainer.engine.close()
    resumed = run.train(str(tmp_path / "again"), 2, nvme=str(tmp_path / "nvme2"), resume=directory)
    assert resumed.state.global_step >= 20
    resumed.engine.load_checkpoint(directory)
    loaded = resumed.engine.state_dict()
    assert all(torch.equal(loaded[k], expected[k]) for k in expected)
    resumed.engine.close()


def test_a_peft_model_trains_saves_its_adapter_and_resumes(tmp_path):
    """A LoRA (PEFT) at stage 3, weights and optimizer on NVMe: plain Trainer's
    losses; checkpoints hold the adapter, as the Trainer writes it, and an
    engine checkpoint without the frozen base; the saved adapter loads onto a
    fresh base with the trained values; resuming continues bitwise."""
    peft = pytest.importorskip("peft", reason="peft is not installed (pip install peft)")
    plain = run.train(str(tmp_path / "plain"), None, lora=True)
    whole = run.train(str(tmp_path / "run"), 3, nvme=str(tmp_path / "nvme1"), save_steps=10, lora=True)
    assert _relative(run.logged(plain, "loss"), run.logged(whole, "loss")) < TOLERANCE
    checkpoint = tmp_path / "run" / "checkpoint-10"
    assert {"adapter_config.json", "adapter_model.safetensors"} <= set(os.listdir(checkpoint))
    assert not (checkpoint / "model.safetensors").exists()
    manifest = json.loads((checkpoint / "offload" / "manifest.json").read_text())
    assert not any("base_layer" in key or "wte" in key for key in manifest["extra_keys"])
    trained = whole.engine.state_dict(exclude_frozen_parameters=True)
    assert trained.keys() == {k for k, p in whole.model.named_parameters() if p.requires_grad}
    whole.save_model(str(tmp_path / "adapter"))
    loaded = peft.PeftModel.from_pretrained(run.tiny_gpt2(), str(tmp_path / "adapter"))
    adapter = {k: v for k, v in loaded.state_dict().items() if "lora_" in k}
    assert adapter.keys() == trained.keys() and all(torch.equal(adapter[k], trained[k]) for k in trained)
    resumed = run.train(str(tmp_path / "again"), 3, nvme=str(tmp_path / "nvme2"), resume=str(checkpoint), lora=True)
    assert run.logged(resumed, "loss")[10:] == run.logged(whole, "loss")[10:]
    whole.engine.close()
    resumed.engine.close()


def test_a_peft_model_loads_its_base_from_the_base_models_checkpoint(tmp_path):
    """load_weights finds a PEFT model's base weights under the base model's
    names (no base_model.model. prefix, no base_layer level), at stage 3 where
    they are frozen partitions; a base checkpoint lacking one is an error."""
    peft = pytest.importorskip("peft", reason="peft is not installed (pip install peft)")
    base = run.tiny_gpt2()
    torch.manual_seed(7)
    for p in base.parameters():  # values unlike the fresh model's
        torch.nn.init.normal_(p, std=0.05)
    base.save_pretrained(str(tmp_path / "base"))
    model = run.lora_gpt2()
    adapter = {k: v.clone() for k, v in model.state_dict().items() if "lora_" in k}
    config = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
              "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"},
                                    "stage3_param_persistence_threshold": 0}}
    with offload.initialize(model, config) as engine:
        with pytest.warns(UserWarning, match=r"lora_A.default.weight.* keep the values the PEFT model gave them"):
            offload.load_weights(engine, str(tmp_path / "base"))
        state = engine.state_dict()
    names = checkpoint_names(model)
    expected = base.state_dict()
    for key, value in state.items():
        if "lora_" in key:
            assert torch.equal(value, adapter[key]), key  # not in the base checkpoint: the model's own
        else:
            assert torch.equal(value, expected[names(key)[-1]]), key
    del expected["transformer.h.1.mlp.c_fc.weight"]  # a frozen base weight the checkpoint lacks
    partial = str(tmp_path / "partial.safetensors")
    write_safetensors(partial, [(k, v.dtype, tuple(v.shape)) for k, v in expected.items()], expected.items())
    with offload.initialize(run.lora_gpt2(), config) as engine:
        with pytest.raises(UsageError, match=r"c_fc.weight missing from"):
            offload.load_weights(engine, partial)
    assert isinstance(model, peft.PeftModel)


def test_a_lora_around_a_meta_built_base_starts_as_peft_starts_it(tmp_path):
    """Note [LoRA on the meta device]: the base built under offload.init and
    loaded from its checkpoint, the adapters initialised as PEFT does (B zero,
    A as nn.Linear's weight), so the model computes what the base does."""
    peft = pytest.importorskip("peft", reason="peft is not installed (pip install peft)")
    base = run.tiny_gpt2()
    base.save_pretrained(str(tmp_path / "base"))
    config = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
              "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"},
                                    "stage3_param_persistence_threshold": 0}}

    def lora(init_lora_weights=True):
        with offload.init(config):
            model = transformers.GPT2LMHeadModel(base.config)
        return peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["c_attn"], fan_in_fan_out=True,
                                                          init_lora_weights=init_lora_weights))

    tokens = torch.randint(0, run.VOCAB, (2, run.SEQ), generator=torch.Generator().manual_seed(3))
    model = lora()
    with pytest.warns(UserWarning, match="keep the values the PEFT model gave them"):
        engine = offload.initialize(model, config, init_fn=model._init_weights, weights=str(tmp_path / "base"))
    with engine, torch.no_grad():
        state = engine.state_dict()
        engine.module.eval()  # no dropout
        logits = engine(input_ids=tokens).logits
    a = [v for k, v in state.items() if "lora_A" in k]
    assert len(a) == 2 and all(0 < v.abs().max() <= 1 / math.sqrt(64) for v in a)  # kaiming_uniform(a=sqrt 5)
    assert all(not v.any() for k, v in state.items() if "lora_B" in k)
    base.eval()
    with torch.no_grad():
        assert torch.allclose(logits, base(input_ids=tokens).logits, rtol=0, atol=1e-5)
    with pytest.raises(UsageError, match="init_lora_weights='eva' cannot start on a model built under offload.init"):
        offload.initialize(lora("eva"), config, weights=str(tmp_path / "base"))


def _stage3(threshold: int = 0) -> dict:
    return {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
            "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"},
                                  "stage3_param_persistence_threshold": threshold}}


def test_peft_embedding_adapters_modules_to_save_and_a_second_adapter(tmp_path):
    """LoRA on the embedding too (its adapters are ParameterDicts, which the
    embedding reads without calling them) and a trainable copy of ln_f
    (modules_to_save): stage 3 trains them as AdamW does; built under
    offload.init, the copy and the base load from the base's checkpoint and
    the embedding's adapters start as PEFT starts them (A zero); an inactive
    second adapter is the adapter's own, not a missing base weight; saving
    keeps to the adapter being trained."""
    peft = pytest.importorskip("peft", reason="peft is not installed (pip install peft)")
    base = run.tiny_gpt2()
    with torch.no_grad():
        base.transformer.ln_f.weight.normal_()  # unlike a fresh LayerNorm's: the copy must come from the file
    base.save_pretrained(str(tmp_path / "base"))
    lora = peft.LoraConfig(r=4, target_modules=["c_attn", "wte"], modules_to_save=["ln_f"], fan_in_fan_out=True)
    tokens = torch.randint(0, run.VOCAB, (3, 1, run.SEQ), generator=torch.Generator().manual_seed(3))

    model = peft.get_peft_model(run.tiny_gpt2().eval(), lora)  # no dropout: the two runs draw no masks
    torch.manual_seed(4)
    for name, p in model.named_parameters():  # every adapter weight away from its start, so each one matters
        if p.requires_grad:
            torch.nn.init.normal_(p, std=0.05)
    reference = copy.deepcopy(model)
    adamw = torch.optim.AdamW([p for p in reference.parameters() if p.requires_grad], lr=1e-3)
    expected = []
    for batch in tokens:
        adamw.zero_grad()
        loss = reference(input_ids=batch, labels=batch).loss
        loss.backward()
        adamw.step()
        expected.append(loss.item())
    with offload.initialize(model, _stage3()) as engine:
        losses = []
        for batch in tokens:
            out = engine(input_ids=batch, labels=batch)
            engine.backward(out)
            engine.step()
            losses.append(out.loss.item())
        trained = engine.state_dict(exclude_frozen_parameters=True)
    assert max(abs(a - b) / abs(a) for a, b in zip(expected, losses)) < TOLERANCE
    wanted = {k: v for k, v in reference.state_dict().items() if k in trained}
    assert wanted.keys() == trained.keys() and any("lora_embedding_A" in k for k in trained)
    assert max((wanted[k] - trained[k]).abs().max().item() for k in trained) < TOLERANCE

    with offload.init(_stage3()):
        meta_base = transformers.GPT2LMHeadModel(base.config)
    model = peft.get_peft_model(meta_base, lora)
    model.add_adapter("other", peft.LoraConfig(r=2, target_modules=["c_attn"], fan_in_fan_out=True))
    with pytest.warns(UserWarning, match="lora_embedding_A.default.* keep the values the PEFT model gave them"):
        engine = offload.initialize(model, _stage3(), init_fn=model._init_weights, weights=str(tmp_path / "base"))
    with engine:
        state = engine.state_dict()
    assert not any(v.any() for k, v in state.items() if "lora_embedding_A" in k)
    assert all(v.any() for k, v in state.items() if "lora_embedding_B" in k)
    ln_f = base.state_dict()["transformer.ln_f.weight"]
    assert torch.equal(state["base_model.model.transformer.ln_f.modules_to_save.default.weight"], ln_f)
    assert torch.equal(state["base_model.model.transformer.ln_f.original_module.weight"], ln_f)


def test_saving_a_peft_model_with_an_inactive_adapter_keeps_to_the_active_one(tmp_path):
    """PEFT freezes the adapters it is not training: OffloadTrainer saves the
    active one and says so, where PEFT would fill the other with its keys."""
    peft = pytest.importorskip("peft", reason="peft is not installed (pip install peft)")
    model = run.lora_gpt2()
    model.add_adapter("other", peft.LoraConfig(r=2, target_modules=["c_attn"], fan_in_fan_out=True))
    trainer = OffloadTrainer(model=model, args=_args(tmp_path), offload_config=run.offload_config(3),
                             nvme_path=str(tmp_path))
    with pytest.warns(UserWarning, match="saves the adapters it trains \\(default\\), not the inactive other"):
        trainer.save_model(str(tmp_path / "saved"))
    (tmp_path / "afile").write_text("")
    with pytest.raises(UsageError, match=rf"OffloadTrainer.save_model: .*{tmp_path / 'afile'}"):
        trainer.save_model(str(tmp_path / "afile" / "saved"))  # before gathering anything, with the path named
    trainer.engine.close()
    assert "adapter_model.safetensors" in os.listdir(tmp_path / "saved")
    assert not (tmp_path / "saved" / "other").exists()


def test_a_checkpoint_without_an_engine_checkpoint_is_refused(tmp_path):
    plain = run.train(str(tmp_path / "plain"), None, save_steps=10)
    with pytest.raises(Exception, match="no engine checkpoint"):
        run.train(str(tmp_path / "offload"), 2, nvme=str(tmp_path / "nvme"),
                  resume=str(tmp_path / "plain" / "checkpoint-10"))
    assert plain.state.global_step == run.STEPS


@pytest.mark.parametrize("stage", [2, 3])
def test_floating_inputs_reach_a_bf16_model_in_its_dtype(tmp_path, stage):
    """Pixel values come as float32; under bf16 the Trainer casts floating
    inputs to DeepSpeed's dtype, OffloadTrainer to the engine's, or the first
    convolution refuses them. Labels stay integers."""
    torch.manual_seed(0)
    model = transformers.ViTForImageClassification(transformers.ViTConfig(
        hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=64, image_size=16,
        patch_size=8, num_labels=3))
    g = torch.Generator().manual_seed(0)
    data = [{"pixel_values": torch.randn(3, 16, 16, generator=g), "labels": i % 3} for i in range(8)]
    args = transformers.TrainingArguments(output_dir=str(tmp_path / "out"), per_device_train_batch_size=4,
                                          max_steps=4, bf16=True, use_cpu=True, report_to=[], save_strategy="no")
    zero = {"stage": stage, "offload_optimizer": {"device": "cpu"}}
    if stage == 3:
        zero["offload_param"] = {"device": "cpu"}
    config = {"train_micro_batch_size_per_gpu": "auto", "bf16": {"enabled": "auto"}, "zero_optimization": zero}
    trainer = OffloadTrainer(model=model, args=args, train_dataset=data, offload_config=config)
    prepared = trainer._prepare_inputs({"pixel_values": torch.randn(1, 3, 16, 16), "labels": torch.tensor([1])})
    assert (prepared["pixel_values"].dtype, prepared["labels"].dtype) == (torch.bfloat16, torch.int64)
    assert math.isfinite(trainer.train().training_loss)
    assert trainer.engine.global_steps == 4
    trainer.engine.close()


def test_torch_compile_in_the_arguments_compiles_the_model(tmp_path):
    """The Trainer compiles in Accelerate's prepare, which the engine takes the
    place of: OffloadTrainer compiles the model itself, and the losses stay
    those of the eager run (dropout off: compiled dropout draws otherwise)."""
    def losses(compile: bool) -> list[float]:
        torch.manual_seed(0)
        model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
            vocab_size=100, n_embd=32, n_layer=2, n_head=4, n_positions=16, resid_pdrop=0.0, embd_pdrop=0.0,
            attn_pdrop=0.0))
        g = torch.Generator().manual_seed(0)
        data = [{"input_ids": (ids := torch.randint(0, 100, (8,), generator=g)), "labels": ids} for _ in range(16)]
        args = transformers.TrainingArguments(output_dir=str(tmp_path / str(compile)), per_device_train_batch_size=4,
                                              max_steps=4, logging_steps=1, use_cpu=True, report_to=[],
                                              save_strategy="no", torch_compile=compile)
        trainer = OffloadTrainer(model=model, args=args, train_dataset=data, offload_config=run.offload_config(3),
                                 nvme_path=str(tmp_path))
        trainer.train()
        trainer.engine.close()
        return run.logged(trainer, "loss")

    eager = losses(False)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()  # reset() leaves the counts of earlier tests
    compiled = losses(True)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] > 0
    assert max(abs(a - b) / a for a, b in zip(eager, compiled)) < TOLERANCE


# -- "auto" values -------------------------------------------------------------------------


def _args(tmp_path, **overrides):
    values = dict(output_dir=str(tmp_path), per_device_train_batch_size=3, gradient_accumulation_steps=5,
                  learning_rate=3e-4, adam_beta1=0.8, adam_beta2=0.95, adam_epsilon=1e-7, weight_decay=0.0,
                  max_grad_norm=0.25, use_cpu=True, report_to=[])
    values.update(overrides)
    return transformers.TrainingArguments(**values)


def test_auto_values_come_from_the_training_arguments_and_the_model(tmp_path):
    config = resolve_config(run.offload_config(3), _args(tmp_path), run.tiny_gpt2())
    assert config["train_micro_batch_size_per_gpu"] == 3 and config["gradient_accumulation_steps"] == 5
    assert config["gradient_clipping"] == 0.25
    assert config["optimizer"]["params"] == {"lr": 3e-4, "betas": [0.8, 0.95], "eps": 1e-7, "weight_decay": 0.0}
    zero = config["zero_optimization"]
    assert zero["stage3_prefetch_bucket_size"] == int(0.9 * 64 * 64) and zero["stage3_param_persistence_threshold"] == 640
    # without an optimizer section, TrainingArguments' AdamW is the optimizer; keys
    # left out take the arguments' values (DeepSpeed would not clip)
    bare = resolve_config({"zero_optimization": {"stage": 2}}, _args(tmp_path), run.tiny_gpt2())
    assert bare["optimizer"] == {"type": "AdamW", "params": {"lr": 3e-4, "betas": [0.8, 0.95], "eps": 1e-7,
                                                             "weight_decay": 0.0}}
    assert bare["gradient_clipping"] == 0.25 and bare["gradient_accumulation_steps"] == 5
    assert bare["bf16"] == {"enabled": False} and bare["train_batch_size"] == 15
    # a section given in part keeps what it gives
    partial = resolve_config({"optimizer": {"type": "AdamW", "params": {"lr": 3e-4}}}, _args(tmp_path), run.tiny_gpt2())
    assert partial["optimizer"]["params"] == {"lr": 3e-4, "betas": [0.8, 0.95], "eps": 1e-7, "weight_decay": 0.0}


def test_hugging_faces_stock_config_loads_with_no_word_of_what_it_leaves_at_auto_or_default(tmp_path):
    """Hugging Face's ZeRO-3 example carries reduce_bucket_size "auto" (which sizes
    nothing at stage 3 here) and a whole fp16 section at DeepSpeed's defaults,
    enabled "auto" (off in an fp32 run): none of it is the user's choice, so
    none of it is warned about; a value the user did choose still is."""
    stock = run.offload_config(3)
    stock["zero_optimization"]["reduce_bucket_size"] = "auto"
    stock["fp16"] = {"enabled": "auto", "loss_scale": 0, "loss_scale_window": 1000, "initial_scale_power": 16,
                     "hysteresis": 2, "min_loss_scale": 1}
    config = resolve_config(stock, _args(tmp_path), run.tiny_gpt2())
    assert "reduce_bucket_size" not in config["zero_optimization"] and config["fp16"]["enabled"] is False
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        Config.load(config)
    assert not [str(w.message) for w in caught if "reduce_bucket_size" in str(w.message) or "fp16" in str(w.message)]
    config["fp16"]["hysteresis"] = 4
    config["zero_optimization"]["reduce_bucket_size"] = 1000
    with pytest.warns(UserWarning, match=r"zero_optimization.reduce_bucket_size \(stage 3 reduces each parameter's "
                                         r"gradient on its own\); fp16.hysteresis \(fp16 is not enabled\)"):
        Config.load(config)
    two = run.offload_config(2)
    two["zero_optimization"]["stage3_prefetch_bucket_size"] = "auto"
    assert "stage3_prefetch_bucket_size" not in resolve_config(two, _args(tmp_path), run.tiny_gpt2())["zero_optimization"]
    for stage in ("auto", "3", None):  # the config's own check names it, not a TypeError on the way
        bad = run.offload_config(2)
        bad["zero_optimization"]["stage"] = stage
        with pytest.raises(ConfigError, match="zero_optimization.stage"):
            Config.load(resolve_config(bad, _args(tmp_path), run.tiny_gpt2()))


def test_the_bf16_sections_old_name_resolves_and_is_checked_as_bf16(tmp_path):
    config = run.offload_config(2)
    config["bfloat16"] = {"enabled": "auto"}
    assert resolve_config(config, _args(tmp_path), run.tiny_gpt2())["bf16"] == {"enabled": False}
    config["bfloat16"] = {"enabled": True}
    with pytest.raises(ConfigError, match="bf16.enabled is True but TrainingArguments give False"):
        resolve_config(config, _args(tmp_path), run.tiny_gpt2())


def test_an_idle_auto_bucket_size_needs_no_model_width(tmp_path):
    """reduce_bucket_size "auto" at stage 3 sizes nothing: dropped, even for a
    model whose config has no hidden_size to size it from."""
    config = run.offload_config(3)
    config["zero_optimization"]["reduce_bucket_size"] = "auto"
    del config["zero_optimization"]["stage3_prefetch_bucket_size"], config["zero_optimization"]["stage3_param_persistence_threshold"]
    assert "reduce_bucket_size" not in resolve_config(config, _args(tmp_path), torch.nn.Linear(2, 2))["zero_optimization"]


def test_explicit_values_that_disagree_with_the_arguments_are_errors(tmp_path):
    config = run.offload_config(2)
    config["optimizer"]["params"]["lr"] = 1e-3
    config["gradient_accumulation_steps"] = 5  # agrees: fine
    with pytest.raises(ConfigError, match=r"optimizer.params.lr is 0.001 but TrainingArguments give 0.0003"):
        resolve_config(config, _args(tmp_path), run.tiny_gpt2())


def test_scheduler_auto_values_are_hugging_faces_and_the_step_counts_wait_for_train(tmp_path):
    config = {**run.offload_config(2), "scheduler": run.WARMUP_DECAY}
    args = _args(tmp_path, warmup_steps=0.1)  # a fraction of the steps
    early = resolve_config(config, args, run.tiny_gpt2())["scheduler"]["params"]
    assert early == {"warmup_min_lr": 0, "warmup_max_lr": 3e-4, "warmup_num_steps": "auto", "total_num_steps": "auto"}
    resolved = resolve_config(config, args, run.tiny_gpt2(), steps=35)["scheduler"]["params"]
    assert resolved == {"warmup_min_lr": 0, "warmup_max_lr": 3e-4, "warmup_num_steps": 4, "total_num_steps": 35}
    # given outright, they must agree with the arguments, as under Hugging Face's DeepSpeed integration
    config["scheduler"] = {"type": "WarmupDecayLR", "params": {"warmup_max_lr": 3e-4, "total_num_steps": 30}}
    assert resolve_config(config, args, run.tiny_gpt2())["scheduler"]["params"]["total_num_steps"] == 30
    with pytest.raises(ConfigError, match=r"scheduler.params.total_num_steps is 30 but TrainingArguments give 35"):
        resolve_config(config, args, run.tiny_gpt2(), steps=35)
    config["scheduler"]["params"]["warmup_max_lr"] = 1e-3
    with pytest.raises(ConfigError, match=r"scheduler.params.warmup_max_lr is 0.001 but TrainingArguments give 0.0003"):
        resolve_config(config, args, run.tiny_gpt2())


@pytest.mark.parametrize("change, message", [
    (lambda c, a: c.update(scheduler={"type": "WarmupCosineLR", "params": {"cos_min_ratio": "auto"}}),
     "scheduler.params.cos_min_ratio is 'auto', which OffloadTrainer resolves only for .*total_num_steps"),
    (lambda c, a: c.pop("optimizer") and setattr(a, "optim", "sgd"), "TrainingArguments.optim is 'sgd'"),
    (lambda c, a: c["zero_optimization"].update(sub_group_size="auto"), "zero_optimization.sub_group_size is 'auto'"),
])
def test_what_cannot_be_resolved_is_named(tmp_path, change, message):
    config, args = run.offload_config(2), _args(tmp_path)
    change(config, args)
    with pytest.raises(ConfigError, match=message):
        resolve_config(config, args, run.tiny_gpt2())


def test_settings_the_engine_replaces_are_refused(tmp_path):
    model, config = run.tiny_gpt2(), run.offload_config(2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(UsageError, match="drop optimizers="):
        OffloadTrainer(model=model, args=_args(tmp_path), offload_config=config, optimizers=(optimizer, None))
    with pytest.raises(UsageError, match="load_best_model_at_end"):
        OffloadTrainer(model=model, args=_args(tmp_path, load_best_model_at_end=True, eval_strategy="steps",
                                               save_strategy="steps"), offload_config=config)
    with pytest.raises(UsageError, match="needs offload_config"):
        OffloadTrainer(model=model, args=_args(tmp_path))
    with pytest.raises(UsageError, match="TrainingArguments.bf16_full_eval would cast the engine's weights"):
        OffloadTrainer(model=model, args=_args(tmp_path, bf16_full_eval=True), offload_config=config)
    # a scheduler section is checked at construction, its step counts in train()
    with pytest.raises(ConfigError, match="scheduler.type"):
        OffloadTrainer(model=model, args=_args(tmp_path), offload_config={**config, "scheduler": {"type": "OneCycle"}})
    long_warmup = OffloadTrainer(model=model, args=_args(tmp_path, max_steps=4, warmup_steps=6), nvme_path=str(tmp_path),
                                 offload_config={**config, "scheduler": run.WARMUP_DECAY}, train_dataset=run.Tokens())
    with pytest.raises(ConfigError, match=r"warm-up \(6 steps\) is longer than the run \(4 steps\)"):
        long_warmup.train()
    long_warmup.engine.close()
    # not refused, since DeepSpeed's own integration accepts both, but said
    config["scheduler"] = run.WARMUP_DECAY
    with pytest.warns(UserWarning, match="TrainingArguments.lr_scheduler_type 'cosine' not used"):
        trainer = OffloadTrainer(model=model, args=_args(tmp_path, lr_scheduler_type="cosine"), offload_config=config,
                                 nvme_path=str(tmp_path))
    trainer.engine.close()


def test_the_example_fine_tunes_and_its_model_loads_back_into_partitions(tmp_path):
    """examples/finetune_hf.py: the held-out loss falls; run again from the model
    it wrote (built under offload.init, weights loaded into stage 3's NVMe
    partitions), it starts where the first run ended."""
    script = os.path.join(os.path.dirname(__file__), os.pardir, "examples", "finetune_hf.py")

    def finetune(out, *extra):
        proc = subprocess.run([sys.executable, script, "--out", str(out), "--steps", "10", "--seq", "64",
                               "--nvme", str(tmp_path), *extra], capture_output=True, text=True, timeout=600,
                              env={**os.environ, "TQDM_DISABLE": "1"})
        assert proc.returncode == 0, proc.stderr[-4000:]
        line = proc.stdout.strip().splitlines()[-1]  # "held-out loss A -> B; ..."
        before, after = line.split("held-out loss ")[1].split(";")[0].split(" -> ")
        return float(before), float(after)

    before, after = finetune(tmp_path / "first")
    assert after < before - 0.5
    again, _ = finetune(tmp_path / "second", "--model", str(tmp_path / "first" / "final"))
    assert again == pytest.approx(after, abs=1e-3)
    assert sorted(os.listdir(tmp_path)) == ["first", "second"]  # no swap file left behind
