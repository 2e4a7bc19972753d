"""Time every Triton kernel on a GPU at Qwen3-Next-80B shapes (the MoE at Qwen3.5-35B-A3B's),
against the torch reference and, for the chunked delta rule, flash-linear-attention, all measured
in the same run.

Shapes: attention 16 query / 2 KV heads of 256, pages of 16 tokens; Gated DeltaNet 16 key / 32
value heads of 128, conv over 2*16*128 + 32*128 = 8192 channels of width 4; the fused MoE at H =
2048, I = 512, 256 experts, top 8, with and without a shared expert of width 512, and its align
alone; bf16 data, fp32 states; batch and context sizes typical of serving (see the *_cases below).

For each case it prints the median time (triton.testing.do_bench), the bytes the op must move at
least (reads + writes of its inputs, outputs and states; the MoE: the experts its routing touches)
as GB/s and as a fraction of the device's peak memory bandwidth, its FLOPs as TFLOP/s and a
fraction of peak bf16 tensor throughput, the reference's time, and fla's where it applies. Peaks
come from the device's datasheet (H200: 4.8 TB/s, 989 TFLOP/s dense bf16); a device-to-device copy
measured here is printed beside them. Goals (H200): decode attention and the recurrent step >= 70%
of peak bandwidth; chunked prefill <= 1.2x fla's time at the same shapes, states included; the
MoE's align <= 30 us at 4096 x 8 pairs, <= 10 us at 64 x 8.

--json-out FILE writes every case for benchmarks/step_cost.py --calibrate:
    {"gpu": device name, "peaks": {"bytes_per_s": .., "bf16_flops_per_s": ..} or null,
     "ops": {op: [{"shape": str, "tokens": the tokens the op takes, "ms": .., "bytes": .., "flops": ..,
                   "fraction_of_bandwidth": .., "fraction_of_peak_flops": ..,
                   "fraction_of_limit": max of the two (the op's limit time / its time)}, ...]}}
with null for a fraction no peak gives (--check, an unknown device).

flash-linear-attention (fla-core, with einops): gpu_check.sh puts it on this script's path alone;
without it the fla column says so. Not a test: nothing here asserts.

Usage: python3 benchmarks/kernel_speed.py [--quick] [--json-out FILE]    (needs a CUDA device)
       python3 benchmarks/kernel_speed.py --check [--json-out FILE]      (CPU: tiny shapes through
                                     interpreted Triton, proving the script runs; its numbers mean nothing)
"""

from __future__ import annotations

import argparse
import json
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
ARGS.add_argument("--json-out", metavar="FILE", help="also write every case's fractions of the peaks (step_cost.py "
                                                      "--calibrate reads it)")
OPTS = ARGS.parse_args()
if OPTS.check:
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported, so every @triton.jit is interpreted
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from cairn.kernels.attention import reference as attention_ref  # noqa: E402
from cairn.kernels.conv import reference as conv_ref  # noqa: E402
from cairn.kernels.delta_rule import reference as delta_ref  # noqa: E402
from cairn.kernels.moe import SharedExpert  # noqa: E402
from cairn.kernels.moe import reference as moe_ref  # noqa: E402
from cairn.kernels.state import reference as state_ref  # noqa: E402


def _namespace(*modules) -> SimpleNamespace:
    """The public functions of `modules` as one namespace (each op folder's module for a device)."""
    return SimpleNamespace(**{n: getattr(m, n) for m in modules for n in dir(m)
                              if not n.startswith("_") and callable(getattr(m, n))})


reference = _namespace(attention_ref, conv_ref, delta_ref, moe_ref, state_ref)  # the ops' oracles

PEAKS = {"H200": (4.8e12, 989e12), "H100": (3.35e12, 989e12), "A100": (2.0e12, 312e12)}  # bytes/s, bf16 FLOP/s


@dataclass
class Case:
    op: str
    shape: str
    triton: Callable[[], object]
    ref: Callable[[], object] | None
    bytes: float
    flops: float
    tokens: int  # the tokens the op takes (batch rows at decode): what a calibration looks a case up by
    fla: Callable[[], object] | None = None
    goal: str = ""
    max_us: float | None = None  # a goal in microseconds


def fmt(x: float, spec: str) -> str:
    return "-" if x != x else format(x, spec)  # nan (not measured, no peak) prints as "-"


def known(x: float) -> float | None:
    return None if x != x else x  # nan: not measured, or no peak


