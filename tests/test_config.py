"""The config: DeepSpeed files load; unknown keys name the nearest valid one;
DeepSpeed-internal tuning keys are accepted with one warning; unimplemented
features are refused; types and bounds are checked with the field's name."""

import json
import os
import re
import warnings

import pytest

from offload.config import DEFAULT_ONLY_KEYS, REFUSED_KEYS, TUNING_KEYS, Config, ConfigError, reference
from offload.store.aio import AioSettings

DEEPSPEED_FILE = {
    "train_batch_size": 32,
    "train_micro_batch_size_per_gpu": 8,
    "gradient_accumulation_steps": 4,
    "gradient_clipping": 1.0,
    "steps_per_print": 100,
    "wall_clock_breakdown": False,
    "zero_force_ds_cpu_optimizer": True,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1,
                                              "torch_adam": False, "amsgrad": False, "bias_correction": True}},
    "bf16": {"enabled": True},
    "zero_optimization": {
        "stage": 2, "allgather_bucket_size": 5e8, "reduce_bucket_size": 5e8, "overlap_comm": True,
        "contiguous_gradients": True, "round_robin_gradients": True, "sub_group_size": 1e9,
        "offload_optimizer": {"device": "nvme", "nvme_path": "/local_nvme", "pin_memory": True,
                              "buffer_count": 4, "fast_init": False},
    },
    "aio": {"block_size": 1048576, "queue_depth": 8, "intra_op_parallelism": 1, "single_submit": False,
            "overlap_events": True},
}


def test_a_deepspeed_file_loads_with_one_warning_listing_tuning_keys(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(DEEPSPEED_FILE))
    with pytest.warns(UserWarning) as caught:
        config = Config.load(str(path))
    assert len(caught) == 1
    message = str(caught[0].message)
    for key in ("steps_per_print", "wall_clock_breakdown", "zero_optimization.allgather_bucket_size",
                "zero_optimization.round_robin_gradients", "zero_optimization.offload_optimizer.fast_init",
                "zero_force_ds_cpu_optimizer", "optimizer.params.torch_adam"):
        assert key in message
    assert config.zero_optimization.offload_optimizer.device == "nvme"
    assert config.zero_optimization.sub_group_size == 1_000_000_000  # 1e9 in JSON is a float
    assert config.optimizer.params.betas == (0.9, 0.95)
    assert config.aio.thread_count == 1 and config.aio.block_size == 1 << 20
    assert config.compute_dtype_name == "bfloat16"


@pytest.mark.parametrize("given,world,expected", [  # given: train_batch_size, micro batch, accumulation (None: unset)
    ((None, None, None), 1, (1, 1, 1)),
    ((None, 4, None), 2, (8, 4, 1)),
    ((None, None, 3), 2, (6, 1, 3)),
    ((32, 8, 4), 1, (32, 8, 4)),
    ((32, 4, None), 2, (32, 4, 4)),  # DeepSpeed derives the accumulation
    ((32, None, 2), 2, (32, 8, 2)),  # and the micro batch
    ((8, None, None), 2, (8, 4, 1)),  # train_batch_size alone: no accumulation
])
def test_batch_sizes_follow_deepspeed(given, world, expected):
    """Note [batch sizes]."""
    keys = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
    config = Config.load({k: v for k, v in zip(keys, given) if v is not None})
    b = config.batch(world)
    assert (b.train_batch_size, b.micro, b.accumulation) == expected


@pytest.mark.parametrize("data,world,message", [
    ({"train_batch_size": 10, "train_micro_batch_size_per_gpu": 3, "gradient_accumulation_steps": 1}, 1,
     "train_batch_size 10 != train_micro_batch_size_per_gpu 3 x gradient_accumulation_steps 1 x world size 1 = 3"),
    ({"train_batch_size": 10, "train_micro_batch_size_per_gpu": 4}, 1,
     "train_batch_size 10 is not a multiple of train_micro_batch_size_per_gpu 4 x world size 1, so "
     "gradient_accumulation_steps cannot be derived"),
    ({"train_batch_size": 6}, 4, "train_batch_size 6 is not a multiple of no accumulation x world size 4"),
    ({"train_batch_size": 2, "gradient_accumulation_steps": 4}, 1,
     "of gradient_accumulation_steps 4 x world size 1, so train_micro_batch_size_per_gpu cannot be derived"),
])
def test_batch_sizes_that_do_not_add_up_are_named(data, world, message):
    with pytest.raises(ConfigError, match=message.replace("(", "\\(")):
        Config.load(data).batch(world)


