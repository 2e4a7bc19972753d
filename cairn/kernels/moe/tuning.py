"""Launch shapes and autotune configs of the Triton mixture of experts (moe/triton_ops.py).

The GEMM tiles: BLOCK_M (pairs a program takes, all of one expert) is chosen on the host from the
mean pairs per expert, since the align pads to it (`block_m`); BLOCK_N, BLOCK_K, warps and stages
are autotuned per (H, I, BLOCK_M). The candidates follow what tuned Triton MoE kernels pick on
Hopper (vLLM's published H200 tables for top-8 routing: 16-row tiles, N 64-128 and K 128 at decode
sizes; 64 x 128 x 64 at about 32 pairs an expert; 128 x 256 x 64, 8 warps, 4 stages from about
64), cut to those that do not spill registers at sm_90 with our gathered A tile and epilogues
(tests/kernels/test_triton_compile.py holds every candidate to that; 128 x 256 spills, so the
largest are 128 x 128). Not yet timed on a GPU: benchmarks/moe_tiles.py times every candidate.
"""

ALIGN_TILE = 4096  # the align kernels' [pairs, experts] one-hot tile: pairs per pass = this / experts
ALIGN_CHUNKS = 128  # about how many programs count and scatter the pairs (a chunk of them each)
ALIGN_FILL_BLOCKS = 16  # blocks whose expert and padding one align program writes
SUM_BLOCK_H = 1024  # output columns one program of the final sum writes


def block_m(pairs: int, experts: int) -> int:
    """The GEMMs' BLOCK_M for `pairs` (token, expert) pairs over `experts`: 16 at decode sizes
    (<= 16 pairs an expert on average), 64 up to 64, 128 beyond."""
    mean = pairs / experts
    return 16 if mean <= 16 else 64 if mean < 64 else 128


def _configs(*tiles: tuple[int, int, int, int]) -> list[dict]:
    return [dict(BLOCK_N=n, BLOCK_K=k, num_warps=w, num_stages=s) for n, k, w, s in tiles]


# per BLOCK_M: (BLOCK_N, BLOCK_K, warps, stages); the first is what the interpreter runs. The
# gate/up kernel's BLOCK_N counts gate and up columns together (half of them output columns).
GATE_UP_CONFIGS = {16: _configs((64, 128, 4, 3), (64, 64, 4, 5)),
                   64: _configs((128, 64, 8, 3), (128, 64, 8, 4), (64, 64, 8, 4)),
                   128: _configs((128, 64, 8, 3), (128, 64, 8, 4), (64, 64, 8, 4))}
DOWN_CONFIGS = {16: _configs((128, 64, 4, 4), (64, 64, 4, 5), (64, 128, 4, 3)),
                64: _configs((128, 64, 8, 3), (128, 64, 8, 4), (64, 64, 8, 4)),
                128: _configs((64, 64, 8, 3), (64, 64, 8, 4))}
_ALL = [c for table in (GATE_UP_CONFIGS, DOWN_CONFIGS) for cs in table.values() for c in cs]
# A launch needs no bound checks (EVEN) when its K and output widths are multiples of these: every
# candidate's BLOCK_K, and its output columns (the gate/up kernel's are half its BLOCK_N)
GEMM_K = max(c["BLOCK_K"] for c in _ALL)
GEMM_N = max(c["BLOCK_N"] for c in _ALL)
