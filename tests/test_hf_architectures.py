"""Hugging Face architectures that use their parameters in unusual ways,
built from tiny configs, trained at stage 3 with every weight on NVMe and
nothing kept gathered, against AdamW on a copy: tied and transposed
weights, relative-position tables, a layer called several times, a head
reading its children's weights (MobileBERT), latents returned as a view
(Perceiver), convolutions, state-space layers; ``generate`` after training
for a decoder and an encoder-decoder."""

import copy

import pytest
import torch

import offload
from offload import _native

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.skipif(not _native.status().available, reason="native library not built")

STEPS = 3
TOLERANCE = 1e-5  # as tests/zero/test_stage3.py
BATCH, LENGTH, VOCAB = 2, 8, 100
LM = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
          max_position_embeddings=64)


def _tokens(g: torch.Generator, length: int = LENGTH) -> torch.Tensor:
    return torch.randint(3, VOCAB, (BATCH, length), generator=g)


def _causal(g):
    x = _tokens(g)
    return {"input_ids": x, "labels": x}


def _masked(g):
    x = _tokens(g)
    labels = x.clone()
    labels[:, ::2] = -100
    return {"input_ids": x, "labels": labels}


def _seq2seq(g):
    return {"input_ids": _tokens(g), "labels": _tokens(g, 6)}


def _image(g):
    return {"pixel_values": torch.randn(BATCH, 3, 32, 32, generator=g), "labels": torch.randint(0, 3, (BATCH,), generator=g)}


def _speech(g):
    return {"input_features": torch.randn(BATCH, 16, 32, generator=g), "labels": _tokens(g, 6)}


def _latents(g):
    batch = _masked(g)
    return {"inputs": batch.pop("input_ids"), **batch}


MODELS = {
    "gpt2": (lambda t: t.GPT2LMHeadModel(t.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64)),
             _causal),
    "llama": (lambda t: t.LlamaForCausalLM(t.LlamaConfig(**LM, num_key_value_heads=2)), _causal),
    "t5": (lambda t: t.T5ForConditionalGeneration(t.T5Config(
        vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, relative_attention_num_buckets=8,
        decoder_start_token_id=0, pad_token_id=0)), _seq2seq),
    "whisper": (lambda t: t.WhisperForConditionalGeneration(t.WhisperConfig(
        vocab_size=VOCAB, num_mel_bins=16, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_source_positions=16,
        max_target_positions=32, decoder_start_token_id=1, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        suppress_tokens=None, begin_suppress_tokens=None)), _speech),
    "mobilebert": (lambda t: t.MobileBertForMaskedLM(t.MobileBertConfig(
        vocab_size=VOCAB, hidden_size=32, embedding_size=16, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=64, intra_bottleneck_size=16, true_hidden_size=16, num_feedforward_networks=2,
        max_position_embeddings=64)), _masked),
    "perceiver": (lambda t: t.PerceiverForMaskedLM(t.PerceiverConfig(
        num_latents=4, d_latents=32, d_model=32, num_blocks=1, num_self_attends_per_block=2,
        num_self_attention_heads=4, num_cross_attention_heads=4, vocab_size=VOCAB, max_position_embeddings=LENGTH,
        qk_channels=32, v_channels=32)), _latents),
    "albert": (lambda t: t.AlbertForMaskedLM(t.AlbertConfig(**{**LM, "num_hidden_layers": 3}, embedding_size=16)),
               _masked),
    "deberta-v2": (lambda t: t.DebertaV2ForMaskedLM(t.DebertaV2Config(
        **LM, relative_attention=True, position_buckets=8, pos_att_type=["p2c", "c2p"])), _masked),
    "vit": (lambda t: t.ViTForImageClassification(t.ViTConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, image_size=32, patch_size=8,
        num_labels=3)), _image),
    "mamba": (lambda t: t.MambaForCausalLM(t.MambaConfig(
        vocab_size=VOCAB, hidden_size=32, state_size=8, num_hidden_layers=2, time_step_rank=4, intermediate_size=64)),
              _causal),
}


