"""On a CUDA device, the compiled kernels agree with the torch reference at realistic shapes
(Qwen3-Next-80B heads: attention 16 query / 2 KV heads of 256, DeltaNet 16 key / 32 value heads of
128) in bf16 and fp32, and the engine on CUDA gives the CPU path's greedy tokens.

A process runs Triton either interpreted or compiled, fixed when triton is imported, and
tests/conftest.py makes the test session interpreted. So in such a session the one test here that
runs re-runs this file in a child pytest with TRITON_INTERPRET=0, where the others run."""

from __future__ import annotations

import importlib
import math
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from cairn.kernels import attention, conv, delta_rule, state
from cairn.kernels.common import triton_helpers as triton_common
from tests.support.paths import REPO

ROOT = REPO
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
compiled_only = pytest.mark.skipif(torch.cuda.is_available() and triton_common.INTERPRETED,
                                   reason="runs in the child process that runs compiled Triton")
CUDA = "cuda"
DTYPES = [torch.float32, torch.bfloat16]
# fp32 runs exact dots, so only summation order differs: element-wise tolerances, per tensor kind.
# bf16 rounds matmul operands and scratch to bf16 (as flash-linear-attention does): a few elements
# of thousands may stray, so bf16 is held to a relative error over the whole tensor.
FP32_TOL = {"out": dict(atol=2e-4, rtol=1e-3), "state": dict(atol=1e-3, rtol=1e-3)}
BF16_REL = {"out": 1.5e-2, "state": 2e-2}


def assert_close(got: torch.Tensor, want: torch.Tensor, kind: str, dtype: torch.dtype) -> None:
    """NaN where the reference has NaN (slots nobody may touch), else close for `kind` at `dtype`."""
    assert torch.equal(got.isnan(), want.isnan()), "NaN where the reference has a value, or the reverse"
    got, want = got[~want.isnan()].float(), want[~want.isnan()].float()
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, **FP32_TOL[kind])
    else:
        error = ((got - want).norm() / want.norm().clamp_min(1e-12)).item()
        assert error <= BF16_REL[kind], f"relative error {error:.2e} > {BF16_REL[kind]:.0e}"


