"""CPUAdam as a torch.optim.Optimizer: trains a model exactly like torch's
AdamW/Adam, honours param groups, round-trips its state dict (also with
torch's AdamW), drives LR schedulers, and falls back loudly without the
native library."""

import copy
import warnings

import pytest
import torch

from offload import _native
from offload.optim import CPUAdam
from offload.optim import adam as adam_module


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(13, 31), torch.nn.GELU(), torch.nn.Linear(31, 7))


def _batches(steps, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(8, 13, generator=gen), torch.randn(8, 7, generator=gen)) for _ in range(steps)]


def _train(model, opt, batches, scheduler=None):
    for x, y in batches:
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        if scheduler is not None:
            scheduler.step()


def _groups(model, lr):
    first, second = model[0], model[2]
    return [
        {"params": list(first.parameters()), "lr": lr},
        {"params": list(second.parameters()), "lr": lr / 3, "weight_decay": 0.0},
    ]


@pytest.mark.parametrize("adamw_mode,torch_cls", [(True, torch.optim.AdamW), (False, torch.optim.Adam)])
def test_trains_like_torch_with_param_groups(adamw_mode, torch_cls):
    ours, ref = _model(), _model()
    opt = CPUAdam(_groups(ours, 1e-2), lr=1e-2, weight_decay=0.05, adamw_mode=adamw_mode)
    ref_opt = torch_cls(_groups(ref, 1e-2), lr=1e-2, weight_decay=0.05, foreach=False)
    _train(ours, opt, _batches(50))
    _train(ref, ref_opt, _batches(50))
    for a, b in zip(ours.parameters(), ref.parameters()):
        torch.testing.assert_close(a, b)


def test_state_dict_round_trip_continues_identically():
    batches = _batches(20)
    straight, resumed = _model(), _model()
    _train(straight, CPUAdam(straight.parameters(), lr=1e-2, weight_decay=0.01), batches)

    first_half = CPUAdam(resumed.parameters(), lr=1e-2, weight_decay=0.01)
    _train(resumed, first_half, batches[:10])
    restored = _model()
    restored.load_state_dict(resumed.state_dict())
    second_half = CPUAdam(restored.parameters(), lr=1e-2, weight_decay=0.01)
    second_half.load_state_dict(first_half.state_dict())
    _train(restored, second_half, batches[10:])

    for a, b in zip(straight.parameters(), restored.parameters()):
        assert torch.equal(a, b)


def test_state_dict_is_interchangeable_with_torch_adamw():
    model = _model()
    ref_opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _train(model, ref_opt, _batches(5))
    twin = _model()
    twin.load_state_dict(model.state_dict())
    opt = CPUAdam(twin.parameters(), lr=1e-2, weight_decay=0.01)
    opt.load_state_dict(copy.deepcopy(ref_opt.state_dict()))  # else both share exp_avg tensors
    _train(model, ref_opt, _batches(5, seed=2))
    _train(twin, opt, _batches(5, seed=2))
    for a, b in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(a, b)


def test_lr_scheduler_drives_the_learning_rate():
    ours, ref = _model(), _model()
    opt = CPUAdam(ours.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    ref_sched = torch.optim.lr_scheduler.StepLR(ref_opt, step_size=3, gamma=0.5)
    _train(ours, opt, _batches(10), sched)
    _train(ref, ref_opt, _batches(10), ref_sched)
    assert opt.param_groups[0]["lr"] == pytest.approx(1e-2 * 0.5**3)
    for a, b in zip(ours.parameters(), ref.parameters()):
        torch.testing.assert_close(a, b)


def test_bad_construction_is_refused():
    params = _model().parameters()
    with pytest.raises(ValueError, match="beta2"):
        CPUAdam(params, betas=(0.9, 1.5))
    with pytest.raises(ValueError, match="threads must be an int in"):
        CPUAdam(_model().parameters(), threads=0)


def test_fallback_warns_once_and_gives_the_same_result(monkeypatch):
    native_model, fallback_model = _model(), _model()
    _train(native_model, CPUAdam(native_model.parameters(), lr=1e-2, weight_decay=0.01), _batches(5))

    monkeypatch.setattr(_native, "status", lambda: _native.NativeStatus(False, "simulated: library missing"))
    monkeypatch.setattr(adam_module, "_warned", False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _train(fallback_model, CPUAdam(fallback_model.parameters(), lr=1e-2, weight_decay=0.01), _batches(5))
    messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(messages) == 1 and "simulated: library missing" in messages[0]
    for a, b in zip(native_model.parameters(), fallback_model.parameters()):
        assert torch.equal(a, b)