def _without_dropout(model: torch.nn.Module) -> torch.nn.Module:
    """The same architecture with every dropout probability 0 (some modules copy
    the rate when built, so the model is built again from the changed config)."""
    config = copy.deepcopy(model.config)
    for part in [config, *(getattr(config, sub) for sub in ("encoder", "decoder", "text_config", "vision_config")
                           if isinstance(getattr(config, sub, None), transformers.PretrainedConfig))]:
        for key, value in vars(part).items():
            if isinstance(value, float) and any(word in key.lower() for word in ("dropout", "pdrop", "drop_prob")):
                setattr(part, key, 0.0)
    torch.manual_seed(0)
    return type(model)(config)


@pytest.mark.parametrize("name", MODELS)
def test_a_hugging_face_architecture_trains_at_stage_3_as_adamw(tmp_path, name):
    build, make_batch = MODELS[name]
    model = _without_dropout(build(transformers))
    ref = copy.deepcopy(model)
    cfg = {"train_micro_batch_size_per_gpu": BATCH, "gradient_clipping": 1.0,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.01}},
           "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                                 "offload_optimizer": {"device": "cpu"},
                                 "offload_param": {"device": "nvme", "nvme_path": str(tmp_path), "max_in_cpu": 0}}}
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01, foreach=False)
    g = torch.Generator().manual_seed(1)
    batches = [make_batch(g) for _ in range(STEPS)]
    with offload.initialize(model, cfg) as engine:
        for batch in batches:
            loss = engine(**batch).loss
            engine.backward(loss)
            engine.step()
            expected = ref(**batch).loss
            expected.backward()
            torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
            opt.step()
            opt.zero_grad()
            assert abs(loss.item() - expected.item()) < TOLERANCE, name
        state, ref_state = engine.state_dict(), ref.state_dict()
        assert max((state[k] - v).abs().max().item() for k, v in ref_state.items() if v.is_floating_point()) < TOLERANCE
        if name in ("gpt2", "t5"):  # generate calls the model itself, once per new token
            prompt = {"input_ids": batches[0]["input_ids"], "max_new_tokens": 4, "do_sample": False}
            with torch.no_grad():
                assert torch.equal(engine.module.generate(**prompt), ref.generate(**prompt))


@pytest.mark.parametrize("stage", [2, 3])
def test_bf16_runs_a_rotary_model_as_hugging_face_loads_it_in_bf16(tmp_path, stage):
    """Note [buffers in low precision]: the rotary frequencies stay fp32, as
    from_pretrained(dtype=torch.bfloat16) keeps them, so the engine computes
    the logits of the model a user loads from its export."""
    model = _without_dropout(MODELS["llama"][0](transformers))
    model.save_pretrained(tmp_path / "hf")
    loaded = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.bfloat16)
    assert loaded.model.rotary_emb.inv_freq.dtype == torch.float32
    x = _tokens(torch.Generator().manual_seed(1), length=48)  # far enough along for rounded frequencies to show
    cfg = {"train_micro_batch_size_per_gpu": BATCH, "bf16": {"enabled": True},
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
           "zero_optimization": {"stage": stage, "offload_optimizer": {"device": "cpu"},
                                 **({"offload_param": {"device": "cpu"}} if stage == 3 else {})}}
    with offload.initialize(model, cfg) as engine, torch.no_grad():
        assert torch.equal(engine(input_ids=x).logits, loaded(input_ids=x).logits)


