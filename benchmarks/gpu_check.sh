#!/usr/bin/env bash
# The GPU check, for a machine with one NVIDIA GPU, torch with CUDA already
# installed and no internet: build, run the tests marked gpu (equivalence on
# CUDA, stages 1-3, every tier), then benchmark a 1.5B GPT in bf16 with and
# without offload (benchmarks/gpu_bench.py). Every part has its own timeout;
# the whole takes under 8 minutes. Run from anywhere:
#     bash benchmarks/gpu_check.sh [NVME_DIR]
set -uo pipefail
cd "$(dirname "$0")/.."
# Images may have only python3; output unbuffered, so a part killed at its timeout still shows how far it got.
PYTHON=${PYTHON:-$(command -v python || command -v python3)}
export PYTHONUNBUFFERED=1
if [ $# -ge 1 ]; then
    nvme=$1
else
    nvme=$(mktemp -d)
    trap 'rm -rf "$nvme"' EXIT  # what a setup killed at its timeout left
fi
status=0
part() {  # part SECONDS NAME COMMAND...: run one part under its own timeout, report how it ended
    local seconds=$1 name=$2
    shift 2
    echo "== $name (at most ${seconds}s)"
    local start=$SECONDS
    timeout "$seconds" "$@"
    local rc=$?
    echo "== $name: exit $rc after $((SECONDS - start))s"
    [ "$rc" -eq 0 ] || status=1
}
# What the build and the tests take from the machine, since --no-deps installs nothing:
# each missing piece is named, and nothing runs without them.
"$PYTHON" - <<'PY' || exit 1
import importlib, shutil, sys
import torch
problems = [] if torch.cuda.is_available() else ["torch sees no CUDA device"]
import setuptools
if int(setuptools.__version__.split(".")[0]) < 77:
    problems.append(f"setuptools {setuptools.__version__} < 77 (pyproject.toml's license field needs 77)")
if not (shutil.which("c++") or shutil.which("g++")):
    problems.append("no C++ compiler (c++ or g++) for the native library")
for name in ("numpy", "psutil", "aiofiles", "matplotlib", "pytest", "hypothesis"):
    try:
        importlib.import_module(name)
    except ImportError:
        problems.append(f"Python package {name} is missing")
for p in problems:
    print("gpu_check:", p, file=sys.stderr)
if not problems:
    print("torch", torch.__version__, torch.cuda.get_device_name(0), "setuptools", setuptools.__version__)
sys.exit(1 if problems else 0)
PY
df -hT "$nvme" | tail -1  # nvme-infty puts about 20 GB of swap files here; tmpfs would make it a RAM benchmark
# Worst case 35 + 45 + 385 s (each part's timeout) and the pre-flight's few seconds. On an H200 (session 26) the
# build took 19 s and the tests 23 s; a stage-2 setup needed 32 s to build its engine (its optimizer state was
# pinned then), nvme-infty about 80 s in all.
part 35 build "$PYTHON" -m pip install --no-build-isolation --no-deps -e .
# The gpu tests' own file: collecting the whole suite would import every test module (transformers among them).
# Each test named as it runs, and every thread's stack printed if one hangs, before the part's timeout kills it.
part 45 "tests marked gpu" env NVIDIA_TF32_OVERRIDE=0 "$PYTHON" -m pytest -m gpu -v -rfE --tb=short \
    -o faulthandler_timeout=10 -p no:cacheprovider tests/zero/test_gpu.py
part 385 "benchmark, 1.5B GPT in bf16" "$PYTHON" benchmarks/gpu_bench.py --nvme-path "$nvme" --budget 375
exit $status
