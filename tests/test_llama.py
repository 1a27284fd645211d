"""The bundled Llama architecture: Llama-2-7B's parameter count, the same
logits as Hugging Face's LlamaForCausalLM given the same weights (when
transformers is installed), and training through the engine at stage 3 with
every tier on NVMe exactly like torch's AdamW."""

import os

import pytest
import torch

import offload
from offload import _native
from offload.models.llama import Llama, LlamaConfig

from .zero.harness import config, max_difference, train_engine, train_reference

SMALL = LlamaConfig(n_layer=2, n_head=2, n_embd=16, intermediate=40, vocab_size=61, block_size=12)


def test_the_default_is_llama_2_7b():
    assert LlamaConfig().params() == 6_738_415_616
    with offload.init(config(3, "cpu", 1, param_device="cpu")):
        model = Llama(LlamaConfig())  # on meta: nothing allocated
    assert [p.numel() for p in model.parameters()] == LlamaConfig().param_sizes()


def test_logits_equal_hugging_faces_llama():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    ours = Llama(SMALL)
    with torch.no_grad():
        for weight in ours.parameters():
            weight.normal_(std=0.5)  # large enough that attention, and so the rotary positions, shape the logits
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=SMALL.vocab_size, hidden_size=SMALL.n_embd, intermediate_size=SMALL.intermediate,
        num_hidden_layers=SMALL.n_layer, num_attention_heads=SMALL.n_head, num_key_value_heads=SMALL.n_head,
        max_position_embeddings=SMALL.block_size, rms_norm_eps=1e-5, rope_theta=SMALL.rope_theta,
        tie_word_embeddings=False, attn_implementation="sdpa"))
    names = {"tok.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
             "head.weight": "lm_head.weight"}
    for i in range(SMALL.n_layer):
        for ours_name, hf_name in (("attn_norm", "input_layernorm"), ("mlp_norm", "post_attention_layernorm"),
                                   ("q", "self_attn.q_proj"), ("k", "self_attn.k_proj"), ("v", "self_attn.v_proj"),
                                   ("o", "self_attn.o_proj"), ("gate", "mlp.gate_proj"), ("up", "mlp.up_proj"),
                                   ("down", "mlp.down_proj")):
            names[f"blocks.{i}.{ours_name}.weight"] = f"model.layers.{i}.{hf_name}.weight"
    hf.load_state_dict({names[k]: v for k, v in ours.state_dict().items()}, strict=True)
    tokens = torch.randint(0, SMALL.vocab_size, (3, SMALL.block_size))
    with torch.no_grad():
        torch.testing.assert_close(ours.logits(tokens), hf(tokens).logits, rtol=1e-4, atol=1e-4)


@pytest.mark.skipif(not _native.status().available, reason="native library not built")
def test_trains_at_stage_3_on_nvme_like_adamw(tmp_path):
    def model():
        torch.manual_seed(0)
        return Llama(SMALL)

    cfg = config(3, "nvme", 2, str(tmp_path), param_device="nvme")
    ref = train_reference(model(), 5, 1, 2, cfg)
    with train_engine(model(), 5, 2, cfg) as engine:
        assert max_difference(engine.state_dict(), ref) < 1e-5
    assert os.listdir(tmp_path) == []
