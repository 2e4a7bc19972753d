"""The argument checks every implementation of an op runs, Triton, C++ launcher, torch op and
reference alike, so that a bad call fails the same way on every device.

Validation is cheap: ranks, sizes and dtypes raise ValueError("expected …, got …"); values
(slots in range, page ids valid) are the caller's contract. Each `check_*` states the layout it
accepts and returns the sizes its callers go on with.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor


def expect_shape(name: str, t: Tensor, layout: str, shape: Sequence[int | None]) -> None:
    """Raise unless `t` has len(shape) dims and matches every non-None size."""
    if t.dim() != len(shape) or any(s is not None and s != n for s, n in zip(shape, t.shape)):
        want = ", ".join("*" if s is None else str(s) for s in shape)
        raise ValueError(f"expected {name} [{layout}] = [{want}], got {list(t.shape)}")


def expect_dtype(name: str, t: Tensor, dtype: torch.dtype) -> None:
    if t.dtype != dtype:
        raise ValueError(f"expected {name} of dtype {dtype}, got {t.dtype}")


def expect(ok: bool, what: str, got: object) -> None:
    if not ok:
        raise ValueError(f"expected {what}, got {got}")


# ---------------------------------------------------------------- paged KV and attention


def check_rope_axes(positions: Tensor, rope_axes: Tensor, tokens: int, pairs: int) -> None:
    """M-RoPE's arguments, as every backend checks them: positions [3, T] and rope_axes [R] (contiguous),
    both int32 or int64."""
    expect_shape("positions", positions, "3, T", (3, tokens))
    expect_shape("rope_axes", rope_axes, "R", (pairs,))
    expect(positions.dtype in (torch.int32, torch.int64) and rope_axes.dtype in (torch.int32, torch.int64),
           "positions and rope_axes of dtype int32 or int64", (positions.dtype, rope_axes.dtype))
    expect(rope_axes.is_contiguous(), "a contiguous rope_axes", rope_axes.stride())


def check_caches(k_cache: Tensor, v_cache: Tensor) -> None:
    """Paged caches: [num_pages, page_size, H_kv, D], K and V alike, D contiguous. Pages may be
    strided (views over the engine's arena, one page per arena block)."""
    expect_shape("k_cache", k_cache, "num_pages, page_size, H_kv, D", (None, None, None, None))
    expect_shape("v_cache", v_cache, "num_pages, page_size, H_kv, D", tuple(k_cache.shape))
    expect(k_cache.stride() == v_cache.stride() and k_cache.stride(3) == 1,
           "K and V caches with equal strides and D contiguous", (k_cache.stride(), v_cache.stride()))


def check_store_kv(key: Tensor, value: Tensor, k_cache: Tensor, v_cache: Tensor,
                   slot_mapping: Tensor) -> tuple[int, int]:
    """store_kv's arguments; returns (H_kv, D)."""
    check_caches(k_cache, v_cache)
    _, _, h_kv, d = k_cache.shape
    expect_shape("key", key, "T, H_kv, D", (None, h_kv, d))
    expect_shape("value", value, "T, H_kv, D", tuple(key.shape))
    expect_shape("slot_mapping", slot_mapping, "T", (key.shape[0],))
    expect_dtype("slot_mapping", slot_mapping, torch.int64)
    return h_kv, d


def check_paged(query: Tensor, k_cache: Tensor, v_cache: Tensor, page_table: Tensor,
                seq_lens: Tensor) -> tuple[int, int]:
    """The inputs both attention ops share; returns (batch size, query heads per KV head)."""
    check_caches(k_cache, v_cache)
    h_kv, d = k_cache.shape[2], k_cache.shape[3]
    expect_shape("query", query, "T, H_q, D", (None, None, d))
    expect(query.shape[1] % h_kv == 0, f"H_q a multiple of H_kv = {h_kv}", query.shape[1])
    expect_shape("page_table", page_table, "B, max_pages", (None, None))
    expect_dtype("page_table", page_table, torch.int32)
    expect_shape("seq_lens", seq_lens, "B", (page_table.shape[0],))
    expect_dtype("seq_lens", seq_lens, torch.int32)
    return page_table.shape[0], query.shape[1] // h_kv


def check_prefill(query: Tensor, k_cache: Tensor, v_cache: Tensor, page_table: Tensor, cu_seqlens_q: Tensor,
                  seq_lens: Tensor, plan) -> tuple[int, int, list[int], list[int]]:
    """Prefill's arguments, its boundaries read on the host (the plan's, when given): returns
    (batch size, query heads per KV head, cu_seqlens_q, seq_lens) as lists."""
    batch, group = check_paged(query, k_cache, v_cache, page_table, seq_lens)
    expect_shape("cu_seqlens_q", cu_seqlens_q, "B+1", (batch + 1,))
    expect_dtype("cu_seqlens_q", cu_seqlens_q, torch.int32)
    cu, lens = (cu_seqlens_q.tolist() if plan is None else list(plan.cu)), seq_lens.tolist()
    expect(cu[0] == 0 and cu[-1] == query.shape[0], f"cu_seqlens_q from 0 to T = {query.shape[0]}", cu)
    max_tokens = page_table.shape[1] * k_cache.shape[1]
    for b in range(batch):
        expect(0 <= cu[b + 1] - cu[b] <= lens[b] <= max_tokens,
               f"0 <= q_len <= seq_len <= max_pages * page_size for sequence {b}", (cu[b + 1] - cu[b], lens[b]))
    return batch, group, cu, lens


def check_decode_lens(seq_lens: Tensor, max_tokens: int) -> None:
    """Decode's bounds (a host sync: the CPU path's and the references' only)."""
    if seq_lens.numel():
        shortest, longest = int(seq_lens.min()), int(seq_lens.max())
        expect(1 <= shortest and longest <= max_tokens, "1 <= seq_lens <= max_pages * page_size", (shortest, longest))


# ---------------------------------------------------------------- the Gated DeltaNet


def check_delta(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, rows: str) -> tuple[int, ...]:
    """q, k [N, H_k, D_k], v [N, H_v, D_v], g, beta [N, H_v]; returns (N, H_v, D_k, D_v)."""
    expect_shape("q", q, f"{rows}, H_k, D_k", (None, None, None))
    n, h_k, d_k = q.shape
    expect_shape("k", k, f"{rows}, H_k, D_k", (n, h_k, d_k))
    expect_shape("v", v, f"{rows}, H_v, D_v", (n, None, None))
    h_v, d_v = v.shape[1], v.shape[2]
    expect(h_v % h_k == 0, f"H_v a multiple of H_k = {h_k}", h_v)
    expect_shape("g", g, f"{rows}, H_v", (n, h_v))
    expect_shape("beta", beta, f"{rows}, H_v", (n, h_v))
    return n, h_v, d_k, d_v


def check_slots(name: str, pool: Tensor, layout: str, inner: tuple[int, ...], state_slots: Tensor,
                batch: int) -> None:
    """A state pool [num_slots, *inner] and the [B] int64 slots a call reads and writes."""
    expect_shape(name, pool, layout, (None, *inner))
    expect_shape("state_slots", state_slots, "B", (batch,))
    expect_dtype("state_slots", state_slots, torch.int64)


def check_state_pool(state_pool: Tensor, state_slots: Tensor, batch: int, h_v: int, d_k: int, d_v: int) -> None:
    """The delta rule's fp32 state pool [num_slots, H_v, D_k, D_v] and its slots."""
    check_slots("state_pool", state_pool, "num_slots, H_v, D_k, D_v", (h_v, d_k, d_v), state_slots, batch)
    expect_dtype("state_pool", state_pool, torch.float32)


def check_conv(x: Tensor, weight: Tensor) -> tuple[int, int]:
    """x [N, C] and a depthwise conv's weight [C, K]; returns (C, K)."""
    expect_shape("weight", weight, "C, K", (None, None))
    channels, width = weight.shape
    expect_shape("x", x, "T, C", (None, channels))
    return channels, width


def check_conv_pool(conv_pool: Tensor, weight: Tensor, state_slots: Tensor, batch: int) -> None:
    """A conv state pool [num_slots, C, K-1] and its slots."""
    check_slots("conv_pool", conv_pool, "num_slots, C, K-1", (weight.shape[0], weight.shape[1] - 1), state_slots,
                batch)


# ---------------------------------------------------------------- state pools


def check_copy_slots(src_slots: Tensor, dst_slots: Tensor) -> None:
    expect_shape("src_slots", src_slots, "N", (None,))
    expect_shape("dst_slots", dst_slots, "N", (src_slots.shape[0],))
    expect_dtype("src_slots", src_slots, torch.int64)
    expect_dtype("dst_slots", dst_slots, torch.int64)


# ---------------------------------------------------------------- the mixture of experts


def check_moe(x: Tensor, logits: Tensor, gate_up: Tensor, down: Tensor, top_k: int) -> None:
    """x [T, H]; logits [T, E]; gate_up [E, 2I, H]; down [E, H, I] of x's dtype; 1 <= top_k <= E."""
    expect_shape("x", x, "T, H", (None, None))
    T, H = x.shape
    expect_shape("gate_up", gate_up, "E, 2I, H", (None, None, H))
    E, two_i = gate_up.shape[0], gate_up.shape[1]
    expect(two_i % 2 == 0, "gate_up's rows = 2 I (gate, then up)", two_i)
    expect_shape("down", down, "E, H, I", (E, H, two_i // 2))
    expect_shape("logits", logits, "T, E", (T, E))
    expect(isinstance(top_k, int) and 1 <= top_k <= E, f"1 <= top_k <= E = {E}", top_k)
    expect(gate_up.dtype == x.dtype and down.dtype == x.dtype, f"expert weights of x's dtype {x.dtype}",
           (gate_up.dtype, down.dtype))


def check_shared_expert(x: Tensor, shared) -> None:
    """A shared expert's weights ([I_s, H] gate and up, [H, I_s] down, [1, H] gate), x's dtype."""
    H = x.shape[1]
    i_s = shared.gate_proj.shape[0]
    for name, t, shape in (("shared gate_proj", shared.gate_proj, (i_s, H)), ("shared up_proj", shared.up_proj, (i_s, H)),
                           ("shared down_proj", shared.down_proj, (H, i_s)), ("shared gate", shared.gate, (1, H))):
        expect_shape(name, t, "..", shape)
        expect(t.dtype == x.dtype, f"{name} of x's dtype {x.dtype}", t.dtype)


# ---------------------------------------------------------------- sampling rows


def check_rows(name: str, x: Tensor) -> None:
    """A batch of logits rows [N, V]."""
    expect_shape(name, x, "N, V", (None, None))