def test_batch_sizes_of_many_ranks_load_without_a_process_group():
    """Note [batch sizes]: loading (offload estimate, offload train before torchrun's
    group exists) resolves nothing; the world size does, later."""
    data = {"train_batch_size": 64, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2,
            "bf16": {"enabled": True}, "zero_optimization": {"stage": 2}}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        config = Config.load(data)
    assert config.batch(8).accumulation == 2
    with pytest.raises(ConfigError, match="world size 1 = 8"):
        config.batch(1)


def test_defaults_need_no_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert Config.load({}).zero_optimization.stage == 2


@pytest.mark.parametrize(
    "data,message",
    [
        ({"gradient_clip": 1.0}, "unknown key 'gradient_clip'; did you mean 'gradient_clipping'"),
        ({"zero_optimization": {"stag": 2}}, "unknown key 'zero_optimization.stag'; did you mean 'stage'"),
        ({"zero_optimization": {"offload_optimizer": {"devcie": "cpu"}}}, "did you mean 'device'"),
        ({"optimizer": {"type": "Lamb"}}, "optimizer.type must be one of"),
        ({"optimizer": {"params": {"lr": "fast"}}}, "optimizer.params.lr must be a finite number"),
        ({"optimizer": {"params": {"betas": [0.9, 1.2]}}}, "betas must be two numbers in"),
        ({"optimizer": {"type": "AdamW", "params": {"adam_w_mode": False}}}, "use type Adam for L2"),
        ({"zero_optimization": {"stage": 4}}, "zero_optimization.stage must be one of"),
        ({"zero_optimization": {"stage": "2"}}, "zero_optimization.stage must be an integer"),
        ({"gradient_accumulation_steps": 0}, "gradient_accumulation_steps must be >= 1"),
        ({"fp16": {"enabled": "yes"}}, "fp16.enabled must be true or false"),
        ({"bf16": {"enabled": True}, "fp16": {"enabled": True}}, "enable at most one"),
        ({"zero_optimization": {"offload_optimizer": {"device": "nvme"}}}, "nvme_path is not set"),
        ({"pipeline": {"stages": 2}}, "pipeline: pipeline parallelism is not implemented"),
        ({"zero_optimization": {"zero_hpz_partition_size": 8}},
         "zero_optimization.zero_hpz_partition_size: hierarchical partitioning"),
        ({"checkpoint": {"load_universal": True}}, "checkpoint is {\"load_universal\": true}: DeepSpeed's checkpoint options are not implemented"),
        ({"optimizer": {"params": {"amsgrad": True}}}, "optimizer.params.amsgrad is true, but AMSGrad is not "
                                                       "implemented; set it false or remove it"),
        ({"optimizer": {"params": {"bias_correction": False}}},
         "optimizer.params.bias_correction false needs zero_optimization.offload_optimizer.device cpu or nvme"),
        ({"zero_optimization": {"offload_optimizer": {"device": "cpu", "gradients_on_nvme": True}}},
         "gradients_on_nvme needs device nvme"),
        ({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "delayed_update": True}}},
         "delayed_update is for stages 1 and 2"),
        ({"zero_optimization": {"offload_param": {"device": "cpu"}}}, "stage 3"),
        ({"aio": {"block_size": 1000}}, "aio.block_size must be a positive multiple of 4096"),
        ({"aio": {"queue_dpeth": 8}}, "unknown key 'aio.queue_dpeth'; did you mean 'queue_depth'"),
        ({"aio": {"use_direct": "false"}}, "aio.use_direct must be true or false, got 'false'"),
        ({"aio": {"use_direct": 0}}, "aio.use_direct must be true or false, got 0"),
        ({"aio": {"queue_depth": 2.5}}, "aio.queue_depth must be an integer, got 2.5"),
        ({"aio": {"thread_count": True}}, "aio.thread_count must be an integer, got True"),
        ({"aio": {"intra_op_parallelism": "2"}}, "aio.intra_op_parallelism must be an integer, got '2'"),
        ({"aio": {"block_size": "1M"}}, "aio.block_size must be an integer, got '1M'"),
        ({"aio": {"backend": 1}}, "aio.backend must be a string, got 1"),
        ({"gradient_clip": 1.0, "zero_optimization": {"stag": 2, "offload_optimizer": {"devcie": "cpu"}}},
         "3 unknown keys:\n  unknown key 'gradient_clip'; did you mean 'gradient_clipping'?\n  unknown key "
         "'zero_optimization.stag'; did you mean 'stage'?\n  unknown key 'zero_optimization.offload_optimizer.devcie'"),
        ({"zero_optimization": {"offload_optimizer": {"device": "cpu", "super_offload": True}}},
         "zero_optimization.offload_optimizer.super_offload is true: SuperOffload is not implemented; "
         "offload_optimizer.overlap_step runs"),
        ({"torch_autocast": {"enabled": True}}, 'torch_autocast is {"enabled": true}: torch autocast is not '
                                                "implemented"),
        ({"bf16": {"enabled": True, "check_grad_overflow": True}}, "bf16.check_grad_overflow is true"),
        ({"fp16": {"enabled": True, "fp16_master_weights_and_grads": True}},
         "fp16.fp16_master_weights_and_grads is true: fp16 master weights are not implemented"),
        ({"aio": {"use_gds": 0}}, "aio.use_gds is 0: GPUDirect Storage is not implemented"),
        ({"aio": {"use_gds": True}}, "aio.use_gds is true: GPUDirect Storage is not implemented; remove it, or set "
                                     "it to DeepSpeed's default, false"),
        ({"scheduler": {"type": "WarmupLR", "params": {"last_batch_iteration": 99}}},
         "scheduler.params.last_batch_iteration is 99: a schedule resumes with load_checkpoint"),
        ({"zero_optimization": []}, "zero_optimization must be a JSON object"),
        ({"amp": {"enabled": True, "opt_level": "O1"}}, 'amp is {"enabled": true, "opt_level": "O1"}: apex AMP'),
        ({"gradient_predivide_factor": 2.0}, "gradient_predivide_factor is 2.0: gradients are averaged once"),
        ({"zero_optimization": {"offload_optimizer": {"device": "cpu", "ratio": 0.3}}},
         "zero_optimization.offload_optimizer.ratio is 0.3: partial optimizer offload is not implemented"),
        ({"activation_checkpointing": {"partition_activations": True, "cpu_checkpointing": False}},
         'activation_checkpointing is {"partition_activations": true, "cpu_checkpointing": false}: DeepSpeed\'s '
         "activation checkpointing is not implemented"),
        ({"activation_checkpointing": {"number_checkpoints": 4}}, "activation_checkpointing is {\"number_checkpoints\": 4}"),
        ({"checkpoint": {"tag_validation": "Fail"}}, 'checkpoint is {"tag_validation": "Fail"}: DeepSpeed\'s checkpoint'),
        ({"fp16": {"enabled": True, "auto_cast": True}}, "fp16.auto_cast is true: the compute dtype is the config's"),
        ({"bf16": {"enabled": True}, "bfloat16": {"enabled": True}}, "bfloat16 and bf16 are both given"),
        ({"bf16": {"enabled": False, "bf16_optimizer_states": True}, "zero_optimization": {"offload_optimizer": {
            "device": "cpu"}}}, "bf16.bf16_optimizer_states is true but bf16.enabled is not: a section switched off "
                                "sets nothing; for bf16 moments without bf16 compute, set zero_optimization."
                                "offload_optimizer.state_dtype to bfloat16 instead"),
        ({"scheduler": {"type": "OneCycle", "params": {"cycle_min_lr": 1e-5, "cycle_max_lr": 1e-3}}},
         "scheduler.type must be one of ['WarmupLR', 'WarmupDecayLR', 'WarmupCosineLR'], got 'OneCycle'"),
        ({"scheduler": {"params": {"cycle_min_lr": 1e-5}, "type": "OneCycle"}},  # params first: the type still first
         "scheduler.type must be one of ['WarmupLR', 'WarmupDecayLR', 'WarmupCosineLR'], got 'OneCycle'"),
        ({"optimizer": {"params": {"momentum": 0.9}, "type": "SGD"}}, "optimizer.type must be one of ['Adam', 'AdamW'], "
                                                                     "got 'SGD'"),
        ({"scheduler": {"type": "warmuplr", "params": {"cycle_min_lr": 1e-5}}},  # schedules are named in their case
         "scheduler.type must be one of ['WarmupLR', 'WarmupDecayLR', 'WarmupCosineLR'], got 'warmuplr'"),
        ({"sparse_gradients": True}, "sparse_gradients is true: sparse gradients are not implemented"),
        ({"sparse_gradients": {"enabled": False}}, 'sparse_gradients is {"enabled": false}'),  # DeepSpeed: a dict is true
        ({"fp32_allreduce": True}, "fp32_allreduce is true: gradients are reduced in the compute dtype"),
        ({"elasticity": {"enabled": True}}, 'elasticity is {"enabled": true}: elastic training is not implemented; '
                                            "remove it, or set it to DeepSpeed's default, false"),
        ({"activation_checkpointing": {"partition_activations": {"enabled": False}}},
         'activation_checkpointing is {"partition_activations": {"enabled": false}}'),
        # A refusal says what to do instead.
        ({"optimizer": {"type": "Lamb"}}, "got 'Lamb'; the CPU Adam (and torch's on the accelerator) is the one "
                                          "optimizer here; Lamb, OneBitAdam and the others are not implemented: use AdamW"),
        ({"scheduler": {"type": "OneCycle"}}, "got 'OneCycle'; OneCycle and LRRangeTest are not implemented: remove the "
                                              "scheduler section and set engine.lr before each step"),
        ({"zero_optimization": {"stage": 0}}, "got 0; DeepSpeed's stage 0 (nothing partitioned) is not implemented: "
                                              "stage 1 computes the same update, and at world size 1 keeps the same state"),
        ({"compile": {"deepcompile": True}}, "compile is {\"deepcompile\": true}: DeepSpeed's compile is not "
                                             "implemented; compile the model after initialize: engine.module.compile()"),
        ({"sequence_parallel_size": 2}, "sequence_parallel_size is 2: sequence parallelism is not implemented"),
        ({"curriculum_learning": {"enabled": True}}, "curriculum_learning is {\"enabled\": true}: curriculum learning"),
        ({"communication_data_type": "fp16"}, "communication_data_type is fp16, but gradients are reduced in the compute "
                                              "dtype, fp32 here; set it to fp32 or remove it"),
    ],
)
def test_bad_configs_name_the_field(data, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        Config.load(data)


def test_a_hint_for_one_refused_value_is_not_given_for_another():
    with pytest.raises(ConfigError) as caught:
        Config.load({"zero_optimization": {"stage": 4}})
    assert str(caught.value) == "zero_optimization.stage must be one of [1, 2, 3], got 4"


def test_auto_values_are_all_named_at_once_with_where_they_are_filled_in():
    """A DeepSpeed config written for Hugging Face, given to offload.initialize:
    every "auto" is named, but for keys offload ignores anyway."""
    data = {"train_micro_batch_size_per_gpu": "auto", "gradient_clipping": "auto", "bf16": {"enabled": "auto"},
            "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": 0.0}},
            "zero_optimization": {"stage": 2, "allgather_bucket_size": "auto"}}
    with pytest.raises(ConfigError) as caught:
        Config.load(data)
    message = str(caught.value)
    assert message.startswith("train_micro_batch_size_per_gpu, gradient_clipping, bf16.enabled, optimizer.params.lr "
                              'are "auto"')
    assert "offload.hf.OffloadTrainer" in message and "allgather_bucket_size" not in message
    data["scheduler"] = {"type": "WarmupLR", "params": {"warmup_num_steps": "auto"}}
    with pytest.raises(ConfigError, match="optimizer.params.lr, scheduler.params.warmup_num_steps are"):
        Config.load(data)


