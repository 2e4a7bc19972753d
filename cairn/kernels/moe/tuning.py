"""Launch shapes and autotune configs of the Triton mixture of experts (moe/triton_ops.py)."""

ALIGN_TILE = 4096  # the align kernels' [pairs, experts] one-hot tile: pairs per pass = this / experts
ALIGN_CHUNKS = 128  # about how many programs count and scatter the pairs (a chunk of them each)
ALIGN_FILL_BLOCKS = 16  # blocks whose expert and padding one align program writes
GEMM_CONFIGS = [dict(BLOCK_N=64, BLOCK_K=64, num_warps=4), dict(BLOCK_N=32, BLOCK_K=64, num_warps=2),
                dict(BLOCK_N=64, BLOCK_K=128, num_warps=4), dict(BLOCK_N=128, BLOCK_K=64, num_warps=8)]  # no spills at sm_90
