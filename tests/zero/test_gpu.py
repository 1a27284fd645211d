"""On CUDA (skipped without it; benchmarks/gpu_check.sh runs these): the engine
trains like torch.optim.AdamW on an unpartitioned copy, on the GPU, for stages
1-3 and every optimizer and weight tier, in fp32 and bf16, with the copies
between GPU and host on their own streams (Note [transfer protocol])."""

import itertools
import os

import pytest
import torch

import offload

from .harness import batch, config, make_model

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

STEPS = 10
CASES = [(1, o, None, None) for o in ("none", "cpu", "nvme")] + [(2, o, None, None) for o in ("none", "cpu", "nvme")]
CASES += [(3, o, w, None) for o, w in itertools.product(("none", "cpu", "nvme"), ("none", "cpu", "nvme"))]
# The overlapped step: on CUDA its gradient hooks run on autograd's device thread,
# which the simulated device never does. Without clipping every speculated step
# is kept; clipping at 0.5 binds on every step here, so each is rolled back.
CASES += [(2, "cpu", None, "kept"), (2, "nvme", None, "kept"), (3, "nvme", "cpu", "rolled back")]


@pytest.fixture(autouse=True)
def _no_tf32():
    """The fp32 tolerance assumes full fp32 matmuls on both sides; NGC images
    turn TF32 on through the environment (TORCH_ALLOW_TF32_CUBLAS_OVERRIDE)."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def _reference(cfg: dict, accumulation: int) -> torch.nn.Module:
    ref = make_model().cuda()
    p = cfg["optimizer"]["params"]
    opt = torch.optim.AdamW(ref.parameters(), lr=p["lr"], betas=tuple(p["betas"]), eps=p["eps"],
                            weight_decay=p["weight_decay"], foreach=False)
    for step in range(STEPS):
        opt.zero_grad()
        for micro in range(accumulation):
            (ref(batch(step, micro, 0).cuda()) / accumulation).backward()
        if cfg["gradient_clipping"]:
            torch.nn.utils.clip_grad_norm_(ref.parameters(), cfg["gradient_clipping"])
        opt.step()
    return ref


@pytest.mark.parametrize("stage,device,param_device,overlap", CASES)
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.usefixtures("worker_finishes_its_queue")  # counts what the worker stepped
def test_cuda_matches_adamw(tmp_path, stage, device, param_device, overlap, precision):
    accumulation = 2
    extra = {"bf16": {"enabled": True}} if precision == "bf16" else {}
    if overlap:
        extra["offload_optimizer"] = {"overlap_step": True}
    if overlap == "kept":
        extra["gradient_clipping"] = 0.0
    cfg = config(stage, device, accumulation, str(tmp_path), param_device=param_device, **extra)
    ref = _reference(cfg, accumulation)
    with offload.initialize(make_model().cuda(), cfg) as engine:
        assert engine.device.type == "cuda"
        for step in range(STEPS):
            for micro in range(accumulation):
                engine.backward(engine(batch(step, micro, 0).cuda()))
                engine.step()
        if overlap == "kept":
            assert engine.update.kept > 0 and engine.update.rollbacks == 0
        elif overlap == "rolled back":
            assert engine.update.kept == 0 and engine.update.rollbacks > 0
        state = {k: v.cpu() for k, v in engine.state_dict().items()}
    ref_state = {k: v.cpu() for k, v in ref.state_dict().items()}
    tolerance = 1e-4 if precision == "fp32" else 1.5e-2  # GPU kernels (TF32 off) and bf16 compute
    assert max((state[k].float() - ref_state[k].float()).abs().max().item() for k in ref_state) < tolerance
    assert os.listdir(tmp_path) == []


def test_a_meta_built_model_lands_on_the_local_ranks_gpu(tmp_path):
    from offload.models.gpt import GPT, SIZES

    cfg = config(3, "cpu", 1, param_device="cpu")
    with offload.init(cfg):
        model = GPT(SIZES["tiny"])
    with offload.initialize(model, cfg, init_fn=model.init_module) as engine:
        assert engine.device == torch.device("cuda", torch.cuda.current_device())
        loss = engine(torch.randint(0, 256, (2, 33), device=engine.device))
        engine.backward(loss)
        engine.step()
        assert torch.isfinite(loss)


@pytest.mark.parametrize("device", ["cpu", "nvme"])
def test_only_what_crosses_the_bus_is_pinned(tmp_path, device):
    """Note [unpinned state]: gradients come down into pinned memory and weights
    go up from it; the optimizer state, which never crosses, is not pinned."""
    with offload.initialize(make_model().cuda(), config(2, device, 1, str(tmp_path))) as engine:
        engine.backward(engine(batch(0, 0, 0).cuda()))
        engine.step()
        store, key = engine.optimizer.store, engine.optimizer._key(0)
        (state,) = store.get([key])
        try:
            assert not state.is_pinned()
        finally:
            store.release([key])
        assert engine.gradient.tensor.is_pinned() and engine.weights.staging.is_pinned()