def test_unreadable_files_are_clear(tmp_path):
    with pytest.raises(ConfigError, match="cannot read config"):
        Config.load(str(tmp_path / "missing.json"))
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ConfigError, match="is not valid JSON"):
        Config.load(str(bad))


def test_a_key_given_twice_is_refused_by_name(tmp_path):
    """JSON keeps the last of two; DeepSpeed refuses the file, and so do we,
    wherever the object is nested."""
    twice = tmp_path / "twice.json"
    twice.write_text('{"gradient_clipping": 1.0, "zero_optimization": {"stage": 2, "stage": 3}, '
                     '"gradient_clipping": 0.0}')
    with pytest.raises(ConfigError, match=r"gives the key 'stage' twice in one object; keep one"):
        Config.load(str(twice))
    twice.write_text('{"gradient_clipping": 1.0, "gradient_clipping": 0.0}')
    with pytest.raises(ConfigError, match=r"gives the key 'gradient_clipping' twice"):
        Config.load(str(twice))


def test_deepspeeds_newer_keys_at_their_defaults_are_named_in_the_one_warning():
    """Keys DeepSpeed 0.19 writes into configs, at its defaults: accepted and
    named as tuning only DeepSpeed (or as DeepSpeed features left off)."""
    data = {"dataloader_drop_last": False, "disable_allgather": False, "torch_autocast": {"enabled": False},
            "bf16": {"enabled": True, "immediate_grad_update": True, "check_grad_overflow": False},
            "zero_optimization": {"stage3_module_granularity_threshold": 0, "log_trace_cache_warnings": False,
                                  "stage3_use_all_reduce_for_fetch_params": False,
                                  "offload_optimizer": {"device": "nvme", "nvme_path": "/x", "cpuadam_cores_perc": 0.8,
                                                        "super_offload": False}},
            "aio": {"use_gds": False}, "scheduler": {"type": "WarmupLR", "params": {"last_batch_iteration": -1.0,
                                                                                   "warmup_num_steps": 0}}}
    with pytest.warns(UserWarning) as caught:
        config = Config.load(data)
    (warning,) = caught
    tuning = ", ".join(sorted(["dataloader_drop_last", "disable_allgather", "bf16.immediate_grad_update",
                               "zero_optimization.stage3_module_granularity_threshold",
                               "zero_optimization.log_trace_cache_warnings",
                               "zero_optimization.stage3_use_all_reduce_for_fetch_params",
                               "zero_optimization.offload_optimizer.cpuadam_cores_perc"]))
    at_default = ", ".join(sorted(["torch_autocast", "bf16.check_grad_overflow", "aio.use_gds",
                                   "zero_optimization.offload_optimizer.super_offload",
                                   "scheduler.params.last_batch_iteration"]))
    assert str(warning.message).startswith(f"offload: these settings have no effect here: {tuning} (they tune "
                                           f"DeepSpeed's own internals); {at_default} (DeepSpeed's defaults, for "
                                           f"what is not implemented here)"), str(warning.message)
    assert config.bf16.enabled and config.zero_optimization.offload_optimizer.device == "nvme"


