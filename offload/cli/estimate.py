"""``offload estimate``: memory per tier and traffic per step, for every setup.

For a model (a parameter count, or a Hugging Face config.json for exact shapes) on
N GPUs: first the ZeRO paper's model-state bytes per GPU for stages 1-3, then,
for every stage x optimizer tier x weight tier this engine supports, the bytes
per GPU (per rank), CPU and NVMe (per node), with the engine's buffers sized
from --config, whether that fits the given memory, and the bytes moved per
step between host and GPU and to the disk. Activations and the framework's
own memory are not included: leave headroom for them. With --trainable (a
LoRA's adapters), only that many parameters have a gradient and optimizer
state; the weights are the whole model's.
"""

from __future__ import annotations

import argparse
import json
import os

import torch

from offload import Config
from offload.config import nvme_sections, read_json
from offload.cli.args import gpt_config, memory_size, parameter_count, positive_int
from offload.errors import UsageError
from offload.estimate import TIER_NAMES, TIERS, ModelShape, all_setups, estimate, verdicts, zero_model_states
from offload.models.gpt import SIZES, size_name
from offload.optim.state_format import MASTER_DTYPES, STATE_DTYPES, StateFormat
from offload.report import human_count

FORMATS = [("float32", "float32"), ("float32", "bfloat16"), ("bfloat16", "bfloat16"), ("float32", "int8"),
           ("bfloat16", "int8")]  # (master, moments)


