#!/usr/bin/env bash
# The GPU checks as one command, each logged to LOG_DIR (meant to take under 8 minutes on one
# H200, the GPU tests more than 3 of them):
# - `pytest -m gpu`: every kernel against its reference at Qwen shapes (the fused MoE at E = 512,
#   k = 10 and E = 256, k = 8 in bf16, with its shared expert; the fused norms, rotary and gates),
#   decode-graph replay against eager, the engine on CUDA against the CPU path;
# - benchmarks/kernel_speed.py with flash-linear-attention beside it, its fractions of the GPU's
#   peaks written to LOG_DIR/kernel_speed.json;
# - benchmarks/moe_tiles.py: the MoE's align and each expert-GEMM tile candidate, timed alone;
# - benchmarks/step_cost.py --measure --profile --calibrate LOG_DIR/kernel_speed.json: every step
#   of a Qwen3.5-35B-A3B-shaped engine with random bf16 weights (about 70 GB), its warm-up time,
#   each step warm (median, min-max) and the first time, first / warm, beside the projection at the
#   kernels' measured efficiencies; output tokens/s at 64 running; the top kernels of a warm 4k prefill;
# - benchmarks/decode_series.py: 200 warm decode steps at 64 and at 256 running on the same shape,
#   async scheduling off and on: median, p99, p99/median, tokens/s, and the on/off ratio.
#
#   bash benchmarks/gpu_check.sh [LOG_DIR]   (default: benchmarks/out/gpu-check, or
#                                             $CAIRN_BENCH_OUT/gpu-check when that is set)
#   GPU_CHECK_TESTS=0 bash benchmarks/gpu_check.sh       the benchmarks alone (a few minutes)
#   GPU_CHECK_TESTS='moe or graph' bash benchmarks/gpu_check.sh   the GPU tests pytest -k selects
#   bash benchmarks/gpu_check.sh fetch       downloads the flash-linear-attention wheels into
#                                            .whl/ (ignored by git), for a GPU machine without PyPI
#
# What the machine needs:
# - an NVIDIA GPU with its driver (nvidia-smi) and a CUDA build of torch (a GPU image's 2.11 or later;
#   pyproject pins 2.13.0), with triton;
# - nothing of cairn installed: it runs from this checkout (python3 -m pytest and the benchmarks
#   put its root on the path, where the one package `cairn` is), with torch, triton, numpy,
#   transformers, safetensors, tokenizers, jinja2, msgpack and pytest; pydantic, FastAPI, Ray,
#   llguidance and Redis are not needed;
# - for kernel_speed.py's comparison, flash-linear-attention: fla-core and einops, pure-Python
#   wheels that this script installs into a temporary folder on kernel_speed.py's path alone,
#   from .whl/ when that holds them, else from PyPI. They stay out of the environment: with fla
#   importable, transformers runs fla's GPU kernels in Qwen3-Next, which fail on the CPU tensors
#   of the tests' oracle. Without them kernel_speed.py still runs; its fla column stays empty.
#
# Exit status: nonzero when there is no GPU, or when pytest or a benchmark failed.
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
FLA=(fla-core==0.6.0 einops==0.8.2)

if [ "${1:-}" = fetch ]; then
    exec python3 -m pip download --no-deps --only-binary=:all: -d "$ROOT/.whl" "${FLA[@]}"
fi

if ! nvidia-smi -L >/dev/null 2>&1; then
    echo "gpu_check.sh: no NVIDIA GPU here (nvidia-smi is missing or finds none); run it on a machine with one" >&2
    exit 1
fi
LOGS=${1:-${CAIRN_BENCH_OUT:-$ROOT/benchmarks/out}/gpu-check}
mkdir -p "$LOGS" && LOGS=$(cd "$LOGS" && pwd)
cd "$ROOT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1

nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv | tee "$LOGS/gpu.txt"
if ! python3 -c "import sys, torch, triton
print('torch', torch.__version__, 'CUDA', torch.version.cuda, 'triton', triton.__version__)
sys.exit(0 if torch.cuda.is_available() else 'gpu_check.sh: this torch has no CUDA; install a CUDA build')" \
        2>&1 | tee -a "$LOGS/gpu.txt"; then
    exit 1
fi

# GPU_CHECK_TESTS: unset or 1, every GPU test; 0, none; anything else, a pytest -k expression.
# Only the files that hold GPU tests: collecting the rest would import what a bare GPU image lacks
# (pydantic, FastAPI, Ray, llguidance, Redis).
wanted=${GPU_CHECK_TESTS:-1}
if [ "$wanted" = 0 ]; then
    echo "pytest -m gpu: skipped (GPU_CHECK_TESTS=0)" | tee "$LOGS/pytest_gpu.log"
    tests=0
else
    select=()
    [ "$wanted" = 1 ] || select=(-k "$wanted")
    python3 -m pytest -m gpu -q -p no:cacheprovider -rs "${select[@]}" tests/kernels/test_triton_gpu.py \
        tests/workers/test_tensor_parallel.py 2>&1 | tee "$LOGS/pytest_gpu.log"
    tests=${PIPESTATUS[0]}
fi

fla_site=$(mktemp -d)
if compgen -G ".whl/*.whl" >/dev/null; then
    from=(--no-index .whl/*.whl)
else
    from=("${FLA[@]}")
fi
if ! python3 -m pip install -q --no-deps --no-compile --no-cache-dir --target "$fla_site" "${from[@]}" \
        >"$LOGS/fla_install.log" 2>&1; then
    echo "flash-linear-attention not installed (see $LOGS/fla_install.log): the fla column stays empty"
fi
rm -f "$LOGS/kernel_speed.json"
PYTHONPATH="$fla_site${PYTHONPATH:+:$PYTHONPATH}" python3 benchmarks/kernel_speed.py \
    --json-out "$LOGS/kernel_speed.json" 2>&1 | tee "$LOGS/kernel_speed.log"
bench=${PIPESTATUS[0]}
rm -rf "$fla_site"
python3 benchmarks/moe_tiles.py 2>&1 | tee "$LOGS/moe_tiles.log"
tiles=${PIPESTATUS[0]}
calibrate=()
if [ -s "$LOGS/kernel_speed.json" ]; then
    calibrate=(--calibrate "$LOGS/kernel_speed.json")
else
    echo "no $LOGS/kernel_speed.json: step_cost.py projects uncalibrated"
fi
python3 benchmarks/step_cost.py --shapes qwen3.5-35b-a3b --measure --profile "${calibrate[@]}" \
    2>&1 | tee "$LOGS/step_cost.log"
steps=${PIPESTATUS[0]}
python3 benchmarks/decode_series.py --shape qwen3.5-35b-a3b --running 64,256 --steps 200 \
    2>&1 | tee "$LOGS/decode_series.log"
series=${PIPESTATUS[0]}
echo "pytest -m gpu: exit $tests; benchmarks/kernel_speed.py: exit $bench; benchmarks/moe_tiles.py: exit $tiles;" \
     "benchmarks/step_cost.py: exit $steps; benchmarks/decode_series.py: exit $series; logs in $LOGS"
exit $(( tests || bench || tiles || steps || series ))