def test_blocks_copied_from_deepspeeds_docs_with_their_features_off_are_accepted():
    """DeepSpeed configs carry these sections and keys at their defaults (off,
    1.0): nothing to do here, so accepted, and named as such."""
    data = {"fp16": {"enabled": True, "auto_cast": False, "loss_scale": 0}, "amp": {"enabled": False},
            "elasticity": {"enabled": False, "max_train_batch_size": 2000}, "gradient_predivide_factor": 1.0,
            "sparse_gradients": False, "fp32_allreduce": False, "sequence_parallel_size": 1,
            "data_efficiency": {"enabled": False, "seed": 1234}, "hybrid_engine": {"enabled": False},
            "compile": {"deepcompile": False, "free_activation": False},
            "activation_checkpointing": {"partition_activations": False, "contiguous_memory_optimization": False,
                                         "cpu_checkpointing": False, "number_checkpoints": None,
                                         "synchronize_checkpoint_boundary": False, "profile": False},
            "checkpoint": {"tag_validation": "WARN", "use_node_local_storage": False},  # DeepSpeed upper-cases it
            "zero_optimization": {"offload_optimizer": {"device": "cpu", "ratio": 1.0}}}
    with pytest.warns(UserWarning) as caught:
        config = Config.load(data)
    (warning,) = caught
    named = ", ".join(sorted(["activation_checkpointing", "amp", "checkpoint", "elasticity", "fp16.auto_cast",
                              "fp32_allreduce", "gradient_predivide_factor", "sparse_gradients",
                              "sequence_parallel_size", "data_efficiency", "hybrid_engine", "compile",
                              "zero_optimization.offload_optimizer.ratio"]))
    assert str(warning.message) == (f"offload: these settings have no effect here: {named} (DeepSpeed's defaults, for "
                                    "what is not implemented here)")
    assert config.fp16.enabled and config.zero_optimization.offload_optimizer.device == "cpu"