def bench(fn: Callable[[], object], device: str) -> float:
    """Median milliseconds."""
    if device == "cpu":
        start = time.perf_counter()
        fn()
        return 1e3 * (time.perf_counter() - start)
    from triton.testing import do_bench

    fn()  # compiles and autotunes first: do_bench sizes its repeats from its first call's time
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
                      lambda: reference.store_kv(kv[0], kv[1], kc, vc, slots), 2 * tokens * size, 0, tokens=tokens))
    for batch, ctx in [(4, 40)] if small else [(64, 4096), (256, 2048), (16, 16384), (1, 65536)]:
        q, kc, vc, table, _, lens = paged([ctx] * batch, [1] * batch)
        cases.append(Case("decode attention", f"B={batch} ctx={ctx}",
                          lambda q=q, kc=kc, vc=vc, t=table, n=lens: ops.paged_attention_decode(q, kc, vc, t, n, scale),
                          (lambda q=q, kc=kc, vc=vc, t=table, n=lens: reference.paged_attention_decode(
                              q, kc, vc, t, n, scale)) if batch * ctx <= 2**20 else None,  # its fp32 gather: <= 2 GB
                          batch * ctx * size + 2 * q.numel() * dt.itemsize, 4 * batch * ctx * h_q * d, tokens=batch,
                          goal="bw>=70%"))
    for cached, new in [([0], [70])] if small else [([0], [8192]), ([2048] * 4, [2048] * 4)]:
        lens = [c + n for c, n in zip(cached, new)]
        q, kc, vc, table, cu, seq = paged(lens, new)
        pairs = sum(n * c + n * (n + 1) / 2 for c, n in zip(cached, new))  # (query, visible key) pairs
        cases.append(Case("prefill attention", f"new={new[0]}x{len(new)} cached={cached[0]}",
                          lambda q=q, kc=kc, vc=vc, t=table, cu=cu, s=seq: ops.paged_attention_prefill(q, kc, vc, t, cu,
                                                                                                       s, scale),
                          lambda q=q, kc=kc, vc=vc, t=table, cu=cu, s=seq: reference.paged_attention_prefill(
                              q, kc, vc, t, cu, s, scale),
                          sum(lens) * size + 2 * q.numel() * dt.itemsize, 4 * pairs * h_q * d, tokens=sum(new)))
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
                          io, flops, tokens=tokens, fla=fla_run, goal="<=1.2x fla"))
    for batch in [3] if small else [1, 32, 128, 256]:
        q, k, v, g, beta = inputs(batch)
        pool = torch.zeros(batch, h_v, dk, dv, device=dev)
        slots = torch.arange(batch, device=dev)
        cases.append(Case("recurrent step", f"B={batch}",
                          lambda a=(q, k, v, g, beta, pool, slots): ops.gated_delta_rule_step_slots(*a),
                          lambda a=(q, k, v, g, beta, pool, slots): reference.gated_delta_rule_step_slots(*a),
                          2 * batch * state_bytes, batch * h_v * 6 * dk * dv, tokens=batch, goal="bw>=70%"))
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
                          2 * x.numel() * dt.itemsize, 2 * x.numel() * width, tokens=sum(lens)))
    batch = 4 if small else 256
    x = torch.randn(batch, channels, device=dev, dtype=dt)
    state = torch.zeros(batch, channels, width - 1, device=dev, dtype=dt)
    cases.append(Case("conv1d update", f"B={batch}", lambda: ops.causal_conv1d_update(x, weight, state),
                      lambda: reference.causal_conv1d_update(x, weight, state),
                      (2 * x.numel() + 2 * state.numel()) * dt.itemsize, 2 * x.numel() * width, tokens=batch))
    layers, n, h_v, dk = (2, 2, 4, 32) if small else (36, 8, 32, 128)  # Qwen3-Next-80B: 36 DeltaNet layers
    ssm = torch.zeros(2 * n, layers, h_v, dk, dk, device=dev)
    src, dst = torch.arange(n, device=dev), torch.arange(n, 2 * n, device=dev)
    cases.append(Case("copy_state_slots", f"{n} checkpoints x {layers} layers",
                      lambda: ops.copy_state_slots([ssm], src, dst),
                      lambda: reference.copy_state_slots([ssm], src, dst),
                      2 * n * ssm[0].numel() * 4, 0, tokens=0))  # states, no tokens
    return cases


