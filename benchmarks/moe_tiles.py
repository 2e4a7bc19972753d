"""The fused MoE's parts on a GPU, one by one: the align step, and each expert GEMM at every
candidate tile, against the chip's bf16 peak (the baseline: a GEMM's time at peak), to choose
moe/tuning.py's configs and BLOCK_M rule from measurements.

    python3 benchmarks/moe_tiles.py [--tokens 4096,64] [--experts 256] [--top-k 8] [--hidden 2048]
                                    [--inter 512] [--peak-tflops 989]

For each token count: the align (three launches) in microseconds; then `_gate_up_kernel` and
`_down_kernel` at each BLOCK_M the launcher may choose there (16 at decode sizes; 64 and 128 for
prefills) and each of moe/tuning.py's candidates (BLOCK_N, BLOCK_K, warps, stages), each timed
warm (the median of triton's do_bench, as kernel_speed.py times), with its TFLOP/s and fraction
of peak; the best of each; and the whole `fused_moe` as autotuned today. Random routing (softmax of
normal logits), bf16. Needs CUDA; prints nothing it did not time.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import triton  # noqa: E402
import triton.testing  # noqa: E402

from cairn.kernels.moe import triton_ops as moe  # noqa: E402
from cairn.kernels.moe.tuning import DOWN_CONFIGS, GATE_UP_CONFIGS  # noqa: E402

def timed(fn) -> float:
    """Median seconds of `fn`: triton's do_bench, as kernel_speed.py times (after a first call, which
    compiles: do_bench sizes its repeats from its first call's time)."""
    fn()
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median") / 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", default="4096,64")
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--inter", type=int, default=512)
    ap.add_argument("--peak-tflops", type=float, default=989.0)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("moe_tiles.py times CUDA kernels; no CUDA device here")
    E, k, H, I = args.experts, args.top_k, args.hidden, args.inter
    dev, dt = "cuda", torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)
    gate_up = torch.randn(E, 2 * I, H, device=dev, dtype=dt, generator=g) * H**-0.5
    down = torch.randn(E, H, I, device=dev, dtype=dt, generator=g) * I**-0.5
    peak = args.peak_tflops * 1e12
    print(f"{torch.cuda.get_device_name()}: H {H}, I {I}, E {E}, top-{k}, bf16; peak {args.peak_tflops:.0f} TFLOP/s")
    for T in (int(t) for t in args.tokens.split(",")):
        x = torch.randn(T, H, device=dev, dtype=dt, generator=g)
        logits = torch.randn(T, E, device=dev, generator=g)
        n = T * k
        ids = torch.topk(logits.softmax(-1), k).indices.flatten().to(torch.int32)
        weights = torch.rand(n, device=dev)
        for bm in (16, 64):
            print(f"T {T:>5}: align at BLOCK_M {bm}: {timed(lambda: moe.align(ids, E, bm)) * 1e6:8.1f} us")
        whole = timed(lambda: moe.fused_moe(x, logits, gate_up, down, k))
        flops_up, flops_down = 2 * n * H * 2 * I, 2 * n * I * H
        print(f"T {T:>5}: fused_moe as tuned: {whole * 1e3:.3f} ms; both GEMMs at peak would take "
              f"{(flops_up + flops_down) / peak * 1e3:.3f} ms")
        for bm in (64, 128) if n >= 64 * E else (16,):
            sorted_pairs, block_expert, num_padded = moe.align(ids, E, bm)
            blocks = block_expert.shape[0]
            inter = torch.empty(n, I, device=dev, dtype=dt)
            y = torch.empty(n, H, device=dev, dtype=dt)
            common = dict(TOP_K=k, BLOCK_M=bm, DOT=triton.language.bfloat16, PREC="ieee", EVEN=True)
            for name, table, flops in (("gate_up", GATE_UP_CONFIGS, flops_up), ("down", DOWN_CONFIGS, flops_down)):
                best = None
                for c in table[bm]:
                    if name == "gate_up":
                        took = timed(lambda: moe._gate_up_kernel.fn[(blocks, triton.cdiv(2 * I, c["BLOCK_N"]))](
                            x, x.stride(0), gate_up, gate_up.stride(0), gate_up.stride(1), gate_up, gate_up.stride(1),
                            0, inter, sorted_pairs, block_expert, num_padded, n, T, blocks, H, I, **common, **c))
                    else:
                        took = timed(lambda: moe._down_kernel.fn[(blocks, triton.cdiv(H, c["BLOCK_N"]))](
                            inter, down, down.stride(0), down.stride(1), down, down.stride(1), weights, y,
                            sorted_pairs, block_expert, num_padded, n, T, blocks, H, I, **common, **c))
                    print(f"  {name:<8} BLOCK_M {bm:>3} N {c['BLOCK_N']:>3} K {c['BLOCK_K']:>3} w {c['num_warps']} "
                          f"s {c['num_stages']}: {took * 1e6:8.1f} us {flops / took / peak:6.1%} of peak")
                    best = min(best or (took, c), (took, c), key=lambda b: b[0])
                print(f"  best {name} at BLOCK_M {bm}: {best[0] * 1e6:.1f} us ({flops / best[0] / peak:.1%} of peak) "
                      f"with {best[1]}")


if __name__ == "__main__":
    main()
