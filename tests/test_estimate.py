"""`offload estimate` and `offload plan`: the ZeRO paper's worked example,
hand-computed offload cases, and the accounting checked against what the
engine itself reports (memory per tier, bytes moved to disk) on a real model."""

import functools
import json
import os
import re
import subprocess
import sys
import tempfile
import types

import pytest
import torch

import offload
from offload import _native
from offload.cli import main, plan
from offload.estimate import ModelShape, Setup, all_setups, estimate, zero_model_states
from offload.models.gpt import GPT, SIZES, GPTConfig
from offload.store import pool_bytes

from .zero.harness import finish_rank, init_gloo, spawn_ranks

GB = 1e9


def test_the_zero_papers_worked_example():
    # 7.5B parameters, 64 GPUs, mixed-precision Adam (ZeRO paper, section 5.1 / figure 1)
    states = zero_model_states(7_500_000_000, 64)
    assert [round(states[k] / GB, 1) for k in ("baseline", "stage1", "stage2", "stage3")] == [120.0, 31.4, 16.6, 1.9]


def test_estimate_cli_prints_the_papers_figures(capsys):
    assert main(["estimate", "--params", "7.5B", "--gpus", "64", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    per_gpu = result["zero_model_states_per_gpu"]
    assert round(per_gpu["stage2"] / GB, 1) == 16.6 and round(per_gpu["stage3"] / GB, 2) == 1.88
    assert len(result["setups"]) == 15
    assert main(["estimate", "--params", "7.5B", "--gpus", "64"]) == 0
    table = capsys.readouterr().out
    assert "baseline 120.0 GB | stage 1 31.4 GB | stage 2 16.6 GB | stage 3 1.9 GB" in table
    assert table.startswith("offload estimate: 7.5B parameters")
    assert main(["estimate", "--params", "121000", "--stage", "1"]) == 0
    assert capsys.readouterr().out.startswith("offload estimate: 121K parameters")  # not 0.000121B


def test_the_fits_column_judges_only_the_tiers_it_was_given_a_size_for(capsys):
    """With the host's size alone, a setup that fits it is not "yes": the GPU
    (and the disk, where used) is unknown, which the column said nothing of."""
    assert main(["estimate", "--params", "7B", "--stage", "2", "--cpu-mem", "512GB"]) == 0
    rows = {line[:38].strip(): line[73:91].strip() for line in capsys.readouterr().out.splitlines()
            if line.startswith("stage 2")}
    assert rows == {"stage 2, optimizer none": "GPU unknown", "stage 2, optimizer cpu": "GPU unknown",
                    "stage 2, optimizer nvme": "GPU,NVMe unknown"}
    assert main(["estimate", "--params", "7B", "--stage", "2", "--cpu-mem", "64GB", "--gpu-mem", "80GB",
                 "--nvme-free", "1TB"]) == 0
    rows = [line[73:91].strip() for line in capsys.readouterr().out.splitlines() if line.startswith("stage 2")]
    assert rows == ["no: GPU", "no: CPU", "yes"]
    assert main(["estimate", "--params", "7B", "--stage", "2", "--cpu-mem", "512GB", "--json"]) == 0
    fits = [setup["fits"] for setup in json.loads(capsys.readouterr().out)["setups"]]
    assert fits == [{"device": None, "host": True, "nvme": True}, {"device": None, "host": True, "nvme": True},
                    {"device": None, "host": True, "nvme": None}]


def test_on_the_cpu_every_ranks_accelerator_bytes_count_against_the_host_memory(capsys):
    """--accelerator cpu: what the accelerator holds is RAM beside the host
    tier's, so --cpu-mem judges both (a GPU size is refused): stage 2 with the
    optimizer on the accelerator holds 12.2 GB on each of 2 ranks and nothing
    in the host tier, which 22 GB of RAM does not hold; on GPUs the host fits it."""
    args = ["estimate", "--params", "1B", "--gpus", "2", "--stage", "2", "--json"]
    assert main(args + ["--accelerator", "cpu", "--cpu-mem", "22GB"]) == 0
    setups = json.loads(capsys.readouterr().out)["setups"]
    for setup in setups:
        together = setup["node"]["device"] + setup["node"]["host"]
        assert setup["fits"] == {"device": True, "host": together <= 22e9, "nvme": True if setup["node"]["nvme"] == 0 else None}
    assert [s["fits"]["host"] for s in setups] == [False, True, True]
    assert main(args + ["--cpu-mem", "22GB"]) == 0
    assert json.loads(capsys.readouterr().out)["setups"][0]["fits"] == {"device": None, "host": True, "nvme": True}
    assert main(args + ["--accelerator", "cpu", "--gpu-mem", "80GB"]) == 2
    assert "--gpu-mem sizes a GPU, but --accelerator cpu computes on the CPU" in capsys.readouterr().err


def test_estimate_cli_counts_a_loras_trained_parameters(capsys):
    """7B weights, 40M trained: the paper's per-GPU bytes and each setup's
    gradients and optimizer state follow the 40M; the weights the 7B."""
    assert main(["estimate", "--params", "7B", "--trainable", "40M", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["trainable"] == 40_000_000
    assert result["zero_model_states_per_gpu"]["baseline"] == 2 * 7e9 + (2 + 12) * 40e6
    stage2 = next(e for e in result["setups"] if e["setup"]["name"] == "stage 2, optimizer cpu")
    assert stage2["per_rank"]["host"]["optimizer state"] == 12 * 40_000_000
    assert stage2["per_rank"]["host"]["gradients (owned)"] == 2 * 40_000_000
    assert stage2["per_rank"]["device"]["weights"] == 2 * 7_000_000_000


def test_a_hugging_face_config_gives_the_models_exact_shape(tmp_path, capsys):
    """Its config.json or its directory, built on the meta device: the shape of
    the model itself, a tied weight counted once."""
    transformers = pytest.importorskip("transformers")
    configs = {"llama": transformers.LlamaConfig(hidden_size=64, intermediate_size=176, num_hidden_layers=2,
                                                 num_attention_heads=4, num_key_value_heads=2, vocab_size=300,
                                                 architectures=["LlamaForCausalLM"]),
               "gpt2": transformers.GPT2Config(n_layer=2, n_embd=48, n_head=4, vocab_size=200, n_positions=32)}
    for name, config in configs.items():
        config.save_pretrained(tmp_path / name)
        model = transformers.AutoModelForCausalLM.from_config(config)
        sizes = sorted(p.numel() for p in model.parameters())
        for given in (tmp_path / name, tmp_path / name / "config.json"):
            shape = ModelShape.from_hf_config(str(given))
            assert sorted(shape.sizes) == sizes and shape.params == sum(sizes) and shape.largest == sizes[-1]
            assert shape.source == f"{type(model).__name__} from {given}"
    assert main(["estimate", "--model-config", str(tmp_path / "gpt2"), "--stage", "3", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["params"] == ModelShape.from_hf_config(str(tmp_path / "gpt2")).params
    (tmp_path / "empty").mkdir()
    with pytest.raises(offload.errors.UsageError, match="empty: transformers cannot build a model from it"):
        ModelShape.from_hf_config(str(tmp_path / "empty"))


def test_hand_computed_offload_cases():
    P, N = 1_000_000_000, 4  # n = 250M owned elements per rank
    n = 250e6
    shape = ModelShape(P, 51_200_000, "test")  # sizes in multiples of 4096 bytes, so no rounding below
    slack = 3 * 4096  # per swap file in flight: the data buffer's alignment slack, a 4 KiB header and its slack
    bf16 = offload.Config.load({"bf16": {"enabled": True}, "gradient_accumulation_steps": 2, "zero_optimization": {
        "sub_group_size": 10_240_000, "reduce_bucket_size": 100_000_000, "offload_param": {"max_in_cpu": 0}}})
    e = estimate(shape, Setup(2, "cpu"), bf16, N)
    assert e.per_rank["device"] == {"weights": 2 * P, "gradient buckets": 2 * 100_000_000}
    # accumulation sums the gradient over micro-batches: in fp32
    assert e.per_rank["host"] == {"staging": 2 * n, "gradients (owned)": 4 * n, "optimizer state": 12 * n}
    assert e.node["host"] == 4 * 18 * n  # four ranks on the node
    assert e.pcie_bytes_per_step == 2 * n * 2 + 2 * n  # gradient parts down per micro-batch, weights up once
    assert e.disk_read_per_step == 0
    e = estimate(shape, Setup(3, "nvme", "nvme"), bf16, N)
    assert e.per_rank["nvme"] == {"weights (partition)": 2 * n, "optimizer state": 12 * n}
    assert e.per_rank["host"]["optimizer pool"] == 4 * (12 * 10_240_000 + slack)
    assert e.per_rank["host"]["weight pool"] == 5 * (2 * 12_800_000 + slack)  # buffer_count parts of the largest
    assert e.per_rank["host"]["weights (handover buffer)"] == 2 * 10_240_000  # one sub-group of new weights
    assert e.disk_read_per_step == 4 * (12 + 2 * 2 * 2) * n  # optimizer once, weights twice per micro-batch
    assert e.disk_written_per_step == 4 * (12 + 2) * n
    assert e.pcie_bytes_per_step == 2 * 2 * 2 * n + 2 * 2 * n  # gathers, then gradient parts; no upload
    in_cpu = offload.Config.load({"bf16": {"enabled": True}, "zero_optimization": {
        "stage": 3, "offload_param": {"device": "nvme", "nvme_path": "/nvme", "max_in_cpu": 100_000_000}}})
    e = estimate(shape, Setup(3, "nvme", "nvme"), in_cpu, N)
    assert e.per_rank["host"]["weights (partition)"] == 2 * 100_000_000  # max_in_cpu elements stay in RAM
    assert e.per_rank["nvme"]["weights (partition)"] == 2 * 150_000_000
    assert e.per_rank["host"]["gradients (owned)"] == 2 * n  # no accumulation: bf16, as the reduced parts are
    assert e.disk_read_per_step == 4 * (12 + 2 * 2) * 150e6 + 4 * 12 * 100e6
    dpu = offload.Config.load({"bf16": {"enabled": True}, "zero_optimization": {
        "reduce_bucket_size": 10_000_000, "offload_optimizer": {"device": "cpu", "delayed_update": True}}})
    e = estimate(shape, Setup(2, "cpu"), dpu, N)
    assert e.per_rank["host"]["gradients (delayed update's second buffer)"] == 2 * n
    assert e.per_rank["device"]["gradient buckets"] == 2 * 51_200_000  # the largest parameter has a bucket of its own


SETUP_CASES = [(setup, "float32", "float32") for setup in all_setups()]
SETUP_CASES += [(setup, "bfloat16", master) for setup in all_setups() if setup.optimizer != "none"
                for master in ("float32", "bfloat16")]


@pytest.mark.skipif(not _native.status().available, reason="native library not built")
@pytest.mark.parametrize("setup,state_dtype,master_dtype", SETUP_CASES,
                         ids=lambda v: v.name.replace(", ", "-").replace(" ", "") if isinstance(v, Setup) else v)
def test_the_estimate_is_what_the_engine_holds_and_moves(tmp_path, setup, state_dtype, master_dtype):
    """Per tier, the estimate lies within 10% (+64 KiB of headers) of the peak
    the engine's memory report gives, and so do the bytes read and written per
    step, for every optimizer state format."""
    _check_estimate(tmp_path, setup, state_dtype, master_dtype, overlap_step=False)


@pytest.mark.skipif(not _native.status().available, reason="native library not built")
@pytest.mark.parametrize("setup", [Setup(2, "cpu"), Setup(2, "nvme"), Setup(3, "nvme", "cpu")], ids=str)
def test_the_estimate_counts_the_overlapped_steps_copies_and_buffers(tmp_path, setup):
    """Note [overlapped step]: state copies on cpu, more pool buffers on nvme, new bf16 weights on both."""
    _check_estimate(tmp_path, setup, "float32", "float32", overlap_step=True)


@pytest.mark.skipif(not _native.status().available, reason="native library not built")
@pytest.mark.parametrize("setup", [Setup(1, "none"), Setup(2, "cpu"), Setup(2, "nvme"), Setup(3, "cpu", "cpu"),
                                   Setup(3, "nvme", "nvme")], ids=str)
def test_the_estimate_counts_only_trained_parameters_for_gradients_and_optimizer(tmp_path, setup):
    """``--trainable``: the embeddings and the first two blocks frozen, as a
    LoRA's base is; the estimate still lies within 10% of what the engine
    holds and moves."""
    _check_estimate(tmp_path, setup, "float32", "float32", overlap_step=False,
                    frozen=lambda name: name.startswith(("tok.", "pos.", "blocks.0.", "blocks.1.")))


@pytest.mark.skipif(not _native.status().available, reason="native library not built")
def test_the_weight_pool_holds_each_part_once_where_its_cap_is_more(tmp_path):
    """A vocabulary that dwarfs the blocks (a 1M-element embedding, 0.1M in
    the blocks): buffer_count of the largest part, the pool's cap, is nearly
    four times what the pool ever holds, every part on disk once; the
    estimate counts that, within 10% of the host's peak."""
    big_vocab = GPTConfig(n_layer=2, n_head=2, n_embd=64, block_size=32, vocab_size=16384)
    shape = ModelShape.from_config(big_vocab)
    assert 3 * shape.weight_pool(2, 1, 5, 0) < pool_bytes([2 * shape.largest_part(1)], 5)
    # With some frozen, which parts stay in host memory is unknown: all count, as with max_in_cpu 0.
    assert shape.with_trainable(100_000).weight_pool(2, 1, 5, 10**9) == shape.weight_pool(2, 1, 5, 0)
    _check_estimate(tmp_path, Setup(3, "nvme", "nvme"), "float32", "float32", overlap_step=False, model=big_vocab,
                    max_in_cpu=0)


@pytest.mark.skipif(not _native.status().available, reason="native library not built")
@pytest.mark.parametrize("weights", ["cpu", "nvme"])
def test_the_estimate_counts_the_weights_uploaded_ahead(tmp_path, weights):
    """Stage 3 weights in host memory (nvme's within max_in_cpu) go up to the
    accelerator ahead of their module, up to stage3_prefetch_bucket_size
    elements: the estimate counts them, for a bucket that no part fits in and
    one that holds several, and the two peaks differ."""
    peaks = {bucket: _check_estimate(tmp_path, Setup(3, "cpu", weights), "float32", "float32", overlap_step=False,
                                     limits=_ahead(bucket))
             for bucket in (100_000, 600_000)}
    assert peaks[600_000] > peaks[100_000] + 2 * 400_000, peaks  # bf16: at least 400K elements went ahead


@pytest.mark.skipif(not _native.status().available, reason="native library not built")
def test_the_estimate_counts_each_ranks_part_of_the_weights_uploaded_ahead(tmp_path):
    """At world size 2 a part uploaded ahead is half its parameter; the
    prefetch bucket counts whole parameters, as DeepSpeed's does."""
    peak = _check_estimate(tmp_path, Setup(3, "cpu", "cpu"), "float32", "float32", overlap_step=False,
                           limits=_ahead(600_000), world=2)
    alone = _check_estimate(tmp_path / "alone", Setup(3, "cpu", "cpu"), "float32", "float32", overlap_step=False,
                            limits=_ahead(600_000))
    assert peak < alone - 2 * 200_000, (peak, alone)  # bf16: of 400K or more elements ahead, half stayed on the other rank


def _ahead(bucket: int) -> dict:
    return {"stage3_max_live_parameters": 10**9, "stage3_prefetch_bucket_size": bucket}


def _check_estimate(tmp_path, setup, state_dtype, master_dtype, overlap_step, frozen=None, limits=None,
                    world=1, model=SIZES["small"], max_in_cpu=None) -> int:
    """The estimate against the engine's own report (each rank's, at
    ``world`` gloo ranks), after two steps of the small model; ``frozen``: the
    names of parameters that do not train; ``limits``: stage 3's, instead of a
    tight max_live; ``model``: the bundled GPT's config; ``max_in_cpu``:
    offload_param's, instead of the default. Returns the accelerator's
    measured peak."""
    zero = {"stage": setup.stage, "sub_group_size": 300_000, "reduce_bucket_size": 400_000,
            **(limits or {"stage3_max_live_parameters": 200_000}),
            "offload_optimizer": {"device": setup.optimizer, **({"nvme_path": str(tmp_path)} if setup.optimizer == "nvme" else {}),
                                  "gradients_on_nvme": setup.optimizer == "nvme" and setup.weights == "nvme",
                                  "overlap_step": overlap_step,
                                  **({"state_dtype": state_dtype, "master_dtype": master_dtype}
                                     if setup.optimizer != "none" else {})}}
    if setup.stage == 3:
        zero["offload_param"] = {"device": setup.weights, **({"nvme_path": str(tmp_path)} if setup.weights == "nvme" else {}),
                                 **({} if max_in_cpu is None else {"max_in_cpu": max_in_cpu})}
    raw = {"train_micro_batch_size_per_gpu": 2, "bf16": {"enabled": True}, "zero_optimization": zero}
    if world == 1:
        measured = [_measure(raw, frozen, model)]
    else:
        assert frozen is None, "a test's lambda does not reach spawned ranks"
        measured = spawn_ranks(functools.partial(_measure_rank, raw=raw, world=world, model=model), tmp_path, world)
    shape = ModelShape.from_config(model)
    for m in measured:
        trainable = m["trainable"]
        e = estimate(shape if trainable == shape.params else shape.with_trainable(trainable), setup,
                     offload.Config.load(raw), world, host_accelerator=True)
        for tier, peak in m["peak"].items():
            assert abs(e.rank_total(tier) - peak) <= 0.1 * peak + 65536, (tier, e.rank_total(tier), peak)
        for estimated, traffic in ((e.disk_read_per_step, m["read"]), (e.disk_written_per_step, m["written"])):
            assert abs(estimated - traffic) <= 0.1 * traffic + 65536, (estimated, traffic)
    return max(m["peak"]["device"] for m in measured)


def _measure(raw: dict, frozen, c: GPTConfig) -> dict:
    """Two steps of the GPT ``c``: the engine's peak bytes by tier, its disk
    traffic in the second, and how many parameters train."""
    torch.manual_seed(0)
    model = GPT(c)
    for name, p in model.named_parameters():
        p.requires_grad_(not (frozen and frozen(name)))
    engine = offload.initialize(model, raw)
    tokens = torch.randint(0, 256, (2, c.block_size + 1))
    for _ in range(2):
        before = engine.disk_traffic()
        engine.backward(engine(tokens))
        engine.step()
        engine.synchronize()
    after = engine.disk_traffic()
    report = engine.memory_report()
    engine.close()
    return {"peak": {"device": 0, "host": 0, "nvme": 0, **report.by_tier("peak_bytes")},
            "read": after[0] - before[0], "written": after[1] - before[1],
            "trainable": sum(p.numel() for p in model.parameters() if p.requires_grad)}


def _measure_rank(rank: int, port: int, out_dir: str, raw: dict, world: int, model: GPTConfig) -> None:
    init_gloo(rank, world, port)
    finish_rank(out_dir, rank, _measure(raw, None, model))


def test_plan_climbs_the_ladder_as_memory_shrinks():
    gib = 1 << 30
    shape = ModelShape.from_count(1_000_000_000)  # 16 GB of training state
    cases = [
        (plan.Machine(1, 80 * gib, 64 * gib, None), Setup(2, "none")),
        (plan.Machine(1, 24 * gib, 64 * gib, None), Setup(2, "cpu")),
        (plan.Machine(1, 8 * gib, 16 * gib, 100 * gib), Setup(2, "nvme")),
        # no GPU: "device" is this RAM too, and stage 2 writes new weights into the model's, with no staging copy
        (plan.Machine(1, None, 20 * gib, 100 * gib), Setup(2, "nvme")),
        (plan.Machine(1, None, 16 * gib, 100 * gib), Setup(3, "nvme", "none")),
        (plan.Machine(1, None, int(9.5 * gib), 100 * gib, 1.0, 1.0), Setup(3, "nvme", "nvme")),
    ]
    for machine, expected in cases:
        raw, e = plan.choose(shape, machine, "/nvme")
        assert e.setup == expected, (machine, e.setup)
        # the written config, estimated again, is what the plan claimed, and fits
        again = estimate(shape, expected, offload.Config.load(raw), machine.gpus,
                         host_accelerator=machine.gpu_mem is None)
        assert again.node == e.node and plan.fits(again, machine)
    # DeepSpeed's prefetch bucket, 200 MB of fp32 weights ahead on the accelerator (this RAM), would not fit
    assert raw["zero_optimization"]["stage3_prefetch_bucket_size"] == 10_000_000
    said = plan.explain(shape, machine, e, raw)
    assert "stage3_prefetch_bucket_size 10,000,000, not DeepSpeed's 50,000,000, which would not fit: fewer weights " \
           "go up ahead of their module." in said
    assert "beyond these figures, engine.close() gives the model back whole, 4.00 GB in fp32 on the accelerator; " \
           "where that does not fit, save a checkpoint and close it with restore_model=False, as offload train does." \
           in said
    # Note [a process's own RAM]: 0.4 x the engine's 5.43 GB that glibc keeps, 0.42 GB of torch, 128 MiB for
    # micro-batch 1
    assert "with the processes' own 2.72 GB (torch, micro-batch 1's activations, what glibc keeps after freeing), " \
           "8.15 GB of RAM in all" in said[1] and "glibc keeps about 2.17 GB of freed memory; MALLOC_TRIM_THRESHOLD_=0" \
           in said[2]
    # glibc giving freed memory back (the plan run with MALLOC_TRIM_THRESHOLD_ set), half the RAM does
    raw, e = plan.choose(shape, plan.Machine(1, None, 5 * gib, 100 * gib, glibc_keeps=False), "/nvme")
    assert e.setup == Setup(3, "nvme", "nvme")
    assert raw["zero_optimization"]["offload_optimizer"]["gradients_on_nvme"]  # 4 GB of fp32 gradient would not fit
    assert plan.choose(ModelShape.from_count(10**12), plan.Machine(1, None, 16 * gib, 100 * gib), "/nvme") is None


def test_plan_with_bf16_moments_keeps_the_state_in_ram_where_fp32_needs_the_disk():
    gib = 1 << 30
    shape, machine = ModelShape.from_count(1_000_000_000), plan.Machine(1, 24 * gib, 16 * gib, 100 * gib)
    assert plan.choose(shape, machine, "/nvme")[1].setup == Setup(2, "nvme")
    raw, e = plan.choose(shape, machine, "/nvme", {"state_dtype": "bfloat16"})
    assert e.setup == Setup(2, "cpu") and raw["zero_optimization"]["offload_optimizer"]["state_dtype"] == "bfloat16"
    assert e.node["host"] == estimate(shape, Setup(2, "cpu"), offload.Config.load(raw), 1).node["host"]


def test_plan_with_a_bf16_master_keeps_the_state_in_ram_where_fp32_needs_the_disk():
    gib = 1 << 30
    shape, machine = ModelShape.from_count(2_000_000_000), plan.Machine(1, 24 * gib, 16 * gib, 1000 * gib)
    assert plan.choose(shape, machine, "/nvme", {"state_dtype": "int8"})[1].setup == Setup(2, "nvme")
    raw, e = plan.choose(shape, machine, "/nvme", {"state_dtype": "int8", "master_dtype": "bfloat16"})
    assert e.setup == Setup(2, "cpu") and raw["zero_optimization"]["offload_optimizer"]["master_dtype"] == "bfloat16"


@pytest.mark.skipif(not _native.status().available, reason="native library not built")
def test_plan_for_several_ranks_says_to_start_them_with_torchrun(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(plan, "measure_machine", lambda *_: plan.Machine(2, None, 64 * 10**9, None))
    out = tmp_path / "planned.json"
    assert main(["plan", "--model-config", "tiny", "--gpus", "2", "--out", str(out)]) == 0
    assert capsys.readouterr().out.strip().endswith(
        f"wrote {out}; use it: torchrun --nproc_per_node 2 -m offload train --config {out} --model tiny")
    assert main(["plan", "--params", "100K", "--gpus", "2", "--out", str(out)]) == 0
    assert capsys.readouterr().out.strip().endswith(
        f'wrote {out}; use it: engine = offload.initialize(model, "{out}") in a script started with torchrun '
        "--nproc_per_node 2")


def test_plan_writes_a_config_that_trains(tmp_path, capsys):
    out = tmp_path / "planned.json"
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    assert main(["plan", "--params", "100K", "--nvme-path", str(nvme), "--bench-size", "8M", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "chosen: stage 2, optimizer none" in printed
    # No GPU here, so the plan computes in fp32: 4-byte weights and gradients beside 12 bytes of Adam state.
    assert "100K parameters need 0.0 GB of training state at 20 bytes each" in printed, printed
    assert printed.strip().endswith(f'wrote {out}; use it: engine = offload.initialize(model, "{out}")')
    assert set(json.loads(out.read_text())) == {"train_micro_batch_size_per_gpu", "bf16", "zero_optimization"}  # no
    # training choice (clipping, the optimizer) that the plan's memory figures do not depend on
    assert main(["train", "--config", str(out), "--model", "tiny", "--steps", "2", "--out", str(tmp_path / "run")]) == 0


def test_when_nothing_fits_plan_names_what_is_short(monkeypatch, capsys):
    """13B parameters need 208 GB of disk with everything on it: a disk of 100 GB is the limit, not the RAM."""
    monkeypatch.setattr(plan, "measure_machine", lambda *_: plan.Machine(1, None, 64 * 10**9, 100 * 10**9, 1.0, 1.0))
    assert main(["plan", "--params", "13B", "--nvme-path", "/tmp"]) == 1
    printed = capsys.readouterr().out
    needed = re.search(r"needs ([\d.]+) GB of RAM and ([\d.]+) GB on disk", printed)
    assert float(needed[1]) < 0.8 * 64 and float(needed[2]) > 0.9 * 100, printed
    assert "against 64.0 GB of RAM available and 100.0 GB free on disk" in printed
    assert "It fits as stage 3, optimizer nvme, weights nvme with the compact optimizer state" in printed


def test_when_only_the_compact_state_fits_plan_says_so_and_without_a_disk_asks_for_one(monkeypatch, capsys):
    """5B parameters: 100 GB of fp32 state on 84 GB of disk, 40 GB compact;
    without --nvme-path, nothing to put it on (the estimate needs no path)."""
    monkeypatch.setattr(plan, "measure_machine", lambda path, *_: plan.Machine(
        1, None, 32 * 10**9, None if path is None else 84 * 10**9, 1.0, 1.0))
    assert main(["plan", "--params", "5B", "--nvme-path", "/tmp"]) == 1
    assert ("It fits as stage 3, optimizer nvme, weights nvme with the compact optimizer state (not bitwise AdamW): "
            "rerun with --state-dtype int8 --master-dtype bfloat16.") in capsys.readouterr().out
    assert main(["plan", "--params", "5B"]) == 1
    printed = capsys.readouterr().out
    assert "no disk: pass --nvme-path DIR to consider one" in printed
    # fp32 on the CPU: 4 + 4 + 12 bytes a parameter, 100 GB / 90%; compact (bf16 compute): 2 + 2 + 2 + 2, 40 GB / 90%
    assert "It would fit with a disk with 111 GB free (44 GB with --state-dtype int8 --master-dtype bfloat16), passed " \
           "as --nvme-path;" in printed


def test_when_the_ram_is_short_plan_says_so_and_not_that_a_disk_would_do(monkeypatch, capsys):
    monkeypatch.setattr(plan, "measure_machine", lambda *_: plan.Machine(1, None, 2 * 10**9, 10**13, 1.0, 1.0))
    assert main(["plan", "--params", "5B", "--nvme-path", "/tmp"]) == 1
    printed = capsys.readouterr().out
    assert "It would fit with 10.4 GB of RAM available; or split" in printed
    # both short: both said (a bigger disk alone was advised)
    assert main(["plan", "--params", "1.5T", "--nvme-path", "/tmp"]) == 1
    assert re.search(r"It would fit with [\d.]+ GB of RAM available and a disk with 33333 GB free", capsys.readouterr().out)


def test_when_only_the_compact_state_with_glibc_giving_back_fits_plan_says_both_and_json_stays_json(monkeypatch,
                                                                                                      capsys):
    """1B parameters on 3 GB without a GPU: neither the compact state nor glibc
    giving memory back is enough alone, together they are; --json prints JSON
    (it printed the text) with no config."""
    monkeypatch.setattr(plan, "measure_machine", lambda *_: plan.Machine(1, None, 3 * 10**9, 10**13, 1.0, 1.0))
    assert main(["plan", "--params", "1B", "--nvme-path", "/tmp", "--json"]) == 1
    said = json.loads(capsys.readouterr().out)
    assert said["config"] is None and said["why"][-1] == (
        "It fits as stage 3, optimizer nvme, weights nvme with the compact optimizer state (not bitwise AdamW) and "
        "glibc giving back the memory it keeps after freeing, at about 1.15x the step time "
        "(benchmarks/host_allocator.py): rerun with --state-dtype int8 --master-dtype bfloat16 and "
        "MALLOC_TRIM_THRESHOLD_=0 in the environment of plan and of the training.")


def test_a_bf16_master_planned_without_a_gpu_computes_in_bf16_and_says_so(tmp_path, monkeypatch, capsys):
    """A bf16 master is the bf16 compute weights, so the config enables bf16 on
    the CPU too (it was refused: the plan enabled bf16 on GPUs only)."""
    monkeypatch.setattr(plan, "measure_machine", lambda *_: plan.Machine(1, None, 24 * 10**9, None))
    out = tmp_path / "p.json"
    assert main(["plan", "--params", "1B", "--master-dtype", "bfloat16", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    raw = json.loads(out.read_text())
    assert raw["bf16"] == {"enabled": True} and offload.Config.load(raw).zero_optimization.offload_optimizer.master_dtype == "bfloat16"
    assert "bf16 compute, as a bf16 master needs" in printed
    assert "the config's micro-batch is 1 sequence per rank" in printed


@pytest.mark.skipif(not _native.status().available, reason="native library not built")
def test_a_planned_infinity_config_trains_within_the_memory_it_planned_for(tmp_path, monkeypatch, capsys):
    """On a (pretended) machine with 735 MB of RAM and no GPU, the 1.9M-parameter
    model needs ZeRO-Infinity; the run, in a process of its own, then stays
    within the RAM the plan promised, all of it (Note [a process's own RAM]):
    a plan that counted the engine's bytes alone promised 35 MB here."""
    nvme, out = tmp_path / "nvme", tmp_path / "planned.json"
    nvme.mkdir()
    ram = 735_000_000
    monkeypatch.setattr(plan, "measure_machine", lambda *_: plan.Machine(1, None, ram, 10**9, 1.0, 1.0))
    assert main(["plan", "--model-config", "small", "--nvme-path", str(nvme), "--out", str(out), "--json"]) == 0
    planned = json.loads(capsys.readouterr().out)
    assert planned["estimate"]["setup"]["name"] == "stage 3, optimizer nvme, weights nvme"
    assert planned["ram_bytes"] <= 0.8 * ram
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}  # glibc as the plan assumed
    subprocess.run([sys.executable, "-m", "offload", "train", "--config", str(out), "--model", "small", "--steps", "3",
                    "--out", str(tmp_path / "run")], check=True, capture_output=True, env=env)
    with open(tmp_path / "run" / "summary.json") as f:
        summary = json.load(f)
    assert summary["peak_bytes_per_tier"]["nvme"] > 0 and summary["disk_bytes_per_step"]["bytes_read"] > 0
    assert summary["peak_rss_bytes"] <= planned["ram_bytes"], (summary["peak_rss_bytes"], planned["ram_bytes"])
    assert os.listdir(nvme) == []


@pytest.mark.parametrize("argv,message", [
    (["estimate"], "one of the arguments --params --model-config is required"),
    (["estimate", "--params", "lots"], "is not a count"),
    (["estimate", "--params", "1B", "--gpu-mem", "many"], "is not a size"),
    (["estimate", "--params", "1B", "--gpu-mem", "80"], "'80' would be 80 bytes; give the unit, e.g. 80MiB or 80GiB"),
    # one reading of sizes and counts in every command (bench swap's once read 1MB as 1 MiB and refused T)
    (["estimate", "--params", "7"], "'7' would be 7 parameters; give the unit, e.g. 7M or 7B"),
    (["estimate", "--params", "7B", "--trainable", "40"], "'40' would be 40 parameters"),
    (["bench", "swap", "--path", "/tmp", "--size", "256"], "'256' would be 256 bytes"),
    (["bench", "swap", "--path", "/tmp", "--block-size", "8MB"], "'8MB' is 8,000,000 bytes, not a multiple of 4096"),
    (["plan", "--params", "1B", "--bench-size", "5"], "'5' would be 5 bytes"),
    (["estimate", "--params", "1B", "--gpus", "6", "--nodes", "4"], "not a multiple of --nodes"),
    (["estimate", "--model-config", "huge"], "'huge' is not a bundled size (tiny, small, 5M, 25M, 85M), nor a Hugging"),
    (["estimate", "--model-config", "meta-llama/Llama-2-7b-hf"], "and a Hugging Face Hub id is not downloaded: fetch "
                                                                 "its config first"),
    (["estimate", "--model-config", "/nonexistent/dir"], "--model-config '/nonexistent/dir': no such file or directory"),
    (["estimate", "--params", "1B", "--trainable", "2B"], "--trainable 2,000,000,000 must be between 1 and"),
    (["plan", "--params", "1B", "--nvme-path", "/nonexistent"], "is not a directory"),
    (["plan", "--params", "1B", "--out", "/nonexistent/plan.json"], "does not exist; create it first"),
    # sysfs refuses a new file even to root: before any measurement, one line
    (["plan", "--params", "1B", "--out", "/sys/plan.json"], "cannot write in /sys (Permission denied)"),
    (["plan", "--params", "1B", "--nvme-path", "/sys"], "--nvme-path '/sys': cannot write there to measure it"),
    (["export", "/nonexistent", "--out", "/sys/x.safetensors"], "cannot write in /sys"),
    (["export", "/nonexistent", "--hf", "/sys/model"], "cannot write in /sys"),
])
def test_bad_arguments_exit_2_with_one_line(argv, message):
    proc = subprocess.run([sys.executable, "-m", "offload", *argv], capture_output=True, text=True, timeout=120,
                          cwd=tempfile.gettempdir())
    assert proc.returncode == 2 and message in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("share", [0.75, 0.5, 0.25])
def test_the_estimate_splits_weights_by_max_in_cpu_as_the_engine_does(tmp_path, share):
    """A prefix of whole parameter parts stays in host memory, in both: the
    estimate's host bytes and disk reads follow the engine's split."""
    c = SIZES["small"]
    shape = ModelShape.from_config(c)
    max_in_cpu = int(share * shape.params)
    cfg = {"bf16": {"enabled": True}, "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"},
           "offload_param": {"device": "nvme", "nvme_path": str(tmp_path), "max_in_cpu": max_in_cpu}}}
    torch.manual_seed(0)
    with pytest.warns(UserWarning, match="keeps .* weight elements in host memory"):
        engine = offload.initialize(GPT(c), cfg)
    tiers = engine.weights.tiers()
    kept = sum(b.part for b in engine.layout.buckets if tiers[b.slots[0].name] == "cpu")
    engine.close(restore_model=False)
    e = estimate(shape, Setup(3, "cpu", "nvme"), offload.Config.load(cfg), 1)
    assert shape.elements_in_cpu(max_in_cpu, 1) == kept
    assert e.per_rank["host"]["weights (partition)"] == 2 * kept


@pytest.mark.parametrize("gpus", [1, 8])
def test_stage_3_weights_on_nvme_are_what_max_in_cpu_leaves_and_never_negative(gpus):
    """With a count alone, the assumed layers' sizes do not add up to it: the
    weights kept in host memory were counted over those (7.29B) and those on
    disk as the count less them, -36M elements a rank at 8 GPUs, which showed
    as -576.5 MB on NVMe and -1153 MB read a step."""
    config = offload.Config.load({"bf16": {"enabled": True}, "zero_optimization": {
        "stage": 3, "offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "nvme", "nvme_path": "/n"}}})
    e = estimate(ModelShape.from_count(7_000_000_000), Setup(3, "cpu", "nvme"), config, gpus)
    on_disk = max(0, 7_000_000_000 // gpus - config.zero_optimization.offload_param.max_in_cpu)
    assert e.per_rank["nvme"].get("weights (partition)", 0) == 2 * on_disk
    assert all(v >= 0 for tier in e.per_rank.values() for v in tier.values())
    assert e.disk_read_per_step >= 0 and all(v >= 0 for v in e.node.values())



def test_the_memory_the_planning_process_holds_counts_as_available(monkeypatch):
    """plan's own process ends before the training starts: what it holds is
    available to the training, and is what a process like it takes (Note [a
    process's own RAM]); counted as used, it was counted twice. The figures
    are pretended: this VM's MemAvailable moves by 0.4-0.75 GB for a 1 GB
    tensor written, so no real allocation tells the two apart."""
    own, available = 600 * 2**20, 5 * 2**30
    monkeypatch.setattr(plan.psutil, "virtual_memory", lambda: types.SimpleNamespace(available=available))
    monkeypatch.setattr(plan.psutil, "Process", lambda: types.SimpleNamespace(
        memory_full_info=lambda: types.SimpleNamespace(uss=own)))
    machine = plan.measure_machine(None, None, 0)
    assert (machine.cpu_mem, machine.process_bytes) == (available + own, own)