def moe_cases(ops, dev: str, dt: torch.dtype, small: bool) -> list[Case]:
    """The fused MoE with its shared expert (the model's path) and without; then its align alone,
    where the op folder has one (block_m as fused_moe picks it: 64 for prefills, 16 at decode)."""
    H, I, E, k = (64, 32, 8, 2) if small else (2048, 512, 256, 8)
    gate_up = torch.randn(E, 2 * I, H, device=dev, dtype=dt) * H ** -0.5
    down = torch.randn(E, H, I, device=dev, dtype=dt) * I ** -0.5
    shared = SharedExpert(*(torch.randn(*shape, device=dev, dtype=dt) * H ** -0.5
                            for shape in ((I, H), (I, H), (H, I), (1, H))))
    expert_bytes = 3 * H * I * dt.itemsize  # one expert's gate, up and down (the shared one's too)
    cases, batches = [], []
    for T in [40, 3] if small else [4096, 64]:
        x, logits = torch.randn(T, H, device=dev, dtype=dt), torch.randn(T, E, device=dev, dtype=dt)
        touched = logits.topk(k, dim=-1).indices.unique().numel()  # the experts this routing reads
        batches.append((T, x, logits, touched, (2 * x.numel() + logits.numel()) * dt.itemsize))
    for op, sh in (("moe experts", shared), ("moe experts, routed", None)):
        for T, x, logits, touched, io in batches:
            more_bytes, more_flops = (expert_bytes, 2 * 3 * T * H * I + 2 * T * H) if sh is not None else (0, 0)
            cases.append(Case(op, f"T={T} k={k}" + (" +shared" if sh is not None else ""),
                              lambda x=x, lg=logits, sh=sh: ops.fused_moe(x, lg, gate_up, down, k, True, sh),
                              (lambda x=x, lg=logits, sh=sh: reference.fused_moe(x, lg, gate_up, down, k, True, sh))
                              if T <= 64 else None,  # the reference loops over tokens
                              touched * expert_bytes + more_bytes + io, 2 * 3 * T * k * H * I + more_flops, tokens=T))
    align = getattr(ops, "align", None)
    if align is None:
        print("align: not available (cairn.kernels.moe.triton_ops has no align)")
        return cases
    for T, block_m, goal_us in [(40, 16, 30.0), (3, 16, 10.0)] if small else [(4096, 64, 30.0), (64, 16, 10.0)]:
        ids = torch.rand(T, E, device=dev).topk(k, dim=-1).indices.flatten().to(torch.int32)
        sorted_pairs, block_expert, _ = align(ids, E, block_m)
        written = (sorted_pairs.numel() + block_expert.numel() + 1) * 4
        cases.append(Case("moe align", f"{T}x{k} pairs, {E} experts", lambda ids=ids, b=block_m: align(ids, E, b),
                          None, ids.numel() * 4 + written, 0, tokens=T, max_us=goal_us))
    return cases


def triton_ops() -> SimpleNamespace:
    """The Triton launchers of every op folder, called directly (compiled, or interpreted with --check)."""
    from cairn.kernels.attention import triton_ops as attention
    from cairn.kernels.conv import triton_ops as conv
    from cairn.kernels.delta_rule import triton_chunk, triton_recurrent
    from cairn.kernels.moe import triton_ops as moe
    from cairn.kernels.state import triton_ops as state

    return _namespace(attention, conv, triton_chunk, triton_recurrent, moe, state)


def verdict(c: Case, dev: str, ms: float, bw_fraction: float, fla_ms: float) -> str:
    """Whether the case met its goal (on a GPU only: interpreted times mean nothing)."""
    if dev != "cuda":
        return ""
    if c.max_us is not None:
        return f"{'met' if ms * 1e3 <= c.max_us else 'MISSED'}: {ms * 1e3:.1f} us <= {c.max_us:.0f} us"
    if c.goal == "bw>=70%" and bw_fraction == bw_fraction:
        return f"{'met' if bw_fraction >= 0.7 else 'MISSED'}: {c.goal}"
    if c.goal and c.fla is not None:
        return f"{'met' if ms <= 1.2 * fla_ms else 'MISSED'}: {c.goal}"
    return ""


def run_case(c: Case, dev: str, bw: float, flop: float) -> dict:
    """Times one case and prints its row; returns its record for --json-out."""
    ms = bench(c.triton, dev)
    ref_ms = bench(c.ref, dev) if c.ref is not None else float("nan")  # None: too large to gather
    fla_ms = bench(c.fla, dev) if c.fla is not None else float("nan")
    gbs, tfs = c.bytes / ms / 1e6, c.flops / ms / 1e9
    bw_fraction, flop_fraction = gbs * 1e9 / bw, tfs * 1e12 / flop  # nan without peaks
    print(f"{c.op:<20}{c.shape:<28}{ms:>9.3f}{gbs:>8.0f}{fmt(bw_fraction, '.0%'):>6}{tfs:>9.1f}"
          f"{fmt(flop_fraction, '.0%'):>7}{fmt(ref_ms, '.3f'):>10}{fmt(ref_ms / ms, '.1f') + 'x':>8}"
          f"{fmt(fla_ms, '.3f'):>9}{fmt(ms / fla_ms, '.2f') + 'x':>8}  {verdict(c, dev, ms, bw_fraction, fla_ms)}")
    return dict(shape=c.shape, tokens=c.tokens, ms=ms, bytes=c.bytes, flops=c.flops,
                fraction_of_bandwidth=known(bw_fraction), fraction_of_peak_flops=known(flop_fraction),
                fraction_of_limit=known(max(bw_fraction, flop_fraction)))


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
        conv_and_slot_cases(ops, dev, dt, small) + moe_cases(ops, dev, dt, small)
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
    ops_measured: dict[str, list[dict]] = {}
    for c in cases:
        ops_measured.setdefault(c.op, []).append(run_case(c, dev, bw, flop))
    if OPTS.json_out:
        peaks = None if bw != bw else dict(bytes_per_s=bw, bf16_flops_per_s=flop)
        Path(OPTS.json_out).write_text(json.dumps(dict(gpu=name, peaks=peaks, ops=ops_measured), indent=1) + "\n")
        print(f"wrote {OPTS.json_out} (benchmarks/step_cost.py --calibrate reads it)")


if __name__ == "__main__":
    main()
