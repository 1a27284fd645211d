"""offload: ZeRO-Offload / ZeRO-Infinity training for PyTorch.

Training state lives in tiers (accelerator, pinned host memory, NVMe files) and
moves just before it is needed. The public API is what this module exports:

    engine = offload.initialize(model, "config.json")   # or a dict, or a Config
    loss = loss_fn(engine(batch))
    engine.backward(loss)
    engine.step()
"""

from __future__ import annotations

import contextlib
import os
import warnings

__version__ = "0.1.0"


def initialize(model, config: str | os.PathLike | dict | Config | None = None, init_fn=None, *,
               nvme_path: str | os.PathLike | None = None, weights: str | os.PathLike | None = None,
               allow_missing: bool = False, param_groups=None, model_parameters=None, **deepspeed_only) -> Engine:
    """Wrap ``model`` (its parameters on the accelerator or the CPU, or on the
    meta device when built under ``offload.init``) in an Engine configured by a
    DeepSpeed-style JSON file, dict or Config. ``init_fn(module)`` initialises
    a meta-built module's own parameters (default: its ``reset_parameters``,
    then, for a Hugging Face model, the model's ``_init_weights``, as
    ``from_config`` initialises it).
    ``nvme_path`` replaces every ``nvme_path`` of the config (a shipped config
    names ``/local_nvme``; point it at a directory on this machine's disk).
    ``weights``: a safetensors file or model directory loaded into the engine
    (``load_weights``, with ``allow_missing``); a meta-built module it fully
    covers needs no initialiser of its own. ``param_groups``: the weight
    decay, learning rate, betas and eps of each parameter, as a torch
    optimizer's groups or DeepSpeed's ``model_parameters`` give them, e.g.
    ``[{"params": decayed}, {"params": norms_and_biases, "weight_decay":
    0.0}]``; a group without one of those keys takes the config's, a group's
    rate follows the schedule in proportion, and all other settings are the
    config's (Note [parameter groups]; default: every parameter takes the
    config's); ``model_parameters``, DeepSpeed's name for them, is read as
    ``param_groups``. DeepSpeed's other arguments are refused, each saying
    where its job went here."""
    _refuse_deepspeed_only(deepspeed_only)
    if model_parameters is not None:
        if param_groups is not None:
            raise UsageError("param_groups and model_parameters are both given: model_parameters is DeepSpeed's name "
                             "for param_groups; pass one")
        param_groups = model_parameters
    if config is None:
        raise UsageError("offload.initialize needs a config: a DeepSpeed-style JSON path, a dict or a Config "
                         "(config=...)")
    _say_if_no_optimizer(config)
    config = Config.load(config, nvme_path)
    _nvme_path_exists(config, nvme_path)
    if weights is None:
        return Engine(model, config, init_fn, param_groups)
    weights = os.fspath(weights)
    on_meta = is_meta(model)
    init_fn = init_covering(model, weights, init_fn or model_init(model)) if on_meta else init_fn
    engine = Engine(model, config, init_fn, param_groups)
    try:
        load_weights(engine, weights, allow_missing)
    except BaseException:
        # The user's own model gets its parameters and dtypes back, usable as before; one built on meta
        # may be too big to hold whole, and the user never had it.
        engine.close(restore_model=not on_meta)
        raise
    return engine


# deepspeed.initialize's arguments that offload.initialize does not take -> what to do instead.
_NO_LOADER = "offload makes no data loader: iterate your own and call engine(batch)"
_OWN_GROUP = "offload joins the torch.distributed group that torchrun describes (or none) by itself"
_DEEPSPEED_ONLY = {
    "optimizer": "the optimizer is the config's optimizer section (Adam or AdamW, stepped on the CPU by offload's own "
                 "kernel): give its settings there, and per-group ones as param_groups",
    "lr_scheduler": "the schedule is the config's scheduler section (WarmupLR, WarmupDecayLR, WarmupCosineLR), or "
                    "set engine.lr before each step",
    **dict.fromkeys(("training_data", "collate_fn"), _NO_LOADER),
    "config_params": "it is DeepSpeed's old name for config: pass config=",
    "args": "DeepSpeed reads the config's path from args.deepspeed_config; pass config= (a path, a dict or a Config)",
    "mpu": "model parallelism is not implemented",
    **dict.fromkeys(("dist_init_required", "distributed_port"), _OWN_GROUP),
    "mesh_param": "model and sequence parallelism are not implemented",
}


def _refuse_deepspeed_only(given: dict) -> None:
    given = {name: value for name, value in given.items() if value is not None}  # DeepSpeed's defaults: nothing asked
    if not given:
        return
    known = [f"{name}= ({_DEEPSPEED_ONLY[name]})" for name in given if name in _DEEPSPEED_ONLY]
    unknown = [name for name in given if name not in _DEEPSPEED_ONLY]
    if unknown:
        raise TypeError(f"offload.initialize() got unexpected keyword arguments {unknown}")
    raise UsageError("offload.initialize does not take " + "; ".join(known))


@contextlib.contextmanager
def init(config: str | os.PathLike | dict | Config | None = None, *, nvme_path: str | os.PathLike | None = None):
    """Build a model too big to materialise::

        with offload.init(config):
            model = MyModel()
        engine = offload.initialize(model, config, init_fn=...)

    Inside, modules are created on the meta device (no memory). With stage 3,
    ``initialize`` then materialises one module at a time and turns each
    parameter into its partition in its tier as soon as it is initialised;
    with stages 1 and 2 it materialises the whole model first. ``nvme_path``:
    as ``initialize``'s.
    """
    if config is not None:  # fail here, before building anything; initialize, given it too, says what has no effect
        _nvme_path_exists(Config.load(config, nvme_path, warn=False), nvme_path)
    with meta_device():
        yield


def _say_if_no_optimizer(config) -> None:
    """A config file or dict without an optimizer section trains with the
    defaults, at a rate nobody chose: DeepSpeed builds no optimizer from
    such a config, so a script written for it expects to give its own."""
    data = read_json(config) if isinstance(config, (str, os.PathLike)) else config
    if isinstance(data, dict) and "optimizer" not in data:
        p = AdamParams()
        warnings.warn(f"offload.initialize: the config has no optimizer section, so the engine steps AdamW with "
                      f"lr {p.lr}, betas {tuple(p.betas)}, eps {p.eps} and weight_decay {p.weight_decay} (offload's "
                      "defaults); give an optimizer section to choose them", UserWarning, stacklevel=outside_offload())


def _nvme_path_exists(config: Config, nvme_path: str | os.PathLike | None) -> None:
    """The ``nvme_path`` argument, named as the caller gave it (the engine names a config's own)."""
    if nvme_path is not None and any(section.device == "nvme" for section in (
            config.zero_optimization.offload_optimizer, config.zero_optimization.offload_param)) \
            and not os.path.isdir(nvme_path):
        raise UsageError(f"nvme_path={os.fspath(nvme_path)!r} is not an existing directory; create it, or pass one "
                         "that exists")


from offload.config import AdamParams, Config, read_json  # noqa: E402  (after __version__, for the CLI's cheap import)
from offload.errors import ConfigError, OffloadError, UsageError, outside_offload  # noqa: E402
from offload.engine import Engine  # noqa: E402
from offload.load_weights import from_pretrained, init_covering, load_weights  # noqa: E402
from offload.signals import exit_on_signals  # noqa: E402
from offload.zero.materialize import is_meta, meta_device, model_init  # noqa: E402

__all__ = ["Config", "ConfigError", "Engine", "OffloadError", "exit_on_signals", "from_pretrained", "init", "initialize",
           "load_weights"]
