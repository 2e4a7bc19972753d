"""Autotune configs of the Triton row ops (norms/triton_ops.py): one row per program, so the warps
are all there is to tune (the first config is the one run interpreted)."""

ROW_WARPS = [dict(num_warps=4), dict(num_warps=8), dict(num_warps=2)]
