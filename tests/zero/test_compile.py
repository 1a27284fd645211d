"""A model compiled after ``initialize`` (Note [stage 3 under torch.compile])
trains as AdamW on an eager copy does, at stage 2 and at stage 3 with every
weight on NVMe, with its graphs compiled, and evaluates as the eager one;
a compiled module handed to ``initialize`` is refused by name."""

import inspect

import pytest
import torch
from torch._dynamo.eval_frame import _debug_get_cache_entry_list

import offload
from offload import _native
from offload.errors import UsageError
from offload.zero import stage3

from .harness import batch, config, make_model, max_difference, train_reference

pytestmark = pytest.mark.skipif(not _native.status().available, reason="native library not built")

STEPS = 3
TOLERANCE = 1e-5  # the equivalence tolerance; measured: 1.5e-7


@pytest.mark.parametrize("stage", [2, 3])
def test_a_model_compiled_after_initialize_trains_as_adamw(tmp_path, stage):
    cfg = config(stage, "cpu", 1, str(tmp_path), param_device="nvme" if stage == 3 else None)
    if stage == 3:
        cfg["zero_optimization"]["stage3_param_persistence_threshold"] = 0  # every parameter partitioned
    ref = train_reference(make_model(), STEPS, 1, 1, cfg)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()  # reset() leaves the counts of earlier tests
    with offload.initialize(make_model(), cfg) as engine:
        engine.module.compile()
        for step in range(STEPS):
            engine.backward(engine(batch(step, 0, 0)))
            engine.step()
        assert torch._dynamo.utils.counters["stats"]["unique_graphs"] > 0
        assert max_difference(engine.state_dict(), ref) < TOLERANCE
    # The hooks ran eagerly: Dynamo compiled nothing of their wrapper (traced, it recompiled per signature).
    assert _debug_get_cache_entry_list(inspect.unwrap(stage3._eager.__call__).__code__) == []


def test_a_compiled_layer_that_reads_its_submodules_weights_first_evaluates_at_stage_3(tmp_path):
    """nn.TransformerEncoderLayer in eval mode looks at its attention's weights
    before that module's forward gathers them (its fast-path checks): what
    Dynamo reads of them then is metadata, which a partitioned weight has."""
    results = []
    for compiled in (False, True):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.TransformerEncoderLayer(32, 4, 64, batch_first=True, dropout=0.0))
        cfg = config(3, "cpu", 1, param_device="cpu")
        cfg["zero_optimization"]["stage3_param_persistence_threshold"] = 0
        torch._dynamo.reset()
        with offload.initialize(model, cfg) as engine:
            if compiled:
                engine.module.compile()
            x = torch.randn(2, 5, 32, generator=torch.Generator().manual_seed(1))
            engine.backward(engine(x).sum())
            engine.step()
            engine.eval()
            with torch.no_grad():
                results.append(engine(x))
    assert torch.equal(results[0], results[1])


def test_a_compiled_module_is_refused_by_initialize():
    with pytest.raises(UsageError, match=r"torch.compile'd module.* model.compile\(\)"):
        offload.initialize(torch.compile(make_model()), config(2, "cpu", 1))
