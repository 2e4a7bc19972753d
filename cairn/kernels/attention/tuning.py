"""Launch shapes and autotune configs of the Triton paged attention (attention/triton_ops.py).

The prefill tile's rows come from the step's `VarlenPlan` (ATTENTION_ROWS (row, head) pairs a
program), built on the host, which never imports triton: the constant lives with the plan.
"""

from cairn.kernels.common.varlen_plan import ATTENTION_ROWS

# Prefill at head dim 256 (Qwen3-Next, Qwen3.5) spills registers at sm_90 with 4 warps or 64-key
# blocks since its key blocks before the diagonal run unmasked: 8 warps, 16 or 32 keys a block.
PREFILL_CONFIGS = [dict(BN=32, num_warps=8), dict(BN=16, num_warps=8), dict(BN=32, num_warps=8, num_stages=4),
                   dict(BN=16, num_warps=8, num_stages=4)]
DECODE_CONFIGS = [dict(BN=64, num_warps=4), dict(BN=32, num_warps=4), dict(BN=64, num_warps=8), dict(BN=32, num_warps=2)]

MAX_SPLITS = 256  # the most splits a decode's sequence is cut into (a batch of one: 64k context, 256 a split)
DECODE_PROGRAMS_PER_SM = 4  # decode programs (sequence, K/V head, split) the splits aim at, per SM
MERGE_SPLITS = 8  # splits the merge reads at a time (a loop: any split count, one specialisation)

__all__ = ["ATTENTION_ROWS", "PREFILL_CONFIGS", "DECODE_CONFIGS", "MAX_SPLITS", "MERGE_SPLITS", "DECODE_PROGRAMS_PER_SM"]
