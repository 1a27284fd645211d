#!/usr/bin/env bash
# The GPU check, for a machine with one NVIDIA GPU, torch with CUDA already
# installed and no internet: build, run the tests marked gpu (equivalence on
# CUDA, stages 1-3, every tier), then benchmark a 1.5B GPT in bf16 with and
# without offload (benchmarks/gpu_bench.py). Every part has its own timeout;
# the whole takes under 8 minutes. Run from anywhere:
#     bash benchmarks/gpu_check.sh [NVME_DIR]
set -uo pipefail
cd "$(dirname "$0")/.."
nvme="${1:-$(mktemp -d)}"
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
python -c "import torch; assert torch.cuda.is_available(), 'no CUDA'; print(torch.__version__, torch.cuda.get_device_name(0))" || exit 1
part 90 build python -m pip install --no-build-isolation --no-deps -e .
part 120 "tests marked gpu" python -m pytest -m gpu -q -p no:cacheprovider tests
part 265 "benchmark, 1.5B GPT in bf16" python benchmarks/gpu_bench.py --nvme-path "$nvme" --steps 2 --timeout 65
exit $status
