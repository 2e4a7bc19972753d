#!/usr/bin/env bash
# The GPU checks in one prepared call: `pytest -m gpu`, then benchmarks/kernel_speed.py with
# flash-linear-attention beside it. For a device machine whose python3 already holds torch,
# triton and pytest (the H200 image does) and that cannot reach PyPI.
#
#   here, once (PyPI reachable):  bash benchmarks/gpu_check.sh fetch
#       downloads fla-core (flash-linear-attention's kernels, pure Python) into .whl/, which
#       .git/info/exclude keeps out of git; it is never installed into this environment.
#   there:                        bash benchmarks/gpu_check.sh          (carry [".whl"])
#       installs .whl/ into /tmp/fla-site, used by kernel_speed.py alone (on a CPU, transformers would
#       pick fla's GPU kernels and fail); logs go to $OUT (the device tool's) or benchmarks/out.
set -uo pipefail
cd "$(dirname "$0")/.."
FLA_CORE=fla-core==0.6.0

if [ "${1:-}" = fetch ]; then
    grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
    exec python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_17_x86_64 -d .whl "$FLA_CORE"
fi

LOGS=${OUT:-benchmarks/out}
mkdir -p "$LOGS"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv | tee "$LOGS/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$LOGS/gpu.txt"

python3 -m pytest -m gpu -q -p no:cacheprovider -rs tests/test_triton_gpu.py 2>&1 | tee "$LOGS/pytest_gpu.log"
tests=${PIPESTATUS[0]}

fla_path=
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/fla-site .whl/*.whl \
        && fla_path=/tmp/fla-site
fi
PYTHONPATH="${fla_path}${PYTHONPATH:+:$PYTHONPATH}" python3 benchmarks/kernel_speed.py 2>&1 | tee "$LOGS/kernel_speed.log"
bench=${PIPESTATUS[0]}
echo "pytest -m gpu: exit $tests; benchmarks/kernel_speed.py: exit $bench"
exit $(( tests || bench ))
