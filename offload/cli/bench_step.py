"""``offload bench step``: where a training step's time goes, setup against setup.

Trains the bundled GPT of the chosen size (ZeRO stage 2, or 3 with a weight
tier) in several setups at once, taking turns, so every setup sees the same
machine (Note [a turn of two steps]):
  none          everything on the accelerator
  cpu           optimizer state in host memory (ZeRO-Offload)
  cpu+overlap   the same, each sub-group's step during the last backward (overlap_step)
  cpu+dpu       the same, with the one-step delayed update
  nvme          optimizer state in swap files
  nvme+overlap  the same, with overlap_step
For each, the median step's phases on the critical path (the main thread
waits for them: forward, backward, the gradient copy inside backward, the
optimizer phase ``step()``) and the optimizer work done off it (on a worker,
during backward or the next forward: hidden), the wall time per step
(``wall_s``), the CPU seconds the swap files' CRC-32C checksums took per step
on the I/O threads and in the Adam pass (``checksum_cpu_s``: the I/O threads'
share is beside the critical path but competes with it for cores; the pass's
share is on it wherever the Adam step is), the machine's core-seconds per
step, busy, idle and stolen by a hypervisor (``core_s``, on Linux: Note
[stolen time]; every process's, so a quiet machine matters), means over the
measured steps, which add up to the cores times their mean step
(``core_s_step_s``), and the ratios of the overlapped and
delayed setups to their plain one. Also how long each setup's
``offload.initialize`` took, until its initial state was written
(``initialize_s``), and the bytes that moved over the disk for it. A step's
``bytes_kept`` are the bytes it did not read because a write-back still held
them in its buffer (with ``bytes_read``, one pass over the state).

For nvme, the pipeline efficiency: the least time the disk needs for the
optimizer's own reads and writes of one step (the slower direction's bytes
over its bandwidth, measured in the same run with the same aio settings:
reads and writes may run at once), over the time that I/O took, from the
optimizer's first read to its last write-back's completion (measured in
extra steps that start no read during backward and wait for the last
write-back). It cannot exceed 1 but by measurement noise; 1.0 means the
I/O ran at the disk's speed throughout.

Note [a turn of two steps]
An engine's step returns with its last write-backs in flight (they finish
during its next forward), and a delayed update runs during the next forward
too. Setups taking turns a step at a time made each setup's forward pay for
the previous setup's tail and left its own tail to the next one: in
``cpu,nvme,nvme+overlap`` the plain nvme step's write-backs ran during the
overlapped step's forward. So a turn is two steps of one setup: the first
is not measured and leaves the tail that the second's forward overlaps, as
in training; after the second, the turn waits for that setup's write-backs,
so the next setup starts on a quiet disk.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
import warnings

import torch

import offload
from offload import _native
from offload.cli import bench_swap, cpu_times
from offload.cli.args import model_name, positive_int
from offload.cli.progress import Progress
from offload.config import Config
from offload.errors import ConfigError, UsageError
from offload.models.gpt import GPT, SIZES
from offload.store import AioSettings
from offload.store.aio import checksum_seconds

SETUPS = {  # name -> (optimizer tier, offload_optimizer extras)
    "none": ("none", {}),
    "cpu": ("cpu", {}),
    "cpu+overlap": ("cpu", {"overlap_step": True}),
    "cpu+dpu": ("cpu", {"delayed_update": True, "delayed_update_warmup": 1}),
    "nvme": ("nvme", {}),
    "nvme+overlap": ("nvme", {"overlap_step": True}),
}
PLAIN = {"cpu+overlap": "cpu", "cpu+dpu": "cpu", "nvme+overlap": "nvme"}


def add_parser(benchmarks: argparse._SubParsersAction) -> None:
    p = benchmarks.add_parser("step", help="training step time on the critical path and hidden, setup against setup",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=model_name, choices=sorted(SIZES), default="25M",
                   help="bundled GPT size, in any case (default 25M)")
    p.add_argument("--setups", default=",".join(SETUPS), help=f"comma-separated, of {', '.join(SETUPS)} (default all)")
    p.add_argument("--stage", type=int, choices=(2, 3), default=2, help="ZeRO stage (default 2)")
    p.add_argument("--offload-param", choices=("none", "cpu", "nvme"), default="none",
                   help="stage 3: weight partition tier (default none)")
    p.add_argument("--nvme-path", default=None, help="directory for swap files (default: a temporary directory)")
    p.add_argument("--steps", type=positive_int, default=5,
                   help="measured steps, each after an unmeasured one of its setup, after 2 warm-up turns (default 5)")
    p.add_argument("--batch-size", type=positive_int, default=4)
    p.add_argument("--sub-group-size", type=positive_int, default=2_000_000, help="elements per optimizer sub-group")
    p.add_argument("--buffer-count", type=positive_int, default=8,
                   help="nvme setups: offload_optimizer.buffer_count, the sub-groups the pipeline (and overlap_step) "
                        "may hold in host memory at once (default 8)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    if not _native.status().available:
        raise UsageError(f"the native library is unavailable: {_native.status().reason}")
    setups = [s.strip() for s in args.setups.split(",") if s.strip()]
    unknown = [s for s in setups if s not in SETUPS]
    if unknown or not setups:
        raise UsageError(f"--setups: unknown {unknown or '(none given)'}; choose among {', '.join(SETUPS)}")
    if args.offload_param != "none" and args.stage != 3:
        raise UsageError("--offload-param needs --stage 3 (only stage 3 partitions the weights)")
    for setup in setups:  # a setup these arguments rule out fails now, not after the others have been built
        try:
            with warnings.catch_warnings():  # said when the setup's engine is built
                warnings.simplefilter("ignore")
                Config.load(_config(args, setup, args.nvme_path or tempfile.gettempdir()))
        except ConfigError as exc:
            raise UsageError(f"--setups {setup}: {exc}") from None
    with tempfile.TemporaryDirectory(prefix="offload-bench-step-", dir=args.nvme_path) as nvme:
        result = {"model": args.model, "params": SIZES[args.model].params(), "stage": args.stage,
                  "offload_param": args.offload_param, "setups": measure(args, setups, nvme)}
        if "nvme" in result["setups"]:
            disk = bench_swap.measure(nvme, min(12 * result["params"], 1 << 30), aio_settings())
            io = result["setups"]["nvme"]["io"]
            result["disk_read_gbps"], result["disk_write_gbps"] = disk["read_gbps"], disk["write_gbps"]
            # The slower direction bounds the time: reads and writes may run at once.
            result["disk_seconds"] = max(io["bytes_read"] / (disk["read_gbps"] * 1e9),
                                         io["bytes_written"] / (disk["write_gbps"] * 1e9))
            result["pipeline_efficiency"] = result["disk_seconds"] / io["window"]
        result["ratios"] = {f"{name} / {plain}": result["setups"][name]["wall_s"] / result["setups"][plain]["wall_s"]
                            for name, plain in PLAIN.items() if name in result["setups"] and plain in result["setups"]}
    print(json.dumps(result, indent=2) if args.json else report(result))
    return 0


def hidden_fraction(setup: dict) -> float:
    """The share of a setup's optimizer work done off the critical path;
    unclamped: below 0, waiting for it cost more than it hid."""
    work = setup["optimizer_work"]
    return 1 - setup["critical"]["optimizer"] / work if work else 0.0


def aio_settings() -> AioSettings:
    return AioSettings(block_size=8 << 20, queue_depth=32, thread_count=1)


def _config(args: argparse.Namespace, setup: str, nvme: str) -> dict:
    device, extras = SETUPS[setup]
    a = aio_settings()
    offload_optimizer = {"device": device, **extras}
    if device == "nvme":
        offload_optimizer.update(nvme_path=nvme, buffer_count=args.buffer_count)
    zero = {"stage": args.stage, "sub_group_size": args.sub_group_size, "offload_optimizer": offload_optimizer}
    if args.stage == 3:
        zero["offload_param"] = {"device": args.offload_param}
        if args.offload_param == "nvme":
            zero["offload_param"].update(nvme_path=nvme, max_in_cpu=0)
    else:
        zero["reduce_bucket_size"] = args.sub_group_size  # buckets reduce as backward goes, so sub-groups complete during it
    cfg = {"optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "zero_optimization": zero}
    if "nvme" in (device, args.offload_param):
        cfg["aio"] = {"block_size": a.block_size, "queue_depth": a.queue_depth, "thread_count": a.thread_count}
    return cfg


def _turn(engine, tokens: torch.Tensor) -> dict:
    """Note [a turn of two steps]: the second step's timings, and the CPU the
    swap files' checksums took and the bytes they moved per step, averaged
    over the turn's two steps, whose I/O lies wholly inside it (a step
    returns with its last write-backs in flight)."""
    checksums = checksum_seconds()
    before = engine.disk_traffic()
    _one_step(engine, tokens)
    row = _one_step(engine, tokens)
    engine.synchronize()
    row["checksums"] = (checksum_seconds() - checksums) / 2
    row.update({k: v / 2 for k, v in (engine.disk_traffic() - before)._asdict().items()})
    return row


def _one_step(engine, tokens: torch.Tensor) -> dict:
    copy_before = engine.reducer.seconds
    cores = cpu_times.now()
    t0 = time.perf_counter()
    loss = engine(tokens)
    t1 = time.perf_counter()
    engine.backward(loss)
    t2 = time.perf_counter()
    engine.step()
    t3 = time.perf_counter()
    cores = cpu_times.now() - cores if cores is not None else None
    step_s = t3 - t2
    return {"wall": t3 - t0, "forward": t1 - t0, "backward": t2 - t1, "gradient_copy": engine.reducer.seconds - copy_before,
            "optimizer": step_s, "hidden": engine.times.hidden,
            "optimizer_work": step_s + engine.times.hidden,  # wherever it ran
            "cores": cores}


def measure(args: argparse.Namespace, setups: list[str], nvme: str) -> dict:
    c = SIZES[args.model]
    tokens = torch.randint(0, c.vocab_size, (args.batch_size, c.block_size + 1), generator=torch.Generator().manual_seed(0))
    engines, initialized = {}, {}
    for setup in setups:
        torch.manual_seed(0)
        model = GPT(c)
        start = time.perf_counter()
        engines[setup] = offload.initialize(model, _config(args, setup, nvme))
        engines[setup].synchronize()  # its initial state's writes: Note [a turn of two steps]
        traffic = engines[setup].disk_traffic()
        initialized[setup] = {"initialize_s": time.perf_counter() - start, "initialize_bytes_read": traffic.bytes_read,
                              "initialize_bytes_written": traffic.bytes_written}
    rows: dict[str, list[dict]] = {setup: [] for setup in setups}
    window_steps = args.steps if "nvme" in engines else 0
    bar = Progress((args.steps + 2) * len(setups) + window_steps, "bench step", enabled=not args.json)
    try:
        for i in range(args.steps + 2):
            for setup, engine in engines.items():
                row = _turn(engine, tokens)
                if i >= 2:
                    rows[setup].append(row)
                bar.advance(f"{setup} {row['wall']:.2f}s")
        windows = [_io_window(engines["nvme"], tokens) for _ in range(window_steps)]
        for _ in windows:
            bar.advance("nvme I/O window")
    finally:
        for engine in engines.values():
            engine.close(restore_model=False)
    result = {}
    for setup, got in rows.items():
        med = {k: statistics.median(r[k] for r in got) for k in got[0] if k != "cores"}
        critical = {k: med[k] for k in ("forward", "backward", "gradient_copy", "optimizer")}
        result[setup] = {"wall_s": med["wall"], "critical": critical, "optimizer_work": med["optimizer_work"],
                         "hidden": {"optimizer": med["hidden"]},
                         **{k: med[k] for k in ("bytes_read", "bytes_written", "bytes_kept")},
                         "checksum_cpu_s": med["checksums"], **initialized[setup]}
        result[setup]["hidden_fraction"] = hidden_fraction(result[setup])
        if got[0]["cores"] is not None:  # means, over the mean step: Note [stolen time]
            result[setup]["core_s"] = {k: statistics.fmean(getattr(r["cores"], k) for r in got) for k in cpu_times.CoreSeconds._fields}
            result[setup]["core_s_step_s"] = statistics.fmean(r["wall"] for r in got)
    if windows:
        result["nvme"]["io"] = {k: statistics.median(w[k] for w in windows) for k in windows[0]}
    return result


def _io_window(engine, tokens: torch.Tensor) -> dict:
    """One step of the optimizer's own I/O, from its first read to its last
    write-back: no read starts during backward, and the step waits for the last."""
    engine.synchronize()
    prefetch, engine.optimizer.prefetch = engine.optimizer.prefetch, lambda: None
    try:
        engine.backward(engine(tokens))
        before = engine.optimizer.traffic()
        start = time.perf_counter()
        engine.step()
        engine.synchronize()
        after = engine.optimizer.traffic()
    finally:
        engine.optimizer.prefetch = prefetch
    return {"window": time.perf_counter() - start, "bytes_read": after.bytes_read - before.bytes_read,
            "bytes_written": after.bytes_written - before.bytes_written}


def report(r: dict) -> str:
    weights = f", weights on {r['offload_param']}" if r["stage"] == 3 else ""
    s = r["setups"]
    lines = [f"offload bench step: GPT {r['model']} ({r['params'] / 1e6:.1f}M parameters), ZeRO stage {r['stage']}"
             f"{weights}; median step, setups taking turns", "",
             f"{'seconds':24}" + "".join(f"{name:>14}" for name in s)]
    for part in ("forward", "backward", "gradient_copy", "optimizer"):
        label = f"{part} (critical path)" if part != "gradient_copy" else "  of which gradient copy"
        lines.append(f"{label:24}" + "".join(f"{v['critical'][part]:>14.3f}" for v in s.values()))
    lines.append(f"{'optimizer (hidden)':24}" + "".join(f"{v['hidden']['optimizer']:>14.3f}" for v in s.values()))
    lines.append(f"{'wall':24}" + "".join(f"{v['wall_s']:>14.3f}" for v in s.values()))
    lines.append(f"{'swap checksums (CPU)':24}" + "".join(f"{v['checksum_cpu_s']:>14.3f}" for v in s.values()))
    if all("core_s" in v for v in s.values()):
        lines.append(f"{'mean step':24}" + "".join(f"{v['core_s_step_s']:>14.3f}" for v in s.values()))
        for kind in cpu_times.CoreSeconds._fields:
            lines.append(f"{'  cores ' + kind + ' (core-s)':24}" + "".join(f"{v['core_s'][kind]:>14.3f}" for v in s.values()))
    lines.append(f"{'initialize':24}" + "".join(f"{v['initialize_s']:>14.3f}" for v in s.values()))
    disk = [(v["initialize_bytes_read"] + v["initialize_bytes_written"]) / 1e9 for v in s.values()]
    lines.append(f"{'  its disk GB (r + w)':24}" + "".join(f"{gb:>14.3f}" for gb in disk))
    if any(v.get("core_s", {}).get("stolen", 0.0) > 0.01 for v in s.values()):
        lines += ["", "cores stolen: time the hypervisor ran its own work on this machine's cores while they had work, "
                  "as a virtual disk's reads and writes do; I/O moved behind compute then costs CPU (Note [stolen time], "
                  "offload/cli/cpu_times.py; benchmarks/io_cpu_cost.py measures it per GB)"]
    if r["ratios"]:
        lines += [""] + [f"{name}: {ratio:.2f}x the step time" for name, ratio in r["ratios"].items()]
    if "pipeline_efficiency" in r:
        io = s["nvme"]["io"]
        lines += ["", f"nvme: the optimizer's {io['bytes_read'] / 1e9:.2f} GB read and {io['bytes_written'] / 1e9:.2f} GB "
                  f"written per step need {r['disk_seconds']:.3f} s of disk (read {r['disk_read_gbps']:.2f}, write "
                  f"{r['disk_write_gbps']:.2f} GB/s, measured now) and took {io['window']:.3f} s from the first read to "
                  f"the last write-back: pipeline efficiency {r['pipeline_efficiency']:.2f}"]
    return "\n".join(lines)
