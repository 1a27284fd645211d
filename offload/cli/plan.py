"""``offload plan``: measure this machine and write a config for a model size.

Measures the GPU memory (if there is a GPU), the available RAM, and, with
--nvme-path, the free space there and its swap speed (a short store
read/write, as ``offload bench swap`` does). Then it walks the setups from
the fastest (everything on the GPU) to the most offloaded (Infinity: weights,
optimizer and gradients on NVMe) and takes the first whose ``offload
estimate`` fits with headroom, writes it as a config, and says why in a few lines.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import math
import os
import shutil
import tempfile
from dataclasses import dataclass

import psutil
import torch

from offload import Config
from offload.cli import bench_swap
from offload.cli.args import memory_size, output_file, positive_int
from offload.cli.estimate import add_model_arguments, is_hf_config, model_shape
from offload.destinations import unwritable
from offload.errors import UsageError
from offload.optim.state_format import MASTER_DTYPES, STATE_DTYPES
from offload.estimate import Estimate, ModelShape, Setup, check_fits, estimate
from offload.report import human_count
from offload.store import AioSettings

# Fraction of each tier a plan may fill: the rest is for activations beyond micro-batch 1 (on the accelerator,
# and in RAM without a GPU), and on the disk for what else it holds.
HEADROOM = {"device": 0.8, "host": 0.8, "nvme": 0.9}
# Note [a process's own RAM]
# Beside the estimate, a training process holds what torch's import takes (the
# plan measures its own process for it), and, measured with a 58M and a 134M
# Llama at stage 3 with everything on NVMe (peak RSS against the engine's own
# report), about 125 MB that does not grow with the model (building the
# model class, activations and autograd's temporaries at micro-batch 1,
# thread stacks), and what glibc keeps after it is freed: 142-155 MB and
# 339-392 MB, 0.21-0.39 of the 680 and 998 MB the engine held in RAM (freed
# blocks, which a step's tensors leave below live ones, are at most what was
# once live, so they are counted in proportion to it, not to the parameters).
# MALLOC_TRIM_THRESHOLD_=0 in the process's environment gives that back, at a
# cost in step time (benchmarks/host_allocator.py: 0.38x the memory beside
# the engine's, 1.15x the step, for the 25M GPT here), so a plan made with it
# set (or MALLOC_MMAP_THRESHOLD_) does not count it. All of it was measured
# with the CPU computing, where activations and the step's churn of freed
# tensors are host memory; with a GPU they are on it, and the host holds
# long-lived state (pinned by CUDA, not glibc's), so only the import and the
# 128 MiB are counted there, unmeasured. A plan that left all of this out
# promised 1.03 GB and ran at 1.55 GB.
FRAMEWORK_BYTES = 128 << 20  # per rank
GIVES_BACK = ("MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_")  # glibc settings that return freed memory
KEPT_BY_GLIBC = 0.4  # of what the engine holds in RAM
SUB_GROUPS = (100_000_000, 25_000_000, 5_000_000)  # smaller sub-groups shrink the pinned pool
IN_CPU = (0.75, 0.5, 0.25, 0.0)  # weights on nvme: the share of each rank's part kept in host memory (max_in_cpu)
# Stage 3 weights off the accelerator: elements uploaded ahead of their module (DeepSpeed's default first); a
# smaller bucket holds less on the accelerator, and 0 reads nothing ahead.
PREFETCH = (50_000_000, 10_000_000, 0)

# From the least to the most data moved per step: (stage, optimizer, weights, gradients on nvme).
LADDER = [
    (2, "none", "none", False), (2, "cpu", "none", False), (3, "cpu", "none", False), (3, "cpu", "cpu", False),
    (2, "nvme", "none", False), (3, "nvme", "none", False), (3, "nvme", "cpu", False), (3, "nvme", "nvme", False),
    (3, "nvme", "nvme", True),
]


@dataclass
class Machine:
    gpus: int
    gpu_mem: int | None  # per GPU; None: no GPU, the accelerator is the CPU
    cpu_mem: int  # available now
    nvme_free: int | None  # None: no --nvme-path
    read_gbps: float | None = None
    write_gbps: float | None = None
    process_bytes: int = 400 << 20  # RSS of a process that imported torch and offload: Note [a process's own RAM]
    glibc_keeps: bool = True  # freed memory, as with glibc's defaults: Note [a process's own RAM]


def add_parser(commands: argparse._SubParsersAction) -> None:
    p = commands.add_parser("plan", help="measure this machine and write a recommended config for a model size",
                            description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(p)
    p.add_argument("--nvme-path", default=None, help="directory on the NVMe disk to consider (and measure)")
    p.add_argument("--gpus", type=positive_int, default=None, help="ranks on this node (default: the GPUs present, else 1)")
    p.add_argument("--bench-size", type=memory_size, default=256 << 20, help="bytes for the swap measurement (default 256MiB)")
    p.add_argument("--out", type=output_file, default="offload_config.json", help="where to write the config (default offload_config.json)")
    p.add_argument("--state-dtype", choices=sorted(STATE_DTYPES), default="float32",
                   help="Adam moments' dtype off the accelerator: bfloat16 stores 8 bytes per parameter instead of "
                        "12, int8 6 (neither is bitwise AdamW; default float32)")
    p.add_argument("--master-dtype", choices=sorted(MASTER_DTYPES), default="float32",
                   help="master weights' dtype off the accelerator: bfloat16 stores them in 2 bytes per parameter, "
                        "rounded stochastically (not bitwise AdamW; default float32)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(run=run)


def measure_machine(nvme_path: str | None, gpus: int | None, bench_size: int) -> Machine:
    cuda = torch.cuda.is_available()
    count = gpus or (torch.cuda.device_count() if cuda else 1)
    gpu_mem = torch.cuda.get_device_properties(0).total_memory if cuda else None
    # This process's own memory is the training's once it ends: available then, and what a process like it holds.
    own = psutil.Process().memory_full_info().uss
    machine = Machine(count, gpu_mem, psutil.virtual_memory().available + own, None, process_bytes=own,
                      glibc_keeps=not any(k in os.environ for k in GIVES_BACK))
    if nvme_path is not None:
        if not os.path.isdir(nvme_path):
            raise UsageError(f"--nvme-path {nvme_path!r} is not a directory; create it first")
        why = unwritable(nvme_path)
        if why:
            raise UsageError(f"--nvme-path {nvme_path!r}: cannot write there to measure it ({why}); pick another")
        machine.nvme_free = shutil.disk_usage(nvme_path).free
        with tempfile.TemporaryDirectory(prefix="offload-plan-", dir=nvme_path) as scratch:
            speed = bench_swap.measure(scratch, min(bench_size, machine.nvme_free // 4), AioSettings())
        machine.read_gbps, machine.write_gbps = speed["read_gbps"], speed["write_gbps"]
    return machine


def config_for(step: tuple, sub_group: int, in_cpu: int, nvme_path: str | None, bf16: bool,
               formats: dict[str, str] | None = None, prefetch: int = PREFETCH[0]) -> dict:
    """``in_cpu``: with weights on nvme, the elements of each rank's part kept in host memory.
    ``formats``: ``state_dtype`` and ``master_dtype`` of an offloaded optimizer, if not float32.
    ``prefetch``: stage 3's prefetch bucket, written only where it is not the default."""
    stage, optimizer, weights, grads_on_nvme = step
    offload_optimizer = {"device": optimizer}
    if optimizer != "none":
        offload_optimizer.update({k: v for k, v in (formats or {}).items() if v != "float32"})
    if optimizer == "nvme":
        offload_optimizer.update(nvme_path=nvme_path, buffer_count=4, gradients_on_nvme=grads_on_nvme)
    zero = {"stage": stage, "sub_group_size": sub_group, "offload_optimizer": offload_optimizer}
    if stage == 3 and prefetch != PREFETCH[0]:
        zero["stage3_prefetch_bucket_size"] = prefetch
    if stage == 3:
        zero["offload_param"] = {"device": weights, **({"nvme_path": nvme_path, "max_in_cpu": in_cpu}
                                                        if weights == "nvme" else {})}
    return {"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": bf16},
            "zero_optimization": zero}


