"""Launch shapes and autotune configs of the Triton delta rule (delta_rule/triton_chunk.py,
triton_recurrent.py), sized from sm_90 register reports (no spills); untimed on a GPU.

The chunk is the step's `VarlenPlan`'s (DELTA_CHUNK, which lives with the plan: the host never
imports triton). The scan updates the state pool in place: tuning it would clone the whole pool
around each timed run, so its launch shape is fixed; so is prepare's, which spills at 4 warps and
at 16 (tests/kernels/test_triton_compile.py). The output kernel is tuned. The decode step updates
the pool in place too, so its shape is chosen on the host, not tuned: the widest value block of
STEP_SHAPES that still gives every SM STEP_PROGRAMS_PER_SM programs (wider blocks stream longer
contiguous rows of the fp32 state; a batch of one needs the narrow ones to fill the device). Each
holds 16 state elements a thread with D_k 128, none spills at sm_90; untimed on a GPU.
"""

from cairn.kernels.common.varlen_plan import DELTA_CHUNK

CHUNK_TUNE = dict(prepare_warps=8, scan_bv=32, scan_warps=8)
OUT_CONFIGS = [dict(BV=64, num_warps=8), dict(BV=32, num_warps=4), dict(BV=32, num_warps=8)]
STEP_SHAPES = ((32, 8), (16, 4), (8, 2))  # the decode step's (BV, warps), widest first
STEP_PROGRAMS_PER_SM = 4

__all__ = ["DELTA_CHUNK", "CHUNK_TUNE", "OUT_CONFIGS", "STEP_SHAPES", "STEP_PROGRAMS_PER_SM"]
