"""Launch shapes and autotune configs of the Triton delta rule (delta_rule/triton_chunk.py,
triton_recurrent.py), sized from sm_90 register reports (no spills); untimed on a GPU.

The chunk is the step's `VarlenPlan`'s (DELTA_CHUNK, which lives with the plan: the host never
imports triton). The scan updates the state pool in place: tuning it would clone the whole pool
around each timed run, so its launch shape is fixed; so is prepare's, which spills at 4 warps and
at 16 (tests/kernels/test_triton_compile.py). The output kernel is tuned. The decode step's shape
is fixed too (it updates the pool in place).
"""

from cairn.kernels.common.varlen_plan import DELTA_CHUNK

CHUNK_TUNE = dict(prepare_warps=8, scan_bv=32, scan_warps=8)
OUT_CONFIGS = [dict(BV=64, num_warps=8), dict(BV=32, num_warps=4), dict(BV=32, num_warps=8)]
STEP_TUNE = dict(step_bv=8, step_warps=2)

__all__ = ["DELTA_CHUNK", "CHUNK_TUNE", "OUT_CONFIGS", "STEP_TUNE"]