def test_the_bf16_sections_old_name_is_read_as_it():
    config = Config.load({"bfloat16": {"enabled": True}, "zero_optimization": {"offload_optimizer": {"device": "cpu"}}})
    assert config.bf16.enabled and config.compute_dtype_name == "bfloat16"


def test_a_whole_number_aio_size_written_as_a_float_is_an_integer():
    config = Config.load({"aio": {"block_size": 1048576.0, "queue_depth": 8.0},
                          "zero_optimization": {"offload_optimizer": {"device": "nvme", "nvme_path": "/x"}}})
    assert config.aio == AioSettings(block_size=1 << 20, queue_depth=8)
    assert type(config.aio.block_size) is int and type(config.aio.queue_depth) is int


def test_reference_documents_every_key():
    keys = {key for key, _, doc in reference()}
    assert "zero_optimization.offload_optimizer.nvme_path" in keys and "aio.queue_depth" in keys
    assert all(doc for key, _, doc in reference() if not key.startswith("aio."))


def test_readme_documents_every_key():
    readme = open(os.path.join(os.path.dirname(__file__), "..", "README.md")).read()
    missing = [key for key, _, _ in reference() if f"`{key}`" not in readme]
    assert not missing, f"README's configuration reference lacks {missing}"


def test_the_readme_lists_every_refused_and_ignored_key():
    readme = open(os.path.join(os.path.dirname(os.path.dirname(__file__)), "README.md")).read()
    for section, keys in list(REFUSED_KEYS.items()) + list(TUNING_KEYS.items()) + list(DEFAULT_ONLY_KEYS.items()):
        for key in keys:
            assert f"`{section + '.' if section else ''}{key}`" in readme, key