def fits(e: Estimate, machine: Machine) -> bool:
    """Within headroom, the RAM counting the processes' own (``ram_needed``);
    without a GPU the accelerator's memory is the host's."""
    usable = {t: None if v is None else HEADROOM[t] * v for t, v in
              (("device", machine.gpu_mem), ("host", machine.cpu_mem), ("nvme", machine.nvme_free))}
    check_fits(e, usable["device"], None, usable["nvme"] if machine.nvme_free is not None else 0)
    e.fits["host"] = ram_needed(e, machine) <= usable["host"]
    return all(e.fits.values())


def ram_needed(e: Estimate, machine: Machine) -> float:
    """What the engine holds in RAM and the processes' own: Note [a process's own RAM]."""
    return engine_ram(e, machine) + process_ram(e, machine)


def engine_ram(e: Estimate, machine: Machine) -> float:
    """The node's host bytes, and without a GPU its ranks' accelerator bytes too (the same RAM)."""
    return e.node["host"] + (e.rank_total("device") * machine.gpus if machine.gpu_mem is None else 0)


def process_ram(e: Estimate, machine: Machine) -> float:
    return machine.gpus * (machine.process_bytes + FRAMEWORK_BYTES) + kept_by_glibc(e, machine)


def kept_by_glibc(e: Estimate, machine: Machine) -> float:
    return KEPT_BY_GLIBC * engine_ram(e, machine) if machine.glibc_keeps and machine.gpu_mem is None else 0


