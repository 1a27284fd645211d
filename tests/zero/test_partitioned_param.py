"""A stage 3 parameter outside a forward (Note [a parameter without values]):
its metadata reads as the model's own, reading its values is an error naming
it instead of a crash, the engine trains on as before, and ``close()`` gives
each parameter its own class back."""

import pytest
import torch

import offload
from offload import _native
from offload.errors import UsageError
from offload.zero.partitioned_param import hide, reveal

from .harness import batch, config, make_model, train_engine

pytestmark = pytest.mark.skipif(not _native.status().available, reason="native library not built")


def _config(tier: str, nvme: str) -> dict:
    cfg = config(3, "cpu", 1, nvme, param_device=tier)
    cfg["zero_optimization"]["stage3_param_persistence_threshold"] = 0  # every parameter partitioned
    return cfg


def _metadata(p: torch.Tensor) -> tuple:
    return (p.shape, p.dtype, p.device, p.numel(), p.dim(), p.requires_grad, p.is_leaf, p.is_floating_point(),
            p.data.shape, p.detach().dtype, isinstance(p, torch.nn.Parameter))


@pytest.mark.parametrize("tier", ["none", "cpu", "nvme"])
def test_reading_a_partitioned_parameters_values_is_an_error_naming_it(tmp_path, tier):
    original = make_model().blocks[0][0].weight
    engine = train_engine(make_model(), 2, 1, _config(tier, str(tmp_path)))
    w = engine.module.blocks[0][0].weight
    assert w.untyped_storage().nbytes() == 0  # partitioned: what is guarded has nothing behind it
    assert _metadata(w) == _metadata(original)
    reads = {
        "a method": lambda: w.sum(),
        "a torch function": lambda: torch.nn.functional.linear(torch.ones(2, w.shape[1]), w),
        "in a list": lambda: torch.cat([w, w]),
        "through .data": lambda: w.data.norm(),
        "through detach": lambda: w.detach().mean(),
        "through a view": lambda: w.T.clone(),
        "a conversion": lambda: w.to(torch.float64),
        "an in-place change": lambda: w.data.mul_(2),
        "given by keyword": lambda: torch.nn.init.normal_(tensor=w),  # as transformers' initialisation calls it
    }
    for what, read in reads.items():
        with pytest.raises(UsageError, match=r"^blocks\.0\.0\.weight: offload stage 3 keeps it partitioned"):
            read()
    assert repr(w).startswith(f"Parameter(partitioned by offload stage 3, no values here: shape={list(w.shape)}")
    assert format(w) == repr(w)
    # what reads no values goes through: new tensors shaped like it, conversions that change nothing
    assert (torch.zeros_like(w).shape, w.new_zeros(3).shape, w.type()) == (w.shape, (3,), original.type())
    assert engine.module.to(w.device).float() is engine.module and engine.module.blocks[0][0].weight is w
    engine.backward(engine(batch(5, 0, 0)))  # the guard changes nothing the engine does
    engine.step()
    trained = engine.state_dict()
    engine.close()
    assert type(w) is torch.nn.Parameter
    assert torch.equal(w, trained["blocks.0.0.weight"])
    with train_engine(make_model(), 2, 1, _config(tier, str(tmp_path))) as untouched:
        untouched.backward(untouched(batch(5, 0, 0)))
        untouched.step()
        assert all(torch.equal(v, trained[k]) for k, v in untouched.state_dict().items())


class _Tagged(torch.nn.Parameter):
    """A parameter class of the user's own."""


def test_a_parameter_keeps_its_own_class_and_one_left_without_values_stays_guarded(tmp_path):
    model = make_model()
    model.blocks[1][0].weight = _Tagged(model.blocks[1][0].weight.detach().clone())
    tagged = model.blocks[1][0].weight
    with train_engine(model, 1, 1, _config("cpu", str(tmp_path))) as engine:
        assert isinstance(tagged, _Tagged) and type(tagged) is not _Tagged  # guarded while partitioned
        engine.backward(engine(batch(1, 0, 0)))
        engine.step()
    assert type(tagged) is _Tagged and tagged.isfinite().all()
    engine = train_engine(model, 1, 1, _config("cpu", str(tmp_path)))
    engine.close(restore_model=False)  # too big to hold: parameters stay without storage
    with pytest.raises(UsageError, match=r"^blocks\.1\.0\.weight: offload stage 3 keeps it partitioned"):
        tagged.sum()
    with pytest.raises(UsageError, match=r"an earlier stage 3 engine left partitioned \(gain has no values"):
        offload.initialize(model, _config("cpu", str(tmp_path)))


def test_a_parameter_that_dies_partitioned_lends_its_name_to_nothing():
    """An engine never closed leaves its parameters guarded; once they die,
    the tensors that reuse their memory (and so their id) must not be
    reported under their names, as a CI run once reported blocks.0.0.weight's
    ``.data`` as a Llama weight an earlier test had left behind."""
    w = torch.nn.Parameter(torch.zeros(2))
    hide(w, "fresh")
    stale = [torch.zeros(2).as_subclass(torch.Tensor) for _ in range(256)]
    for tensor in stale:
        hide(tensor, "stale")
    freed = {id(tensor) for tensor in stale}
    del stale, tensor
    datas = [w.data for _ in range(256)]  # guarded tensors, allocated where the stale ones were
    reused = [data for data in datas if id(data) in freed]
    assert reused, "no tensor reused a dead one's id: nothing was checked"
    for data in reused:
        with pytest.raises(UsageError, match=r"^fresh: offload stage 3 keeps it partitioned"):
            data.sum()
    reveal(w)