def test_deepspeeds_lowercase_optimizer_names_are_accepted():
    assert Config.load({"optimizer": {"type": "adamw"}}).optimizer.type == "AdamW"
    assert Config.load({"optimizer": {"type": "ADAM"}}).optimizer.type == "Adam"


@pytest.mark.parametrize("data,named", [
    ({"zero_optimization": {"overlap_comm": True}}, "zero_optimization.overlap_comm (collectives run synchronously"),
    ({"zero_optimization": {"contiguous_gradients": False}}, "zero_optimization.contiguous_gradients (gradients are always"),
    ({"zero_optimization": {"stage": 3, "reduce_bucket_size": 1000}}, "zero_optimization.reduce_bucket_size (stage 3 reduces"),
    ({"zero_optimization": {"stage": 3, "stage3_prefetch_bucket_size": 10}},
     "zero_optimization.stage3_prefetch_bucket_size (only stage 3 weights off the accelerator"),
    ({"zero_optimization": {"stage": 3, "stage3_max_live_parameters": 10}}, "zero_optimization.stage3_max_live_parameters (it bounds"),
    ({"zero_optimization": {"stage": 3, "offload_param": {"buffer_size": 10**8}}},
     "zero_optimization.offload_param.buffer_size (only stage 3 weights in cpu or nvme"),
    ({"zero_optimization": {"offload_optimizer": {"device": "cpu", "buffer_count": 8}}},
     "zero_optimization.offload_optimizer.buffer_count (it sizes the nvme pipeline"),
    ({"zero_optimization": {"stage": 1, "offload_optimizer": {"device": "cpu", "buffer_count": 8, "overlap_step": True}}},
     "zero_optimization.offload_optimizer.buffer_count (it sizes the nvme pipeline"),
    ({"fp16": {"hysteresis": 4}}, "fp16.hysteresis (fp16 is not enabled"),
    ({"fp16": {"enabled": True, "loss_scale": 128, "loss_scale_window": 10}}, "fp16.loss_scale_window (the loss scale is static"),
    ({"aio": {"queue_depth": 8}}, "aio.queue_depth (no tier is on nvme"),
    ({"aio": {"thread_count": 2, "backend": "aiofiles"},
      "zero_optimization": {"offload_optimizer": {"device": "nvme", "nvme_path": "/x"}}}, "aio.thread_count (the aiofiles backend"),
    ({"aio": {"backend": "aiofiles"}}, "aio.backend (no tier is on nvme"),
    ({"zero_optimization": {"stage": 2, "offload_param": {"pin_memory": True}}},
     "zero_optimization.offload_param.pin_memory (only stage 3 weights in cpu or nvme"),
    ({"zero_optimization": {"offload_optimizer": {"device": "none", "pin_memory": True}}},
     "zero_optimization.offload_optimizer.pin_memory (the optimizer is on the accelerator"),
    ({"optimizer": {"params": {"lr": 0.1}}, "scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": 2000}}},
     "optimizer.params.lr (WarmupDecayLR rises to scheduler.params.warmup_max_lr (unset: 0.001, DeepSpeed's default"),
    ({"optimizer": {"params": {"lr": 0.1}}, "scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": 0.003}}},
     "optimizer.params.lr (WarmupLR rises to scheduler.params.warmup_max_lr (0.003) and never reads it"),
])
def test_a_setting_without_effect_is_named_in_the_one_warning(data, named):
    with pytest.warns(UserWarning) as caught:
        Config.load(data)
    assert len(caught) == 1 and named in str(caught[0].message), [str(w.message) for w in caught]