def choose(shape: ModelShape, machine: Machine, nvme_path: str | None,
           formats: dict[str, str] | None = None) -> tuple[dict, Estimate] | None:
    """The first setup of LADDER (with the largest sub-group) that fits, as (config, estimate)."""
    bf16 = computes_in_bf16(machine, formats)
    owned = max(1, math.ceil(shape.params / machine.gpus))
    for step in LADDER:
        if "nvme" in step[1:3] and machine.nvme_free is None:
            continue
        # The NVMe pool holds buffer_count sub-groups: for a small shard, an eighth of it keeps the pool small.
        sub_groups = sorted({min(g, owned) for g in SUB_GROUPS} | {min(math.ceil(owned / 8), SUB_GROUPS[0])},
                            reverse=True)
        shares = IN_CPU if step[2] == "nvme" else IN_CPU[-1:]
        prefetches = PREFETCH if step[2] != "none" else PREFETCH[:1]
        for share, prefetch, sub_group in itertools.product(shares, prefetches,
                                                            sub_groups if step[1] == "nvme" else sub_groups[:1]):
            raw = config_for(step, sub_group, int(share * owned), nvme_path, bf16, formats, prefetch)
            e = estimate(shape, Setup(step[0], step[1], step[2]), Config.load(raw), machine.gpus,
                         host_accelerator=machine.gpu_mem is None)
            if fits(e, machine):
                return raw, e
    return None


def computes_in_bf16(machine: Machine, formats: dict[str, str] | None) -> bool:
    """On a GPU; on the CPU only for a bf16 master, which is the bf16 compute weights."""
    return machine.gpu_mem is not None or (formats or {}).get("master_dtype") == "bfloat16"


COMPACT = {"state_dtype": "int8", "master_dtype": "bfloat16"}  # 4 bytes a parameter of optimizer state, not 12


def run(args: argparse.Namespace) -> int:
    shape = model_shape(args)
    machine = measure_machine(args.nvme_path, args.gpus, args.bench_size)
    nvme_path = os.path.abspath(args.nvme_path) if args.nvme_path else None
    formats = {"state_dtype": args.state_dtype, "master_dtype": args.master_dtype}
    chosen = choose(shape, machine, nvme_path, formats)
    if chosen is None:
        said = nothing_fits(shape, machine, nvme_path, formats)
        print(json.dumps({"config": None, "why": said.splitlines(), "machine": machine.__dict__}, indent=1)
              if args.json else said)
        return 1
    raw, e = chosen
    with open(args.out, "w") as f:
        json.dump(raw, f, indent=2)
        f.write("\n")
    why = explain(shape, machine, e, raw)
    if args.json:
        print(json.dumps({"config": raw, "config_path": args.out, "why": why, "machine": machine.__dict__,
                          "estimate": e.to_json(), "ram_bytes": ram_needed(e, machine)}, indent=1))
    else:
        bundled = args.model_config is not None and not is_hf_config(args.model_config)
        launch = f"torchrun --nproc_per_node {machine.gpus} -m " if machine.gpus > 1 else ""
        use = f"{launch}offload train --config {args.out} --model {args.model_config}" if bundled else \
            f'engine = offload.initialize(model, "{args.out}")' + (
                f" in a script started with torchrun --nproc_per_node {machine.gpus}" if machine.gpus > 1 else "")
        print("\n".join(why + [f"wrote {args.out}; use it: {use}"]))
    return 0