def test_bf16_runs_sinusoidal_positions_in_bf16():
    """Note [buffers in low precision]: XGLM's positions, a non-persistent
    buffer added to bf16 activations, run in bf16 (kept fp32, they widen the
    hidden states, which the bf16 layers then refuse)."""
    model = transformers.XGLMForCausalLM(transformers.XGLMConfig(
        vocab_size=VOCAB, d_model=32, num_layers=2, attention_heads=4, ffn_dim=64, max_position_embeddings=64))
    cfg = {"train_micro_batch_size_per_gpu": BATCH, "bf16": {"enabled": True},
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
           "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}
    with offload.initialize(model, cfg) as engine:
        assert model.model.embed_positions.weights.dtype == torch.bfloat16
        x = _tokens(torch.Generator().manual_seed(1))
        engine.backward(engine(input_ids=x, labels=x))
        engine.step()


@pytest.mark.parametrize("stage", [2, 3])
def test_a_pretrained_body_under_a_head_built_on_meta_keeps_every_value(stage):
    """Note [a model partly on meta], with the model's own initialiser: GPT-2's
    attention and MLP blocks own no tensors, and their _init_weights writes
    their children's (c_proj), which hold loaded values here."""
    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=96, n_positions=16, num_labels=3)
    torch.manual_seed(0)
    body = {k: v.clone() for k, v in transformers.GPT2ForSequenceClassification(cfg).state_dict().items()
            if not k.startswith("score")}
    with torch.device("meta"):
        model = transformers.GPT2ForSequenceClassification(cfg)
    model.load_state_dict({k: v.clone() for k, v in body.items()}, strict=False, assign=True)  # body: to compare
    zero = {"stage": stage, "offload_optimizer": {"device": "cpu"}, "stage3_param_persistence_threshold": 0}
    with offload.initialize(model, {"zero_optimization": zero}) as engine:
        state = engine.state_dict()
        changed = [k for k, v in body.items() if k in state and not torch.equal(state[k], v.float())]
        assert not changed
        score = state["score.weight"]
        assert torch.isfinite(score).all() and 0.5 * cfg.initializer_range < score.std() < 2 * cfg.initializer_range


def test_a_loaded_model_whose_rotary_buffers_are_on_meta_computes_them():
    """Every parameter loaded with assign=True leaves Llama's non-persistent
    rotary frequencies on meta, which no state dict restores: they are
    computed as building the model computes them, the weights untouched."""
    cfg = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                                   num_key_value_heads=2, vocab_size=96, max_position_embeddings=32)
    torch.manual_seed(0)
    eager = transformers.LlamaForCausalLM(cfg)
    weights = {k: v.clone() for k, v in eager.state_dict().items()}
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(cfg)
    model.load_state_dict({k: v.clone() for k, v in weights.items()}, assign=True)  # weights: to compare
    assert any(b.is_meta for b in model.buffers()) and not any(p.is_meta for p in model.parameters())
    with offload.initialize(model, {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}) as e:
        assert all(torch.equal(e.state_dict()[k], v) for k, v in weights.items())
        for (name, got), (_, want) in zip(model.named_buffers(), eager.named_buffers()):
            assert torch.equal(got, want), name
        tokens = torch.randint(0, 96, (2, 8), generator=torch.Generator().manual_seed(1))
        assert torch.allclose(e(tokens).logits, eager(tokens).logits, atol=1e-5)


@pytest.mark.parametrize("stage", [2, 3])
def test_a_meta_built_model_gets_the_initialisation_hugging_face_gives_it(stage):
    """GPT-2's blocks write their children's residual projections (c_proj) with
    a depth-scaled spread after the children's own initialisation: built on
    meta and initialised by offload, each weight has the spread from_config
    gives it, 0.02 / sqrt(2 * 8) = 0.005 for c_proj and 0.02 elsewhere (std
    within 10% of the eager model's, on 4096+ draws); biases and norms exact."""
    cfg = transformers.GPT2Config(n_layer=8, n_embd=64, n_head=2, vocab_size=96, n_positions=64)
    torch.manual_seed(0)
    eager = transformers.GPT2LMHeadModel(cfg).state_dict()
    with torch.device("meta"):
        model = transformers.GPT2LMHeadModel(cfg)
    zero = {"stage": stage, "offload_optimizer": {"device": "cpu"}, "stage3_param_persistence_threshold": 0}
    with offload.initialize(model, {"zero_optimization": zero}) as engine:
        state = engine.state_dict()
    for key, want in eager.items():
        if not want.is_floating_point():
            continue
        got = state[key]
        if want.numel() >= 4096:
            assert abs(got.std() / want.std() - 1) < 0.1, (key, got.std().item(), want.std().item())
        else:
            assert torch.equal(got, want), key


