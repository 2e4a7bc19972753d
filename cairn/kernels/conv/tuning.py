"""Launch shapes and autotune configs of the Triton causal conv (conv/triton_ops.py), sized from
sm_90 register reports; untimed. Rows per program: the step's `VarlenPlan` (CONV_ROWS, which lives
with the plan: the host never imports triton). The varlen conv is tuned; the state kernels update
the pool in place (tuning would clone it around each timed run), so their channel block is fixed.
"""

from cairn.kernels.common.varlen_plan import CONV_ROWS

VARLEN_CONFIGS = [dict(BC=128, num_warps=4), dict(BC=256, num_warps=8), dict(BC=64, num_warps=2)]
STATE_CHANNELS = 128

__all__ = ["CONV_ROWS", "VARLEN_CONFIGS", "STATE_CHANNELS"]