def nothing_fits(shape: ModelShape, machine: Machine, nvme_path: str | None, formats: dict[str, str]) -> str:
    """What the most offloaded setup needs against what is here, and what would make it fit."""
    need, compact_need = (_most_offloaded(shape, machine, nvme_path, f) for f in (formats, COMPACT))
    ram = ram_needed(need, machine)
    disk = (f"{machine.nvme_free / 1e9:.1f} GB free on disk" if machine.nvme_free is not None else
            "no disk: pass --nvme-path DIR to consider one")
    lines = [f"offload plan: no setup fits {human_count(shape.params)} parameters here: even with everything on NVMe "
             f"it needs {ram / 1e9:.1f} GB of RAM and {need.node['nvme'] / 1e9:.1f} GB on disk, against "
             f"{machine.cpu_mem / 1e9:.1f} GB of RAM available and {disk} (a plan uses at most "
             f"{HEADROOM['host']:.0%} of the RAM and {HEADROOM['nvme']:.0%} of the disk)."]
    giving_back = dataclasses.replace(machine, glibc_keeps=False)
    trim = ("glibc giving back the memory it keeps after freeing, at about 1.15x the step time "
            "(benchmarks/host_allocator.py)", "MALLOC_TRIM_THRESHOLD_=0 in the environment of plan and of the training")
    compact = ("the compact optimizer state (not bitwise AdamW)", "--state-dtype int8 --master-dtype bfloat16")
    for ways, on in (([trim], giving_back), ([compact], machine), ([compact, trim], giving_back)):
        if (compact in ways and formats == COMPACT) or (trim in ways and not kept_by_glibc(need, machine)):
            continue
        fitting = choose(shape, on, nvme_path, COMPACT if compact in ways else formats)
        if fitting is not None:
            lines.append(f"It fits as {fitting[1].setup.name} with {' and '.join(w for w, _ in ways)}: rerun with "
                         f"{' and '.join(how for _, how in ways)}.")
            return "\n".join(lines)
    short = []
    if machine.gpu_mem is not None and need.rank_total("device") > HEADROOM["device"] * machine.gpu_mem:
        short.append(f"{need.rank_total('device') / HEADROOM['device'] / 1e9:.1f} GB of GPU memory per rank")
    if ram > HEADROOM["host"] * machine.cpu_mem:
        short.append(f"{ram / HEADROOM['host'] / 1e9:.1f} GB of RAM available")
    if machine.nvme_free is None or need.node["nvme"] > HEADROOM["nvme"] * machine.nvme_free:
        compact_room = (f" ({compact_need.node['nvme'] / HEADROOM['nvme'] / 1e9:.0f} GB with --state-dtype int8 "
                        "--master-dtype bfloat16)" if formats != COMPACT else "")
        short.append(f"a disk with {need.node['nvme'] / HEADROOM['nvme'] / 1e9:.0f} GB free{compact_room}, passed "
                     "as --nvme-path")
    if short:
        lines.append(f"It would fit with {' and '.join(short)}; or split the model over more nodes (offload estimate "
                     "--nodes N --gpus M says what each node needs).")
    return "\n".join(lines)


