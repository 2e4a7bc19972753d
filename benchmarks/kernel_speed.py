"""Time every Triton kernel on a GPU at Qwen3-Next-80B shapes, against the torch reference and,
for the chunked delta rule, flash-linear-attention, all measured in the same run.

Shapes: attention 16 query / 2 KV heads of 256, pages of 16 tokens; Gated DeltaNet 16 key / 32
value heads of 128, conv over 2*16*128 + 32*128 = 8192 channels of width 4; bf16 data, fp32
states; batch and context sizes typical of serving (see CASES below).

For each case it prints the median time (triton.testing.do_bench), the bytes the op must move at
least (reads + writes of its inputs, outputs and states) as GB/s and as a fraction of the device's
peak memory bandwidth, its FLOPs as TFLOP/s and a fraction of peak bf16 tensor throughput, the
reference's time, and fla's where it applies. Peaks come from the device's datasheet (H200: 4.8
TB/s, 989 TFLOP/s dense bf16); a device-to-device copy measured here is printed beside them.
Goals (H200): decode attention and the recurrent step >= 70% of peak bandwidth; chunked prefill
<= 1.2x fla's time at the same shapes, states included.

flash-linear-attention (fla-core, with einops): gpu_check.sh puts it on this script's path alone;
without it the fla column says so. Not a test: nothing here asserts.

Usage: python3 benchmarks/kernel_speed.py [--quick]     (needs a CUDA device)
       python3 benchmarks/kernel_speed.py --check       (CPU: tiny shapes through interpreted Triton,
                                                   proving the script runs; its numbers mean nothing)
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Callable

ARGS = argparse.ArgumentParser(description=__doc__.splitlines()[0])
ARGS.add_argument("--check", action="store_true", help="CPU self-check at tiny shapes, Triton interpreted")
ARGS.add_argument("--quick", action="store_true", help="the first shape of each op only")
OPTS = ARGS.parse_args()
if OPTS.check:
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported, so every @triton.jit is interpreted
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from cairn.kernels.attention import reference as attention_ref  # noqa: E402
from cairn.kernels.conv import reference as conv_ref  # noqa: E402
from cairn.kernels.delta_rule import reference as delta_ref  # noqa: E402
from cairn.kernels.state import reference as state_ref  # noqa: E402


def _namespace(*modules) -> SimpleNamespace:
    """The public functions of `modules` as one namespace (each op folder's module for a device)."""
    return SimpleNamespace(**{n: getattr(m, n) for m in modules for n in dir(m)
                              if not n.startswith("_") and callable(getattr(m, n))})


reference = _namespace(attention_ref, conv_ref, delta_ref, state_ref)  # the ops' oracles

PEAKS = {"H200": (4.8e12, 989e12), "H100": (3.35e12, 989e12), "A100": (2.0e12, 312e12)}  # bytes/s, bf16 FLOP/s


@dataclass
class Case:
    op: str
    shape: str
    triton: Callable[[], object]
    ref: Callable[[], object] | None
    bytes: float
    flops: float
    fla: Callable[[], object] | None = None
    goal: str = ""


def fmt(x: float, spec: str) -> str:
    return "-" if x != x else format(x, spec)  # nan (not measured, no peak) prints as "-"


def bench(fn: Callable[[], object], device: str) -> float:
    """Median milliseconds."""
    if device == "cpu":
        start = time.perf_counter()
        fn()
        return 1e3 * (time.perf_counter() - start)
    from triton.testing import do_bench

    return do_bench(fn, warmup=25, rep=100, return_mode="median")


def attention_cases(ops, dev: str, dt: torch.dtype, small: bool) -> list[Case]:
    h_q, h_kv, d, page = (4, 2, 32, 16) if small else (16, 2, 256, 16)
    scale, size = d ** -0.5, 2 * h_kv * d * dt.itemsize  # bytes of one token's K and V

    def paged(lens: list[int], new: list[int]):
        pages = [-(-n // page) for n in lens]
        cache = torch.randn(2, sum(pages), page, h_kv, d, device=dev, dtype=dt)
        table = torch.zeros(len(lens), max(pages), dtype=torch.int32, device=dev)
        perm, at = torch.randperm(sum(pages), device=dev).to(torch.int32), 0
        for b, n in enumerate(pages):
            table[b, :n], at = perm[at:at + n], at + n
        q = torch.randn(sum(new), h_q, d, device=dev, dtype=dt)
        cu = torch.tensor([0, *new], device=dev).cumsum(0).to(torch.int32)
        return q, cache[0], cache[1], table, cu, torch.tensor(lens, dtype=torch.int32, device=dev)

    cases = []
    tokens = 64 if small else 8192
    kv = torch.randn(2, tokens, h_kv, d, device=dev, dtype=dt)
    q, kc, vc, *_ = paged([tokens], [1])
    slots = torch.arange(tokens, device=dev)
    cases.append(Case("store_kv", f"T={tokens}", lambda: ops.store_kv(kv[0], kv[1], kc, vc, slots),
                      lambda: reference.store_kv(kv[0], kv[1], kc, vc, slots), 2 * tokens * size, 0))
    for batch, ctx in [(4, 40)] if small else [(64, 4096), (256, 2048), (16, 16384), (1, 65536)]:
        q, kc, vc, table, _, lens = paged([ctx] * batch, [1] * batch)
        cases.append(Case("decode attention", f"B={batch} ctx={ctx}",
                          lambda q=q, kc=kc, vc=vc, t=table, n=lens: ops.paged_attention_decode(q, kc, vc, t, n, scale),
                          (lambda q=q, kc=kc, vc=vc, t=table, n=lens: reference.paged_attention_decode(
                              q, kc, vc, t, n, scale)) if batch * ctx <= 2**20 else None,  # its fp32 gather: <= 2 GB
                          batch * ctx * size + 2 * q.numel() * dt.itemsize, 4 * batch * ctx * h_q * d, goal="bw>=70%"))
    for cached, new in [([0], [70])] if small else [([0], [8192]), ([2048] * 4, [2048] * 4)]:
        lens = [c + n for c, n in zip(cached, new)]
        q, kc, vc, table, cu, seq = paged(lens, new)
        pairs = sum(n * c + n * (n + 1) / 2 for c, n in zip(cached, new))  # (query, visible key) pairs
        cases.append(Case("prefill attention", f"new={new[0]}x{len(new)} cached={cached[0]}",
                          lambda q=q, kc=kc, vc=vc, t=table, cu=cu, s=seq: ops.paged_attention_prefill(q, kc, vc, t, cu,
                                                                                                       s, scale),
                          lambda q=q, kc=kc, vc=vc, t=table, cu=cu, s=seq: reference.paged_attention_prefill(
                              q, kc, vc, t, cu, s, scale),
                          sum(lens) * size + 2 * q.numel() * dt.itemsize, 4 * pairs * h_q * d))
    return cases


def delta_cases(ops, dev: str, dt: torch.dtype, small: bool, fla) -> list[Case]:
    h_k, h_v, dk, dv = (2, 4, 32, 32) if small else (16, 32, 128, 128)
    state_bytes = h_v * dk * dv * 4

    def inputs(tokens: int):
        q, k = (torch.randn(tokens, h_k, dk, device=dev, dtype=dt) for _ in range(2))
        v = torch.randn(tokens, h_v, dv, device=dev, dtype=dt)
        g = F.logsigmoid(2 * torch.randn(tokens, h_v, device=dev) + 2)
        return q, k, v, g, torch.rand(tokens, h_v, device=dev, dtype=dt)

    cases = []
    for lens in [[75]] if small else [[16384], [2048] * 8, [512] * 32]:
        tokens, seqs = sum(lens), len(lens)
        q, k, v, g, beta = inputs(tokens)
        cu = torch.tensor([0, *lens], device=dev).cumsum(0).to(torch.int32)
        pool = torch.zeros(seqs, h_v, dk, dv, device=dev)
        slots = torch.arange(seqs, device=dev)
        io = (2 * q.numel() + 2 * v.numel()) * dt.itemsize + 2 * g.numel() * 4 + 2 * seqs * state_bytes
        flops = tokens * h_v * (2 * 64 * (3 * dk + 2 * dv) + 6 * dk * dv)  # intra-chunk + state terms
        fla_run = None
        if fla is not None:
            fq, fk = q[None], k[None]
            try:  # older fla needs as many key heads as value heads: repeat them, as transformers does
                fla(fq, fk, v[None], g[None], beta[None], initial_state=pool, output_final_state=True,
                    cu_seqlens=cu.long(), use_qk_l2norm_in_kernel=True)
            except Exception:
                fq, fk = (x.repeat_interleave(h_v // h_k, dim=2) for x in (fq, fk))
            fla_run = (lambda fq=fq, fk=fk, v=v, g=g, b=beta, p=pool, cu=cu: fla(
                fq, fk, v[None], g[None], b[None], initial_state=p, output_final_state=True, cu_seqlens=cu.long(),
                use_qk_l2norm_in_kernel=True))
        cases.append(Case("chunked delta rule", f"{seqs}x{lens[0]} tokens",
                          lambda a=(q, k, v, g, beta, cu, pool, slots): ops.chunk_gated_delta_rule_varlen(*a),
                          (lambda a=(q, k, v, g, beta, cu, pool.clone(), slots):
                           reference.chunk_gated_delta_rule_varlen(*a)) if tokens <= 8192 else None,
                          io, flops, fla=fla_run, goal="<=1.2x fla"))
    for batch in [3] if small else [1, 32, 128, 256]:
        q, k, v, g, beta = inputs(batch)
        pool = torch.zeros(batch, h_v, dk, dv, device=dev)
        slots = torch.arange(batch, device=dev)
        cases.append(Case("recurrent step", f"B={batch}",
                          lambda a=(q, k, v, g, beta, pool, slots): ops.gated_delta_rule_step_slots(*a),
                          lambda a=(q, k, v, g, beta, pool, slots): reference.gated_delta_rule_step_slots(*a),
                          2 * batch * state_bytes, batch * h_v * 6 * dk * dv, goal="bw>=70%"))
    return cases


def conv_and_slot_cases(ops, dev: str, dt: torch.dtype, small: bool) -> list[Case]:
    channels, width = (96, 4) if small else (2 * 16 * 128 + 32 * 128, 4)
    weight = torch.randn(channels, width, device=dev, dtype=dt)
    cases = []
    for lens in [[75, 3]] if small else [[8192], [512] * 16]:
        x = torch.randn(sum(lens), channels, device=dev, dtype=dt)
        cu = torch.tensor([0, *lens], device=dev).cumsum(0).to(torch.int32)
        pool = torch.zeros(len(lens), channels, width - 1, device=dev, dtype=dt)
        slots = torch.arange(len(lens), device=dev)
        cases.append(Case("conv1d varlen", f"{len(lens)}x{lens[0]} tokens",
                          lambda a=(x, weight, cu, pool, slots): ops.causal_conv1d_varlen(*a),
                          lambda a=(x, weight, cu, pool, slots): reference.causal_conv1d_varlen(*a),
                          2 * x.numel() * dt.itemsize, 2 * x.numel() * width))
    batch = 4 if small else 256
    x = torch.randn(batch, channels, device=dev, dtype=dt)
    state = torch.zeros(batch, channels, width - 1, device=dev, dtype=dt)
    cases.append(Case("conv1d update", f"B={batch}", lambda: ops.causal_conv1d_update(x, weight, state),
                      lambda: reference.causal_conv1d_update(x, weight, state),
                      (2 * x.numel() + 2 * state.numel()) * dt.itemsize, 2 * x.numel() * width))
    layers, n, h_v, dk = (2, 2, 4, 32) if small else (36, 8, 32, 128)  # Qwen3-Next-80B: 36 DeltaNet layers
    ssm = torch.zeros(2 * n, layers, h_v, dk, dk, device=dev)
    src, dst = torch.arange(n, device=dev), torch.arange(n, 2 * n, device=dev)
    cases.append(Case("copy_state_slots", f"{n} checkpoints x {layers} layers",
                      lambda: ops.copy_state_slots([ssm], src, dst),
                      lambda: reference.copy_state_slots([ssm], src, dst),
                      2 * n * ssm[0].numel() * 4, 0))
    return cases


def triton_ops() -> SimpleNamespace:
    """The Triton launchers of every op folder, called directly (compiled, or interpreted with --check)."""
    from cairn.kernels.attention import triton_ops as attention
    from cairn.kernels.conv import triton_ops as conv
    from cairn.kernels.delta_rule import triton_chunk, triton_recurrent
    from cairn.kernels.state import triton_ops as state

    return _namespace(attention, conv, triton_chunk, triton_recurrent, state)


def main() -> None:
    if OPTS.check:
        ops = triton_ops()
        dev, dt, small, fla, name = "cpu", torch.float32, True, None, "CPU, Triton interpreted (--check)"
        bw, flop = float("nan"), float("nan")  # no peaks: percentages print as "-"
    else:
        if not torch.cuda.is_available():
            sys.exit("benchmarks/kernel_speed.py times GPU kernels and needs a CUDA device; "
                     "on a CPU, run it with --check to exercise the script at tiny shapes.")
        ops = triton_ops()

        dev, dt, small, name = "cuda", torch.bfloat16, False, torch.cuda.get_device_name()
        bw, flop = next((p for key, p in PEAKS.items() if key in name), (float("nan"), float("nan")))
        try:
            from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla
        except ImportError:
            fla = None
    cases = attention_cases(ops, dev, dt, small) + delta_cases(ops, dev, dt, small, fla) + \
        conv_and_slot_cases(ops, dev, dt, small)
    if OPTS.quick:
        cases = [c for i, c in enumerate(cases) if i == 0 or cases[i - 1].op != c.op]
    print(f"device: {name}; peaks: {fmt(bw / 1e12, '.2f')} TB/s, {fmt(flop / 1e12, '.0f')} TFLOP/s bf16 dense")
    if dev == "cuda":
        big = torch.empty(2**30, dtype=torch.uint8, device=dev)
        copy_ms = bench(lambda: big.clone(), dev)
        print(f"device-to-device copy measured here: {2 * 2**30 / copy_ms / 1e9:.0f} GB/s "
              f"({2 * 2**30 / copy_ms * 1e3 / bw:.0%} of peak)")
        del big
    fla_note = "" if fla is not None or dev == "cpu" else " (fla not installed: its column is empty)"
    print(f"{'op':<20}{'shape':<28}{'ms':>9}{'GB/s':>8}{'%bw':>6}{'TFLOP/s':>9}{'%flop':>7}"
          f"{'ref ms':>10}{'vs ref':>8}{'fla ms':>9}{'vs fla':>8}  goal{fla_note}")
    for c in cases:
        ms = bench(c.triton, dev)
        ref_ms = bench(c.ref, dev) if c.ref is not None else float("nan")  # None: too large to gather
        fla_ms = bench(c.fla, dev) if c.fla is not None else float("nan")
        gbs, tfs = c.bytes / ms / 1e6, c.flops / ms / 1e9
        verdict = ""
        if c.goal == "bw>=70%" and bw == bw:
            verdict = f"{'met' if gbs * 1e9 / bw >= 0.7 else 'MISSED'}: {c.goal}"
        elif c.goal and c.fla is not None:
            verdict = f"{'met' if ms <= 1.2 * fla_ms else 'MISSED'}: {c.goal}"
        print(f"{c.op:<20}{c.shape:<28}{ms:>9.3f}{gbs:>8.0f}{fmt(gbs * 1e9 / bw, '.0%'):>6}{tfs:>9.1f}"
              f"{fmt(tfs * 1e12 / flop, '.0%'):>7}{fmt(ref_ms, '.3f'):>10}{fmt(ref_ms / ms, '.1f') + 'x':>8}"
              f"{fmt(fla_ms, '.3f'):>9}{fmt(ms / fla_ms, '.2f') + 'x':>8}  {verdict}")


if __name__ == "__main__":
    main()
