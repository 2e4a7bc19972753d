"""Every Triton kernel compiles for a Hopper GPU (sm_90) without one: in a child process that
imports triton compiled (a process running the interpreted tests cannot compile anything), the
launchers run on CPU tensors and each launch is compiled ahead of time instead of started. This
catches what the interpreter forgives (non-constexpr globals, tl.dot shapes, layouts) and, in bf16
at Qwen3-Next shapes, kernels that spill registers to local memory: every autotune config of a
tuned kernel is compiled and checked. Triton caches what it compiled
(~/.triton/cache): only a first run pays for compilation.

Run as a script, this file is that child: it prints one JSON line per launch."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.paths import REPO

ROOT = REPO
EXPECTED = {"_l2norm_kernel", "_chunk_prepare_kernel", "_chunk_scan_kernel", "_chunk_out_kernel", "_recurrent_kernel",
            "_store_kv_kernel", "_prefill_kernel", "_decode_kernel", "_decode_merge_kernel", "_conv_fwd_kernel",
            "_conv_state_kernel", "_conv_update_kernel", "_copy_slots_kernel",
            "_route_kernel", "_align_count_kernel", "_align_offsets_kernel", "_align_scatter_kernel",
            "_gate_up_kernel", "_down_kernel", "_sum_kernel",
            "_rms_norm_kernel", "_gated_rms_norm_kernel", "_qk_norm_rope_kernel", "_delta_gates_kernel",
            "_sigmoid_gate_kernel", "_silu_mul_kernel"}


def _nvidia_bin() -> Path | None:
    try:
        from triton.backends.nvidia import compiler
    except ImportError:  # a triton without its NVIDIA backend
        return None
    path = Path(compiler.__file__).parent / "bin"
    return path if (path / "ptxas").exists() else None


@pytest.fixture(scope="module")
def launches() -> list[dict]:
    if _nvidia_bin() is None:
        pytest.skip("needs triton's bundled NVIDIA toolchain (ptxas)")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    done = subprocess.run([sys.executable, __file__], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-6000:]
    return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]


def test_every_kernel_compiles_for_sm90_at_qwen3_next_shapes_in_bf16_without_spilling(launches):
    big = [x for x in launches if x["shapes"] == "qwen3-next" and x["data"] == "bf16"]
    assert {x["kernel"] for x in big} == EXPECTED
    spilling = {(x["kernel"], str(x["config"])): x["local_bytes"] for x in big if x["local_bytes"] > 64}
    assert not spilling, f"kernels (and autotune configs) spilling registers (bytes of local memory): {spilling}"


def test_every_kernel_compiles_for_sm90_at_the_demo_models_shapes_in_fp32(launches):
    assert {x["kernel"] for x in launches if x["shapes"] == "demo" and x["data"] == "fp32"} == EXPECTED


# ---------------------------------------------------------------- the child process


def _main() -> None:
    import torch
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from cairn.kernels.attention import triton_ops as triton_attention
    from cairn.kernels.common import triton_helpers as triton_common
    from cairn.kernels.conv import triton_ops as triton_conv
    from cairn.kernels.delta_rule import triton_chunk as triton_delta_rule
    from cairn.kernels.delta_rule import triton_recurrent as triton_delta_recurrent
    from cairn.kernels.moe import SharedExpert
    from cairn.kernels.moe import triton_ops as triton_moe
    from cairn.kernels.norms import triton_ops as triton_fused
    from cairn.kernels.state import triton_ops as triton_state

    assert not triton_common.INTERPRETED
    sm_count = triton_common.sm_count
    types = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.int32: "i32",
             torch.int64: "i64"}
    cubin = Path(os.environ.get("TMPDIR", "/tmp")) / f"cairn-compile-{os.getpid()}.cubin"
    shapes: dict = {"now": "", "dtype": None}

    def local_bytes(binary: bytes) -> int:
        cubin.write_bytes(binary)
        report = subprocess.run([str(_nvidia_bin() / "cuobjdump"), "-res-usage", str(cubin)],
                                capture_output=True, text=True).stdout
        return max((int(w.split(":")[1]) for w in report.split() if w.startswith("STACK:")), default=0)

    def intercept(kernel) -> None:
        def run(*args, grid, warmup=False, **kwargs):
            bound = dict(zip(kernel.arg_names, args)) | {k: v for k, v in kwargs.items() if k in kernel.arg_names}
            signature, constants = {}, {}
            for param, name in zip(kernel.params, kernel.arg_names):
                value = bound[name]
                if param.is_constexpr:
                    signature[name], constants[name] = "constexpr", value
                elif isinstance(value, torch.Tensor):
                    signature[name] = "*" + types[value.dtype]
                elif isinstance(value, int):
                    signature[name] = "i64" if abs(value) >= 2**31 else "i32"
                else:
                    signature[name] = "fp32"
            options = {k: v for k, v in kwargs.items() if k not in kernel.arg_names}
            binary = triton.compile(ASTSource(kernel, signature, constants), target=GPUTarget("cuda", 90, 32),
                                    options=options)
            data = "bf16" if shapes["dtype"] == torch.bfloat16 else "fp32"  # the run's (align's data are ids)
            print(json.dumps(dict(kernel=kernel.fn.__name__, shapes=shapes["now"], data=data,
                                  config={k: v for k, v in constants.items() if k.isupper() and isinstance(v, int)} | options,
                                  local_bytes=local_bytes(binary.asm["cubin"]))), flush=True)
        kernel.run = run

    def every_config(tuner) -> None:  # an autotuned kernel: each config it may try here compiled, none timed
        def run(*args, **kwargs):
            tuner.nargs = dict(zip(tuner.arg_names, args))
            for config in tuner.prune_configs(kwargs):
                tuner.fn.run(*args, **kwargs, **config.all_kwargs())
        intercept(tuner.fn)
        tuner.run = run

    modules = (triton_attention, triton_conv, triton_delta_recurrent, triton_delta_rule, triton_state, triton_moe,
               triton_fused)
    for module in modules:
        for value in vars(module).values():
            if isinstance(value, triton.runtime.autotuner.Autotuner):
                every_config(value)
            elif isinstance(value, triton.runtime.jit.JITFunction) and value.fn.__name__.endswith("_kernel"):
                intercept(value)

    for shapes["now"], dtype in (("qwen3-next", torch.bfloat16), ("demo", torch.float32)):
        shapes["dtype"] = dtype
        big = shapes["now"] == "qwen3-next"  # Qwen3-Next-80B head shapes, few heads and tokens; or the demo's
        h_k, h_v, d_k, d_v = (2, 4, 128, 128) if big else (2, 4, 16, 16)
        h_q, h_kv, d, channels, t = (16, 2, 256, 8192, 70) if big else (4, 2, 32, 96, 70)
        q, k = torch.randn(t, h_k, d_k, dtype=dtype), torch.randn(t, h_k, d_k, dtype=dtype)
        v, g, beta = torch.randn(t, h_v, d_v, dtype=dtype), -torch.rand(t, h_v), torch.rand(t, h_v, dtype=dtype)
        triton_delta_rule.chunk_gated_delta_rule(q, k, v, g, beta, state_positions=[16])
        for sms in (1, 4, 10**6):  # the decode step at each of its launch shapes (a grid sized for that many SMs)
            triton_common.sm_count = lambda device, sms=sms: sms
            triton_delta_recurrent.gated_delta_rule_step(q[:2], k[:2], v[:2], g[:2], beta[:2],
                                                         torch.zeros(2, h_v, d_k, d_v))
        triton_common.sm_count = sm_count
        triton_delta_recurrent.recurrent_gated_delta_rule(q, k, v, g, beta)
        k_cache = torch.zeros(8, 16, h_kv, d, dtype=dtype)
        table, lens = torch.zeros(2, 4, dtype=torch.int32), torch.tensor([20, 30], dtype=torch.int32)
        kv = torch.randn(3, h_kv, d, dtype=dtype)
        triton_attention.store_kv(kv, kv, k_cache, k_cache.clone(), torch.tensor([0, 1, -1]))
        triton_attention.paged_attention_prefill(torch.randn(5, h_q, d, dtype=dtype), k_cache, k_cache, table,
                                                 torch.tensor([0, 2, 5], dtype=torch.int32), lens, 0.1)
        triton_attention.paged_attention_decode(torch.randn(2, h_q, d, dtype=dtype), k_cache, k_cache, table,
                                                lens, 0.1)
        weight = torch.randn(channels, 4, dtype=dtype)
        triton_conv.causal_conv1d(torch.randn(t, channels, dtype=dtype), weight,
                                  torch.zeros(channels, 3, dtype=dtype))
        triton_conv.causal_conv1d_update(torch.randn(2, channels, dtype=dtype), weight,
                                         torch.zeros(2, channels, 3, dtype=dtype))
        triton_state.copy_state_slots([torch.zeros(4, 3, 5, dtype=dtype)], torch.tensor([0]), torch.tensor([1]))
        # Qwen3-Next's routing (512 experts, top 10); the widths are runtime values, so small ones compile the
        # same as long as they are multiples of the tiles, as every Qwen's are (the kernels' EVEN path);
        # token counts that give each BLOCK_M (16, 64, 128: moe/tuning.py's block_m)
        experts, top_k, hidden, inter = (512, 10, 128, 128) if big else (8, 2, 32, 16)
        for tokens in (70, 1000, 4000) if big else (40, 100, 300):
            triton_moe.fused_moe(torch.randn(tokens, hidden, dtype=dtype), torch.randn(tokens, experts, dtype=dtype),
                                 torch.randn(experts, 2 * inter, hidden, dtype=dtype),
                                 torch.randn(experts, hidden, inter, dtype=dtype), top_k,
                                 shared=SharedExpert(torch.randn(inter, hidden, dtype=dtype),
                                                     torch.randn(inter, hidden, dtype=dtype),
                                                     torch.randn(hidden, inter, dtype=dtype),
                                                     torch.randn(1, hidden, dtype=dtype)))
        # the row-wise ops at full widths (Qwen3.5-397B's hidden 4096; heads of 256, a quarter rotated)
        width = 4096 if big else 32
        rows, norm_w = torch.randn(3, width, dtype=dtype), torch.randn(width, dtype=dtype)
        triton_fused.rms_norm(rows, norm_w, 1e-6, rows)
        triton_fused.gated_rms_norm(v.reshape(-1, d_v), v.reshape(-1, d_v), torch.randn(d_v, dtype=dtype), 1e-6)
        q_heads, k_heads = torch.randn(t, h_q, d, dtype=dtype), torch.randn(t, h_kv, d, dtype=dtype)
        triton_fused.qk_norm_rope(q_heads, k_heads, torch.randn(d, dtype=dtype), torch.randn(d, dtype=dtype),
                                  torch.arange(t), torch.rand(d // 8), 1e-6)
        triton_fused.sigmoid_gate(rows, rows)
        triton_fused.silu_mul(rows, rows)
        triton_fused.delta_gates(torch.randn(t, h_v, dtype=dtype), torch.randn(t, h_v, dtype=dtype), torch.randn(h_v),
                                 torch.randn(h_v, dtype=dtype))
    cubin.unlink(missing_ok=True)


if __name__ == "__main__":
    _main()