def _most_offloaded(shape: ModelShape, machine: Machine, nvme_path: str | None, formats: dict[str, str]) -> Estimate:
    placeholder = nvme_path or os.path.join(tempfile.gettempdir(), "nvme")  # estimated, never written
    raw = config_for(LADDER[-1], SUB_GROUPS[-1], 0, placeholder, computes_in_bf16(machine, formats), formats,
                     PREFETCH[-1])
    return estimate(shape, Setup(3, "nvme", "nvme"), Config.load(raw), machine.gpus,
                    host_accelerator=machine.gpu_mem is None)


def explain(shape: ModelShape, machine: Machine, e: Estimate, raw: dict) -> list[str]:
    own = ["torch", *(["micro-batch 1's activations"] if machine.gpu_mem is None else []),
           *(["what glibc keeps after freeing"] if kept_by_glibc(e, machine) else [])]
    total = e.bytes_per_param * shape.params
    accelerator = f"{machine.gpus} GPU(s) of {machine.gpu_mem / 1e9:.0f} GB" if machine.gpu_mem else "no GPU (the CPU computes)"
    disk = ""
    if machine.nvme_free is not None:
        disk = (f", {machine.nvme_free / 1e9:.0f} GB free on NVMe reading {machine.read_gbps:.2f} and writing "
                f"{machine.write_gbps:.2f} GB/s")
    lines = [f"{human_count(shape.params)} parameters need {total / 1e9:.1f} GB of training state at "
             f"{e.bytes_per_param:.3g} bytes each "
             f"(weights, gradients and optimizer state, in the config's dtypes); "
             f"this machine has {accelerator}, {machine.cpu_mem / 1e9:.1f} GB RAM available{disk}.",
             f"chosen: {e.setup.name}, the least offloaded setup that fits with headroom: per rank "
             f"{e.rank_total('device') / 1e9:.2f} GB on the accelerator{'' if machine.gpu_mem else ' (this RAM)'}; per node {e.node['host'] / 1e9:.2f} GB host, "
             f"{e.node['nvme'] / 1e9:.2f} GB NVMe; with the processes' own {process_ram(e, machine) / 1e9:.2f} GB "
             f"({', '.join(own)}), "
             f"{ram_needed(e, machine) / 1e9:.2f} GB of RAM in all."]
    if kept_by_glibc(e, machine):
        lines.append(f"glibc keeps about {kept_by_glibc(e, machine) / 1e9:.2f} GB of freed memory; "
                     "MALLOC_TRIM_THRESHOLD_=0 in the training's environment gives it back, at about 1.15x the step "
                     "time (benchmarks/host_allocator.py), and plan run with it set counts on that.")
    if e.setup.stage == 3:
        lines.append(f"beyond these figures, engine.close() gives the model back whole, {4 * shape.params / 1e9:.2f} GB "
                     "in fp32 on the accelerator; where that does not fit, save a checkpoint and close it with "
                     "restore_model=False, as offload train does.")
    prefetch = raw["zero_optimization"].get("stage3_prefetch_bucket_size", PREFETCH[0])
    if prefetch != PREFETCH[0]:
        lines.append(f"stage3_prefetch_bucket_size {prefetch:,}, not DeepSpeed's {PREFETCH[0]:,}, which would not fit: "
                     + ("fewer weights go up ahead of their module." if prefetch else
                        "no weights go up or are read ahead, so each module waits for its own."))
    if e.disk_read_per_step and machine.read_gbps:
        seconds = e.disk_read_per_step / (machine.read_gbps * 1e9) + e.disk_written_per_step / (machine.write_gbps * 1e9)
        lines.append(f"each step moves {e.disk_read_per_step / 1e9:.1f} GB from and {e.disk_written_per_step / 1e9:.1f} GB "
                     f"to the disk: at least {seconds:.1f} s per step at the measured speed (offload estimate has the rest).")
    if machine.gpu_mem is None and raw["bf16"]["enabled"]:
        lines.append("bf16 compute, as a bf16 master needs: a CPU without bf16 instructions emulates its matmuls, "
                     "slowly.")
    held = "allow for its activations only" if machine.gpu_mem is None else "hold no activations"
    lines.append(f"the config's micro-batch is 1 sequence per rank (train_micro_batch_size_per_gpu): the figures "
                 f"above {held}, so raise it as far as the headroom left allows.")
    return lines