def add_parser(commands: argparse._SubParsersAction) -> None:
    p = commands.add_parser("estimate", help="memory per tier and traffic per step for every ZeRO/offload setup",
                            description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(p)
    p.add_argument("--gpus", type=positive_int, default=1, help="data-parallel ranks (GPUs) in all (default 1)")
    p.add_argument("--nodes", type=positive_int, default=1, help="nodes the GPUs are spread over (default 1)")
    p.add_argument("--accelerator", choices=("gpu", "cpu"), default="gpu",
                   help="what computes: a GPU (default), or the CPU itself, where stages 1-2 write new weights into "
                        "the model's with no staging copy")
    p.add_argument("--gpu-mem", type=memory_size, default=None, help="memory per GPU, e.g. 80GiB")
    p.add_argument("--cpu-mem", type=memory_size, default=None, help="host memory per node, e.g. 512GiB")
    p.add_argument("--nvme-free", type=memory_size, default=None, help="free NVMe space per node, e.g. 2TiB")
    p.add_argument("--stage", type=int, choices=(1, 2, 3), default=None, help="only this stage")
    p.add_argument("--config", default=None, help="engine config for dtype and buffer sizes (default: bf16, defaults)")
    p.add_argument("--state-dtype", choices=sorted(STATE_DTYPES), default=None,
                   help="Adam moments' dtype off the accelerator (default: the config's, else float32)")
    p.add_argument("--master-dtype", choices=sorted(MASTER_DTYPES), default=None,
                   help="master weights' dtype off the accelerator (default: the config's, else float32)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(run=run)


def add_model_arguments(p: argparse.ArgumentParser) -> None:
    model = p.add_mutually_exclusive_group(required=True)
    model.add_argument("--params", type=parameter_count, help="parameter count, e.g. 13B")
    model.add_argument("--model-config", help="a Hugging Face model's config.json or its directory (exact shapes; "
                       "needs transformers), a bundled GPT's model-config JSON (n_layer, n_head, n_embd, block_size, "
                       "vocab_size), or a bundled size name")
    p.add_argument("--trainable", type=parameter_count, default=None,
                   help="parameters trained, of the model's (a LoRA's adapters, e.g. 40M): the rest are frozen, "
                        "with weights but no gradient or optimizer state (default: all)")


def model_shape(args: argparse.Namespace) -> ModelShape:
    if args.params is not None:
        shape = ModelShape.from_count(args.params)
    elif not os.path.exists(args.model_config) and size_name(args.model_config) is None:
        raise UsageError(_no_model_config(args.model_config))
    elif is_hf_config(args.model_config):
        shape = ModelShape.from_hf_config(args.model_config)
    else:
        shape = ModelShape.from_config(gpt_config(args.model_config))
    if args.trainable is not None and not 0 < args.trainable <= shape.params:
        raise UsageError(f"--trainable {args.trainable:,} must be between 1 and the model's {shape.params:,} parameters")
    return shape.with_trainable(args.trainable)


def _no_model_config(choice: str) -> str:
    """What a --model-config that names nothing here most likely meant."""
    if choice.count("/") == 1 and not choice.startswith((".", "/", "~")) and not choice.endswith(".json"):
        return (f"--model-config {choice!r} does not exist here, and a Hugging Face Hub id is not downloaded: fetch "
                f"its config first (huggingface_hub.hf_hub_download({choice!r}, 'config.json')) and pass that file")
    if os.sep in choice or choice.endswith(".json"):
        return f"--model-config {choice!r}: no such file or directory"
    return (f"--model-config {choice!r} is not a bundled size ({', '.join(SIZES)}), nor a Hugging Face model "
            "directory or config.json, nor a bundled GPT's model-config JSON here")


def is_hf_config(choice: str) -> bool:
    """A model directory, or a JSON file that names its ``model_type`` as Hugging Face configs do."""
    if os.path.isdir(choice):
        return True
    try:
        with open(choice) as f:
            values = json.load(f)
    except (OSError, ValueError):
        return False  # gpt_config says what is wrong with it
    return isinstance(values, dict) and "model_type" in values


def load_config(path: str | None) -> Config:
    if path is None:
        return Config.load({"bf16": {"enabled": True}})
    data = read_json(path)
    # The figures need no disk: a config that leaves its swap directory to the command line still loads.
    unset = isinstance(data, dict) and any(not section.get("nvme_path") for _, section in nvme_sections(data))
    return Config.load(data if unset else path, "(estimate: no disk used)" if unset else None)  # its errors name the file


def run(args: argparse.Namespace) -> int:
    if args.gpus % args.nodes:
        raise UsageError(f"--gpus {args.gpus} is not a multiple of --nodes {args.nodes}; give the same GPUs per node")
    on_cpu = args.accelerator == "cpu"
    if on_cpu and args.gpu_mem is not None:
        raise UsageError("--gpu-mem sizes a GPU, but --accelerator cpu computes on the CPU, whose bytes are host "
                         "memory: give the node's memory as --cpu-mem alone")
    shape, config = model_shape(args), load_config(args.config)
    state_dtype, master_dtype = args.state_dtype or config.state_dtype, args.master_dtype or config.master_dtype
    rows = []
    for setup in all_setups(args.stage):
        e = estimate(shape, setup, config, args.gpus, args.nodes, state_dtype, master_dtype,
                     host_accelerator=on_cpu)
        rows.append((e, verdicts(e, args.gpu_mem, args.cpu_mem, args.nvme_free, host_accelerator=on_cpu)))
    paper = zero_model_states(shape.params, args.gpus, trained=shape.trained)
    if args.json:
        print(json.dumps({"params": shape.params, "trainable": shape.trained, "shape": shape.source, "gpus": args.gpus,
                          "nodes": args.nodes, "accelerator": args.accelerator,
                          "compute_dtype": config.compute_dtype_name, "state_dtype": state_dtype,
                          "master_dtype": master_dtype,
                          "optimizer_bytes_per_param": {f"{master} master, {moments} moments":
                                                        StateFormat.named(moments, master).bytes_per_element
                                                        for master, moments in FORMATS},
                          "limits": {"gpu_mem": args.gpu_mem, "cpu_mem": args.cpu_mem, "nvme_free": args.nvme_free},
                          "zero_model_states_per_gpu": paper,
                          # fits: null for a tier used without its size; with --accelerator cpu, the device's
                          # bytes are judged in host (device is true)
                          "setups": [{**e.to_json(), "fits": fits} for e, fits in rows]}, indent=1))
    else:
        print(report(shape, args, config, f"{master_dtype} master, {state_dtype} moments", paper, rows))
    return 0


def gb(n: float) -> str:
    return f"{n / 1e9:.1f} GB" if n >= 1e8 or n == 0 else f"{n / 1e6:.1f} MB"


def report(shape: ModelShape, args, config: Config, state_format: str, paper: dict, rows: list) -> str:
    trained = "" if shape.trainable is None else f", {shape.trained / 1e6:.4g}M of them trained"
    ranks = f"{args.gpus} GPU(s)" if args.accelerator == "gpu" else f"{args.gpus} rank(s) computing on the CPU"
    if args.accelerator == "gpu" and not torch.cuda.is_available():
        ranks += " (this machine has none: --accelerator cpu estimates training on its CPU)"
    lines = [f"offload estimate: {human_count(shape.params)} parameters ({shape.source}{trained}), {ranks} on "
             f"{args.nodes} node(s), {config.compute_dtype_name} compute, "
             f"accumulation {config.batch(args.gpus).accumulation}", "",
             "ZeRO model states per GPU (paper formulas, mixed-precision Adam): "
             + " | ".join(f"{k.replace('stage', 'stage ')} {gb(v)}" for k, v in paper.items()),
             "Optimizer state off the accelerator, bytes per parameter (--master-dtype, --state-dtype): "
             + ", ".join(f"{master} master and {moments} moments {StateFormat.named(moments, master).bytes_per_element:.3g}"
                         for master, moments in FORMATS)
             + f" (a bf16 master counts only beside stage 3 weights on nvme or on the GPU: elsewhere it is the "
             f"weights' own host copy); below: {state_format}", ""]
    on_cpu = args.accelerator == "cpu"
    header = f"{'setup':38}{'accel/rank' if on_cpu else 'GPU/rank':>11}{'CPU/node':>11}{'NVMe/node':>11}  {'fits':18}{'PCIe/step':>11}{'disk r/step':>13}{'disk w/step':>13}"
    lines += [header, "-" * len(header)]
    for e, verdict in rows:
        short = [TIER_NAMES[t] for t in TIERS if verdict[t] is False]
        unknown = [TIER_NAMES[t] for t in TIERS if verdict[t] is None]
        fits = "no: " + ",".join(short) if short else f"{','.join(unknown)} unknown" if unknown else "yes"
        if all(limit is None for limit in (args.gpu_mem, args.cpu_mem, args.nvme_free)):
            fits = "-"
        lines.append(f"{e.setup.name:38}{gb(e.rank_total('device')):>11}{gb(e.node['host']):>11}{gb(e.node['nvme']):>11}  "
                     f"{fits:18}{gb(e.pcie_bytes_per_step):>11}{gb(e.disk_read_per_step):>13}{gb(e.disk_written_per_step):>13}")
    accelerator = ("accel/rank (the accelerator's share, here host memory, which fits counts for every rank with "
                   "CPU/node against --cpu-mem)" if on_cpu else "GPU/rank")
    sizes = "--cpu-mem, --nvme-free" if on_cpu else "--gpu-mem, --cpu-mem, --nvme-free"
    lines += ["", f"GB = 10^9 bytes. {accelerator} includes this engine's buffers (gradient buckets, gathered "
              "weights); activations are not included. PCIe is per rank, disk per node. fits: against the sizes "
              f"given ({sizes}); 'unknown' names a tier used without one."]
    return "\n".join(lines)