def _switch():
    return transformers.SwitchTransformersForConditionalGeneration(transformers.SwitchTransformersConfig(
        vocab_size=64, d_model=16, d_kv=8, d_ff=32, num_layers=2, num_decoder_layers=2, num_heads=2, num_experts=2,
        encoder_sparse_step=1, decoder_sparse_step=1))


def _gpt2():
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=96,
                                                                n_positions=16))


def _zamba():
    return transformers.ZambaForCausalLM(transformers.ZambaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=6, num_attention_heads=4,
        num_key_value_heads=4, attn_layer_period=2, attn_layer_offset=1, mamba_d_state=4, mamba_d_conv=2,
        mamba_expand=2, n_mamba_heads=2, mamba_dt_rank=4, max_position_embeddings=32, use_mamba_kernels=False))


class _OldStyleConfig(transformers.PretrainedConfig):
    model_type = "offload-test-old-style"


class _OldStyle(transformers.PreTrainedModel):
    """A block writing its child's weight through .data (no version counter
    moves), as much remote code does."""

    config_class = _OldStyleConfig

    def __init__(self, config):
        super().__init__(config)
        self.blocks = torch.nn.ModuleList(torch.nn.ModuleDict({"fc": torch.nn.Linear(8, 8), "proj": torch.nn.Linear(8, 8)})
                                          for _ in range(2))
        self.post_init()

    def _init_weights(self, module):
        if isinstance(module, torch.nn.Linear):
            module.weight.data.normal_(0, 0.02)
            module.bias.data.zero_()
        if isinstance(module, torch.nn.ModuleDict):
            module["proj"].weight.data.normal_(0, 0.001)

    def forward(self, x):
        for block in self.blocks:
            x = block["proj"](block["fc"](x))
        return x.sum()


@pytest.mark.parametrize("build", [_gpt2, _switch, _zamba, lambda: _OldStyle(_OldStyleConfig())],
                         ids=["gpt2", "switch", "zamba", "old-style"])
def test_stage_3_hands_on_a_weight_only_after_every_initialiser_that_writes_it(build):
    """GPT-2's blocks write their children's projections, SwitchTransformers'
    sparse MLP its experts' and router's (grandchildren), old-style code
    through .data: at stage 3 each parameter is partitioned as soon as it is
    complete, so it must wait for them. Trying the initialiser on the meta
    model first must draw nothing (Zamba's draws on the CPU). The same seed
    gives stage 3 what stage 2, which partitions nothing while initialising,
    gets; a weight handed on too early was written after it was partitioned
    (an error)."""
    states = []
    for stage in (2, 3):
        torch.manual_seed(0)
        with torch.device("meta"):
            model = build()
        zero = {"stage": stage, "offload_optimizer": {"device": "cpu"}, "stage3_param_persistence_threshold": 0}
        with offload.initialize(model, {"zero_optimization": zero}) as engine:
            states.append(engine.state_dict())
        states[-1]["random state after"] = torch.random.get_rng_state()
    assert states[0].keys() == states[1].keys()
    assert all(torch.equal(states[0][k], states[1][k]) for k in states[0])


def test_a_weight_initialised_by_its_own_module_alone_is_handed_on_at_once():
    """No initialiser writes below a module here: each Linear's weights go on
    as soon as it is visited, so no more than one layer exists at a time."""
    from offload.zero.materialize import descendant_writer, materialize

    with torch.device("meta"):
        model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(24)])
    live, peak = set(), []

    def init(module):
        live.update(module.parameters(recurse=False))
        peak.append(len(live))
        module.reset_parameters() if hasattr(module, "reset_parameters") else None

    materialize(model, init, live.discard, descendant_writer(model))
    assert max(peak) == 2 and not live