def test_gpu_tests_pass_in_a_process_running_compiled_triton():
    if not triton_common.INTERPRETED:
        pytest.skip("this process runs compiled Triton: the tests below run here")
    env = dict(os.environ, TRITON_INTERPRET="0")
    done = subprocess.run([sys.executable, "-m", "pytest", __file__, "-q", "-p", "no:cacheprovider", "-rs"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    assert done.returncode == 0, done.stdout[-8000:] + done.stderr[-2000:]


def _ops(*modules) -> SimpleNamespace:
    """The public functions of `modules`, as one namespace."""
    return SimpleNamespace(**{n: getattr(m, n) for m in modules for n in getattr(m, "__all__", dir(m))
                              if not n.startswith("_") and callable(getattr(m, n))})


reference = _ops(*(importlib.import_module(p.__name__ + ".reference")
                                      for p in (attention, conv, delta_rule, state)))


@pytest.fixture(scope="module")
def gpu():
    """The Triton ops of every folder (imported here: compiled only in a process without the interpreter)."""
    return _ops(*(importlib.import_module(f"cairn.kernels.{m}") for m in (
        "attention.triton_ops", "conv.triton_ops", "delta_rule.triton_chunk", "delta_rule.triton_recurrent",
        "state.triton_ops")))


@pytest.fixture(autouse=True)
def nan_filled_buffers(monkeypatch):
    monkeypatch.setattr(triton_common, "FILL", math.nan)


def _nan_caches(pages: int, page: int, h_kv: int, d: int, dtype: torch.dtype):
    return tuple(torch.full((pages, page, h_kv, d), math.nan, dtype=dtype, device=CUDA) for _ in range(2))


def _paged(cached_and_new: list[tuple[int, int]], dtype: torch.dtype, page: int = 16, h_q: int = 16, h_kv: int = 2,
           d: int = 256):
    """Sequences on shuffled pages of NaN caches, K/V stored by the reference."""
    gen = torch.Generator().manual_seed(0)
    totals = [c + n for c, n in cached_and_new]
    need = [-(-t // page) for t in totals]
    k_cache, v_cache = _nan_caches(sum(need) + 1, page, h_kv, d, dtype)
    order = torch.randperm(sum(need), generator=gen).tolist()
    table = torch.full((len(totals), max(need) + 1), -1, dtype=torch.int32)
    for b, n in enumerate(need):
        pages, order = order[:n], order[n:]
        table[b, :n] = torch.tensor(pages, dtype=torch.int32)
        slots = torch.tensor([pages[p // page] * page + p % page for p in range(totals[b])], device=CUDA)
        kv = torch.randn(2, totals[b], h_kv, d, generator=gen).to(CUDA, dtype)
        reference.store_kv(kv[0], kv[1], k_cache, v_cache, slots)
    query = torch.randn(sum(n for _, n in cached_and_new), h_q, d, generator=gen).to(CUDA, dtype)
    cu = torch.tensor([0] + [n for _, n in cached_and_new]).cumsum(0).to(CUDA, torch.int32)
    return query, k_cache, v_cache, table.to(CUDA), cu, torch.tensor(totals, dtype=torch.int32, device=CUDA)


@compiled_only
@pytest.mark.parametrize("dtype", DTYPES)
def test_store_kv_and_paged_attention_match_the_reference(gpu, dtype):
    key, value = (torch.randn(2048, 2, 256, device=CUDA, dtype=dtype) for _ in range(2))
    slots = torch.randperm(4096, device=CUDA)[:2048]
    slots[::7] = -1
    got, want = _nan_caches(256, 16, 2, 256, dtype), _nan_caches(256, 16, 2, 256, dtype)
    gpu.store_kv(key, value, *got, slots)
    reference.store_kv(key, value, *want, slots)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, equal_nan=True, atol=0, rtol=0)

    query, k_cache, v_cache, table, cu, lens = _paged([(0, 1000), (3000, 517), (100, 1), (4095, 64)], dtype)
    scale = 256 ** -0.5
    assert_close(gpu.paged_attention_prefill(query, k_cache, v_cache, table, cu, lens, scale),
                 reference.paged_attention_prefill(query, k_cache, v_cache, table, cu, lens, scale), "out", dtype)
    gen = torch.Generator().manual_seed(1)
    batch = [(int(torch.randint(0, 4096, (1,), generator=gen)), 1) for _ in range(64)]
    query, k_cache, v_cache, table, _, lens = _paged(batch, dtype)
    assert_close(gpu.paged_attention_decode(query, k_cache, v_cache, table, lens, scale),
                 reference.paged_attention_decode(query, k_cache, v_cache, table, lens, scale), "out", dtype)


def _delta_inputs(length: int, dtype: torch.dtype, seed: int = 0, h_k: int = 16, h_v: int = 32, d: int = 128):
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(length, h_k, d, generator=gen) for _ in range(2))
    v = torch.randn(length, h_v, d, generator=gen)
    g = F.logsigmoid(2 * torch.randn(length, h_v, generator=gen) + 2)
    beta = torch.sigmoid(torch.randn(length, h_v, generator=gen))
    return q.to(CUDA, dtype), k.to(CUDA, dtype), v.to(CUDA, dtype), g.to(CUDA), beta.to(CUDA, dtype)


def _states(*lead: int, seed: int = 1) -> torch.Tensor:
    return 0.5 * torch.randn(*lead, 32, 128, 128, generator=torch.Generator().manual_seed(seed)).to(CUDA)


@compiled_only
@pytest.mark.parametrize("dtype", DTYPES)
def test_chunked_delta_rule_matches_the_reference_with_states_at_positions(gpu, dtype):
    q, k, v, g, beta = _delta_inputs(1000, dtype)
    init = _states()
    positions = [16, 64, 500, 1000]
    got = gpu.chunk_gated_delta_rule(q, k, v, g, beta, init, state_positions=positions)
    want = reference.chunk_gated_delta_rule(q, k, v, g, beta, init, state_positions=positions)
    assert_close(got[0], want[0], "out", dtype)
    assert_close(got[1], want[1], "state", dtype)
    assert_close(got[2], want[2], "state", dtype)

    lengths, used = [700, 1, 64, 300], [3, 9, 0, 5]
    q, k, v, g, beta = _delta_inputs(sum(lengths), dtype, seed=2)
    cu = torch.tensor([0, *lengths]).cumsum(0).to(CUDA, torch.int32)
    pool = torch.full((10, 3, 32, 128, 128), math.nan, device=CUDA)
    pool[used, 1] = _states(len(used))
    want_pool = pool.clone()
    slots = torch.tensor(used, device=CUDA)
    positions = [[256, 700], [1], [], [48, 300]]
    out, states = gpu.chunk_gated_delta_rule_varlen(q, k, v, g, beta, cu, pool[:, 1], slots, state_positions=positions)
    want_out, want_states = reference.chunk_gated_delta_rule_varlen(q, k, v, g, beta, cu, want_pool[:, 1],
                                                                           slots, state_positions=positions)
    assert_close(out, want_out, "out", dtype)
    assert_close(states, want_states, "state", dtype)
    assert_close(pool, want_pool, "state", dtype)


@compiled_only
@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_step_and_recurrence_match_the_reference(gpu, dtype):
    q, k, v, g, beta = _delta_inputs(64, dtype, seed=3)  # 64 sequences, one token each
    pool = torch.full((80, 32, 128, 128), math.nan, device=CUDA)
    slots = torch.randperm(80, device=CUDA)[:64]
    pool[slots] = _states(64)
    want_pool = pool.clone()
    assert_close(gpu.gated_delta_rule_step_slots(q, k, v, g, beta, pool, slots),
                 reference.gated_delta_rule_step_slots(q, k, v, g, beta, want_pool, slots), "out", dtype)
    assert_close(pool, want_pool, "state", dtype)
    state, want_state = _states(64), _states(64)
    assert_close(gpu.gated_delta_rule_step(q, k, v, g, beta, state),
                 reference.gated_delta_rule_step(q, k, v, g, beta, want_state), "out", dtype)
    assert_close(state, want_state, "state", dtype)
    q, k, v, g, beta = _delta_inputs(300, dtype, seed=4)
    got, want = gpu.recurrent_gated_delta_rule(q, k, v, g, beta), reference.recurrent_gated_delta_rule(q, k, v, g, beta)
    assert_close(got[0], want[0], "out", dtype)
    assert_close(got[1], want[1], "state", dtype)


@compiled_only
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("experts, top_k, intermediate", [(512, 10, 512), (256, 8, 512)])
def test_fused_moe_matches_the_reference_at_qwen_shapes(dtype, experts, top_k, intermediate):
    """Qwen3-Next/3.5 (E = 512, k = 10) and Qwen3.5-35B-A3B-like (E = 256, k = 8) routing, hidden
    2048, at a decode batch against the token-by-token reference, and at a prefill against the
    torch op (the CPU's, itself held to the reference in tests/kernels/moe/test_torch_ops.py:
    the reference's Python loop over 1,000 tokens took minutes here); the align of a 4k prefill
    against `reference.align`."""
    from cairn.kernels.moe import SharedExpert
    from cairn.kernels.moe import reference as reference_moe
    from cairn.kernels.moe import torch_ops as torch_moe
    from cairn.kernels.moe import triton_ops as triton_moe

    gen = torch.Generator().manual_seed(0)
    hidden = 2048
    gate_up = (torch.randn(experts, 2 * intermediate, hidden, generator=gen) * hidden**-0.5).to(CUDA, dtype)
    down = (torch.randn(experts, hidden, intermediate, generator=gen) * intermediate**-0.5).to(CUDA, dtype)
    shared = SharedExpert(
        *((torch.randn(*shape, generator=gen) * shape[-1] ** -0.5).to(CUDA, dtype)
          for shape in ((intermediate, hidden), (intermediate, hidden), (hidden, intermediate), (1, hidden))))
    for tokens, oracle in ((64, reference_moe), (1000, torch_moe)):
        x = torch.randn(tokens, hidden, generator=gen).to(CUDA, dtype)
        logits = torch.randn(tokens, experts, generator=gen).to(CUDA)
        assert_close(triton_moe.fused_moe(x, logits, gate_up, down, top_k),
                     oracle.fused_moe(x, logits, gate_up, down, top_k), "out", dtype)
        assert_close(triton_moe.fused_moe(x, logits, gate_up, down, top_k, shared=shared),
                     oracle.fused_moe(x, logits, gate_up, down, top_k, shared=shared), "out", dtype)
    ids = torch.topk(torch.randn(4096, experts, generator=gen), top_k).indices.flatten().to(torch.int32)
    for got, want in zip(triton_moe.align(ids.to(CUDA), experts, 64), reference_moe.align(ids, experts, 64)):
        assert torch.equal(got.cpu(), want)


@compiled_only
@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_row_ops_match_the_reference_at_qwen_shapes(dtype):
    """Norms at hidden 2048 and 4096 with the residual add, q/k norm with rotary at 16 / 2 heads of
    256 (a quarter rotated), the DeltaNet gates and gated norm at 32 value heads of 128."""
    from cairn.kernels.norms import reference as reference_fused
    from cairn.kernels.norms import triton_ops as triton_fused

    gen = torch.Generator().manual_seed(3)

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(CUDA, dtype)

    for hidden in (2048, 4096):
        x, res, w = rand(300, hidden), rand(300, hidden), rand(hidden, scale=0.1)
        got, want = triton_fused.rms_norm(x, w, 1e-6, res), reference_fused.rms_norm(x, w, 1e-6, res)
        assert torch.equal(got[1], want[1])  # the residual stream: the same sum, rounded to nearest
        assert_close(got[0], want[0], "out", dtype)
    q, k = rand(300, 16, 512)[..., :256], rand(300, 2, 256)
    wq, wk = rand(256, scale=0.1), rand(256, scale=0.1)
    positions = torch.randint(0, 200_000, (300,), generator=gen).to(CUDA)
    inv_freq = (1.0 / (1e7 ** (torch.arange(0, 64, 2, dtype=torch.float32) / 64))).to(CUDA)
    for g, w in zip(triton_fused.qk_norm_rope(q, k, wq, wk, positions, inv_freq, 1e-6),
                    reference_fused.qk_norm_rope(q, k, wq, wk, positions, inv_freq, 1e-6)):
        assert_close(g, w, "out", dtype)
    a, b = rand(300, 32, scale=4.0), rand(300, 32)
    A_log, dt_bias = torch.randn(32, generator=gen).to(CUDA), rand(32)
    for g, w in zip(triton_fused.delta_gates(a, b, A_log, dt_bias), reference_fused.delta_gates(a, b, A_log, dt_bias)):
        assert_close(g, w, "out", dtype)
    core, gate, nw = rand(300 * 32, 128), rand(300 * 32, 128), rand(128)
    assert_close(triton_fused.gated_rms_norm(core, gate, nw, 1e-6), reference_fused.gated_rms_norm(core, gate, nw, 1e-6),
                 "out", dtype)
    attn, out_gate = rand(300, 4096), rand(300, 8192)[:, 4096:]
    assert_close(triton_fused.sigmoid_gate(attn, out_gate), reference_fused.sigmoid_gate(attn, out_gate), "out", dtype)
    gate_up = rand(300, 2 * 3072, scale=3.0)
    assert_close(triton_fused.silu_mul(gate_up[:, :3072], gate_up[:, 3072:]),
                 reference_fused.silu_mul(gate_up[:, :3072], gate_up[:, 3072:]), "out", dtype)


@compiled_only
@pytest.mark.parametrize("dtype", DTYPES)
def test_conv_and_state_copies_match_the_reference(gpu, dtype):
    channels = 2 * 16 * 128 + 32 * 128
    weight = torch.randn(channels, 4, device=CUDA, dtype=dtype)
    lengths, used = [1000, 1, 2, 333], [4, 0, 7, 2]
    x = torch.randn(sum(lengths), channels, device=CUDA, dtype=dtype)
    cu = torch.tensor([0, *lengths]).cumsum(0).to(CUDA, torch.int32)
    pool = torch.full((8, 3, channels, 3), math.nan, device=CUDA, dtype=dtype)
    pool[used, 2] = torch.randn(len(used), channels, 3, device=CUDA, dtype=dtype)
    want_pool = pool.clone()
    slots = torch.tensor(used, device=CUDA)
    assert_close(gpu.causal_conv1d_varlen(x, weight, cu, pool[:, 2], slots),
                 reference.causal_conv1d_varlen(x, weight, cu, want_pool[:, 2], slots), "out", dtype)
    torch.testing.assert_close(pool, want_pool, equal_nan=True, atol=0, rtol=0)  # conv states: copied inputs
    out, state = gpu.causal_conv1d(x[:1000], weight, None)
    want_out, want_state = reference.causal_conv1d(x[:1000], weight, None)
    assert_close(out, want_out, "out", dtype)
    torch.testing.assert_close(state, want_state, atol=0, rtol=0)
    state, want_state = pool[used, 2].clone(), pool[used, 2].clone()
    assert_close(gpu.causal_conv1d_update(x[:4], weight, state),
                 reference.causal_conv1d_update(x[:4], weight, want_state), "out", dtype)
    torch.testing.assert_close(state, want_state, atol=0, rtol=0)

    ssm = torch.randn(16, 3, 32, 128, 128, device=CUDA)
    want_ssm, want_conv = ssm.clone(), pool.clone()
    src, dst = torch.tensor([4, 0, 7], device=CUDA), torch.tensor([1, 9, 12], device=CUDA)
    gpu.copy_state_slots([ssm], src, dst)
    reference.copy_state_slots([want_ssm], src, dst)
    assert torch.equal(ssm, want_ssm)
    gpu.copy_state_slots([pool], src[:2], torch.tensor([1, 3], device=CUDA))
    reference.copy_state_slots([want_conv], src[:2], torch.tensor([1, 3], device=CUDA))
    assert torch.equal(pool.nan_to_num(7.0), want_conv.nan_to_num(7.0))


@compiled_only
def test_the_engine_on_cuda_gives_the_cpu_paths_greedy_tokens(tiny_model_dir):
    from cairn.workers import Engine, SamplingParams

    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    gen = torch.Generator().manual_seed(0)
    first = [torch.randint(3, 500, (n,), generator=gen).tolist() for n in (150, 37, 1, 90)]
    results = {}
    for device in ("cpu", "cuda"):
        engine = Engine.from_pretrained(tiny_model_dir, device=device, page_size=16, num_pages=128, max_num_seqs=4,
                                        max_num_batched_tokens=96)
        turn1 = engine.generate(first, params)
        # second turns share the first turn's pages and checkpoints: resumed, not recomputed
        second = [p + o.token_ids[:5] + [7, 8, 9] for p, o in zip(first, turn1)]
        turn2 = engine.generate(second, params)
        results[device] = [(o.token_ids, o.cached_tokens) for o in turn1 + turn2]
    assert results["cuda"] == results["cpu"]
    assert any(cached for _, cached in results["cuda"][len(first):])


@compiled_only
def test_the_engine_on_cuda_holds_its_weights_and_one_arena_of_its_budget(tiny_model_dir):
    from cairn.workers import Engine, SamplingParams

    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    budget = 64 << 20
    engine = Engine.from_pretrained(tiny_model_dir, device=CUDA, cache_memory_bytes=budget, max_num_seqs=8)
    model = engine.model
    weights = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    graphs = engine.runner.graphs.memory_bytes  # decode graphs' pool, measured at capture (and logged)
    slack = 1 << 20  # allocator rounding and small tensors (index tensors, the step's inputs)
    held = weights + budget + graphs + slack
    assert torch.cuda.memory_allocated() - before <= held, "the cache reserved beyond its budget"
    engine.generate([[5] * 40, [6] * 90], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() - before <= held, "a step left memory behind"


@compiled_only
def test_the_host_tier_on_cuda_overlaps_its_promotions_and_gives_the_cpu_paths_tokens(tiny_model_dir):
    """Pinned host memory, promotions on their own stream while other sequences run: the same
    tokens and cached_tokens as the CPU path, and the overlap happened."""
    from cairn.workers import Engine, SamplingParams

    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    gen = torch.Generator().manual_seed(1)
    start = [torch.randint(3, 500, (100 + 9 * i,), generator=gen).tolist() for i in range(4)]
    results = {}
    for device in ("cpu", "cuda"):
        engine = Engine.from_pretrained(tiny_model_dir, device=device, cache_policy="all", max_num_seqs=2,
                                        cache_memory_bytes=30 * 8192, host_cache_bytes=2000 * 8192)
        engine.scheduler.overlap_promotions = True  # (the CPU path too: the same schedule)
        assert engine.runner.host.is_pinned() == (device == "cuda")
        convs, seen = start, []
        for _ in range(3):  # four conversations, two at a time: turns resume from the host
            outs = engine.generate(convs, params)
            seen += [(o.token_ids, o.cached_tokens) for o in outs]
            convs = [c + o.token_ids + [7, 8] for c, o in zip(convs, outs)]
        results[device] = seen
        assert engine.metrics().promotions_overlapped_total > 0
        engine.check()
    assert results["cuda"] == results["cpu"]


@compiled_only
def test_decode_graphs_replay_the_eager_tokens_and_logprobs_at_every_batch_size(tiny_model_dir):
    """Graphs captured at 1, 2, 4, 8: conversations finishing one by one pass through every size;
    second turns restore checkpoints and share pages, and a host tier moves blocks between
    steps: replay gives eager's tokens and cached tokens, and its logprobs (a padded batch may
    take another GEMM algorithm: within 1e-4), and capture is accounted."""
    from cairn.workers import Engine, SamplingParams

    gen = torch.Generator().manual_seed(2)
    first = [torch.randint(3, 500, (40 + 13 * i,), generator=gen).tolist() for i in range(8)]
    params = [SamplingParams(max_tokens=3 + 2 * i, temperature=0, ignore_eos=True, logprobs=3) for i in range(8)]
    results = {}
    for eager in (True, False):
        engine = Engine.from_pretrained(tiny_model_dir, device=CUDA, max_num_seqs=8, enforce_eager=eager,
                                        cache_memory_bytes=48 * 8192, host_cache_bytes=2000 * 8192)
        if not eager:
            graphs = engine.runner.graphs
            assert sorted(graphs._graphs) == [(1, 0), (2, 0), (4, 0), (8, 0)] and graphs.capture_s > 0 \
                and graphs.memory_bytes > 0
        turn1 = engine.generate(first, params)
        second = [p + o.token_ids + [7, 8, 9] for p, o in zip(first, turn1)]
        turn2 = engine.generate(second, params)
        results[eager] = [(o.token_ids, o.cached_tokens, [lp.logprob for lp in o.logprobs]) for o in turn1 + turn2]
        assert any(o.cached_tokens for o in turn2)
        engine.check()
    assert [r[:2] for r in results[False]] == [r[:2] for r in results[True]]
    for graphed, eager in zip(results[False], results[True]):
        torch.testing.assert_close(torch.tensor(graphed[2]), torch.tensor(eager[2]), atol=1e-4, rtol=0)


@compiled_only
def test_verify_steps_replay_as_graphs_with_the_eager_tokens(tmp_path):
    """Speculative decoding's exact mode with decode graphs: verify steps (k = 2) captured at
    every bucket, replayed as sequences finish one by one, give the eager engine's tokens and
    cached tokens (logprobs within 1e-4: a padded batch may take another GEMM algorithm), the
    drafts being kept often (a scripted drafter that knows the answers, 30% wrong)."""
    from cairn.workers import Engine, SamplingParams
    from cairn.workers.demo import write_demo_model
    from tests.support.drafters import ScriptedDrafter

    path = write_demo_model(tmp_path / "spec", size="tiny", arch="qwen3_5_moe", mtp=True)
    gen = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, 200, (9 + 7 * i,), generator=gen).tolist() for i in range(6)]
    params = [SamplingParams(max_tokens=12 + 4 * i, temperature=0, ignore_eos=True, logprobs=2) for i in range(6)]
    options = dict(device=CUDA, max_num_seqs=8, page_size=8, num_pages=256, dtype="bfloat16")
    expected = Engine.from_pretrained(path, enforce_eager=True, **options).generate(prompts, params)
    known = [p + o.token_ids for p, o in zip(prompts, expected)]
    results = {}
    for eager in (True, False):
        engine = Engine.from_pretrained(path, enforce_eager=eager, num_speculative_tokens=2, speculative_exact=True,
                                        speculative_adaptive=False, **options)
        if not eager:
            graphs = engine.runner.graphs
            assert {(b, d) for b, d in graphs._graphs} == {(b, d) for b in (1, 2, 4, 8) for d in (0, 2)}
        engine.drafter = ScriptedDrafter(known, engine.spec.vocab_size, wrong=0.3)
        outs = engine.generate(prompts, params)
        assert engine.speculation.accepted_tokens > 20
        results[eager] = outs
        engine.check()
    for graphed, eager, want in zip(results[False], results[True], expected):
        assert graphed.token_ids == eager.token_ids == want.token_ids
        torch.testing.assert_close(torch.tensor([lp.logprob for lp in graphed.logprobs]),
                                   torch.tensor([lp.logprob for lp in eager.logprobs]), atol=1e-4, rtol=0)