@pytest.mark.parametrize("data", [
    {"zero_optimization": {"overlap_comm": False, "contiguous_gradients": True, "stage": 2, "reduce_bucket_size": 10}},
    {"zero_optimization": {"stage": 3, "stage3_prefetch_bucket_size": 10, "stage3_max_live_parameters": 100,
                           "offload_param": {"device": "nvme", "nvme_path": "/x", "max_in_cpu": 0, "buffer_count": 4}}},
    {"fp16": {"enabled": True, "hysteresis": 4, "consecutive_hysteresis": True}},
    {"aio": {"queue_depth": 8, "use_direct": False}, "zero_optimization": {"offload_optimizer": {"device": "nvme", "nvme_path": "/x"}}},
    {"aio": {"backend": "aiofiles"}, "zero_optimization": {"offload_optimizer": {"device": "nvme", "nvme_path": "/x",
                                                                                 "pin_memory": True}}},
    {"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu", "pin_memory": True}}},
    {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "buffer_count": 8, "overlap_step": True}}},
    {"communication_data_type": "fp32"}, {"communication_data_type": "BF16", "bf16": {"enabled": True}},  # as here
    # The schedule reads the rate (WarmupLR's default peak), or peaks where it says (Hugging Face fills both alike).
    {"optimizer": {"params": {"lr": 0.1}}, "scheduler": {"type": "WarmupLR"}},
    {"optimizer": {"params": {"lr": 0.1}}, "scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": 2000}}},
    {"optimizer": {"params": {"lr": 0.1}}, "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_max_lr": 0.1,
                                                                                             "total_num_steps": 2000}}},
    {"optimizer": {"params": {"lr": 3e-5}},
     "scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": 3.00000001e-5}}},  # the same rate, printed
])
def test_settings_that_act_are_not_warned_about(data):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        Config.load(data)


def test_nvme_path_can_be_replaced_for_this_machine():
    config = Config.load({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": "/local_nvme"},
                                                "offload_param": {"device": "nvme", "nvme_path": "/local_nvme"}}})
    moved = config.with_nvme_path("/scratch")
    zero = moved.zero_optimization
    assert zero.offload_optimizer.nvme_path == zero.offload_param.nvme_path == "/scratch"
    assert config.zero_optimization.offload_optimizer.nvme_path == "/local_nvme"  # the original is unchanged


def test_an_nvme_path_given_at_load_completes_a_config_naming_none():
    """``nvme_path`` (``initialize``'s, ``offload.init``'s) is applied before the
    config is checked: a config with nvme sections and no path is valid with it."""
    data = {"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme"},
                                  "offload_param": {"device": "nvme"}}}
    with pytest.raises(ConfigError, match="nvme_path is not set"):
        Config.load(data)
    zero = Config.load(data, nvme_path="/scratch").zero_optimization
    assert zero.offload_optimizer.nvme_path == zero.offload_param.nvme_path == "/scratch"
    assert "nvme_path" not in data["zero_optimization"]["offload_param"]  # the caller's dict is unchanged
    with pytest.warns(UserWarning, match="nvme_path='/scratch' has no effect here"):
        assert Config.load({"zero_optimization": {"stage": 2}}, nvme_path="/scratch").zero_optimization.offload_param.device == "none"
    with warnings.catch_warnings(record=True) as caught:  # a section off nvme takes no path: only the argument is named
        warnings.simplefilter("always")
        cpu = Config.load({"zero_optimization": {"offload_optimizer": {"device": "cpu"}}}, nvme_path="/scratch")
    assert [str(w.message) for w in caught] == [
        "offload: nvme_path='/scratch' has no effect here: no tier of this config is on nvme "
        "(zero_optimization.offload_optimizer.device, offload_param.device)"]
    assert cpu.zero_optimization.offload_optimizer.nvme_path is None
