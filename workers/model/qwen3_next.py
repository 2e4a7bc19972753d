"""Qwen3-Next, exactly as transformers' `Qwen3NextForCausalLM` computes it, over a varlen batch
with paged KV and slot-indexed recurrent state.

Layers (`config.layer_types`): gated full attention (q_proj yields query and an output gate per
head, zero-centred RMSNorm on q and k per head, partial RoPE, GQA) or Gated DeltaNet
(in_proj_qkvz / in_proj_ba grouped per key head, depthwise causal conv1d + SiLU over q|k|v,
L2-normed q/k, decay g = -exp(A_log) * softplus(a + dt_bias), beta = sigmoid(b), gated RMSNorm
with z, out_proj). MLP: dense SwiGLU or sparse MoE with a sigmoid-gated shared expert.

The model is a pure function of (weights, ForwardBatch, caches): it writes K/V for the new tokens
into pages, advances each sequence's recurrent state in its slot, and returns hidden states of
the rows in `batch.logits_indices` mapped to logits. It never decides anything; the runner does.
All ops come from `kernels` (Triton on CUDA, the torch reference on CPU).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import kernels
from workers.model.batch import ForwardBatch
from workers.model.config import FULL, ModelConfig


class RMSNorm(nn.Module):
    """Zero-centred RMSNorm: y = x / rms(x) * (1 + w), computed in fp32."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * (1.0 + self.weight.float())).to(x.dtype)


class GatedRMSNorm(nn.Module):
    """RMSNorm with a plain weight, then multiplied by silu(gate) (DeltaNet's output norm)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        y = self.weight * xf.to(dtype)
        return (y * F.silu(gate.float())).to(dtype)


class Rotary(nn.Module):
    """Partial RoPE on the first `rotary_dim` channels of each head (rotate-half layout)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        dim = cfg.rotary_dim
        inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.dim = dim

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        # x: [T, H, D]; positions: [T]
        freqs = positions.float()[:, None] * self.inv_freq[None, :]  # [T, dim/2]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos().to(x.dtype)[:, None, :], emb.sin().to(x.dtype)[:, None, :]
        rot, rest = x[..., : self.dim], x[..., self.dim :]
        half = self.dim // 2
        rotated = torch.cat((-rot[..., half:], rot[..., :half]), dim=-1)
        return torch.cat((rot * cos + rotated * sin, rest), dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = (
            cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim)
        bias = cfg.attention_bias
        self.q_proj = nn.Linear(cfg.hidden_size, self.num_heads * self.head_dim * 2, bias=bias)
        self.k_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, cfg.hidden_size, bias=bias)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.rotary = Rotary(cfg)
        self.scale = self.head_dim ** -0.5

    def forward(self, x: torch.Tensor, batch: ForwardBatch, kv: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        T = x.shape[0]
        q, gate = self.q_proj(x).view(T, self.num_heads, 2 * self.head_dim).chunk(2, dim=-1)
        gate = gate.reshape(T, -1)  # [T, H*D]
        q = self.rotary(self.q_norm(q), batch.positions)  # [T, H, D]
        k = self.rotary(self.k_norm(self.k_proj(x).view(T, self.num_kv_heads, self.head_dim)), batch.positions)
        v = self.v_proj(x).view(T, self.num_kv_heads, self.head_dim)
        k_cache, v_cache = kv
        kernels.store_kv(k, v, k_cache, v_cache, batch.slot_mapping)

        nd = batch.num_decodes
        parts = []
        if nd:
            parts.append(kernels.paged_attention_decode(
                q[:nd], k_cache, v_cache, batch.page_table[:nd], batch.seq_lens[:nd], self.scale))
        if nd < batch.num_seqs:
            cu = batch.cu_seqlens[nd:] - batch.cu_seqlens[nd]
            parts.append(kernels.paged_attention_prefill(
                q[nd:], k_cache, v_cache, batch.page_table[nd:], cu, batch.seq_lens[nd:], self.scale))
        out = torch.cat(parts) if len(parts) > 1 else parts[0]
        out = out.reshape(T, -1) * torch.sigmoid(gate)
        return self.o_proj(out)


class GatedDeltaNet(nn.Module):
    def __init__(self, cfg: ModelConfig, rank: int):
        super().__init__()
        self.rank = rank  # index of this layer among the linear-attention layers (state pool axis)
        self.nk, self.nv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        self.dk, self.dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        self.key_dim, self.value_dim, self.conv_dim = cfg.key_dim, cfg.value_dim, cfg.conv_dim
        self.kernel = cfg.linear_conv_kernel_dim
        self.in_proj_qkvz = nn.Linear(cfg.hidden_size, 2 * self.key_dim + 2 * self.value_dim, bias=False)
        self.in_proj_ba = nn.Linear(cfg.hidden_size, 2 * self.nv, bias=False)
        # Stored as [conv_dim, 1, K] like nn.Conv1d so checkpoints load unchanged.
        self.conv1d = nn.Module()
        self.conv1d.weight = nn.Parameter(torch.zeros(self.conv_dim, 1, self.kernel))
        self.dt_bias = nn.Parameter(torch.ones(self.nv))
        self.A_log = nn.Parameter(torch.zeros(self.nv))
        self.norm = GatedRMSNorm(self.dv, cfg.rms_norm_eps)
        self.out_proj = nn.Linear(self.value_dim, cfg.hidden_size, bias=False)

    def _split_projections(self, x: torch.Tensor):
        """in_proj outputs are grouped per key head: [q | k | v (ratio heads) | z (ratio heads)]."""
        T, ratio = x.shape[0], self.nv // self.nk
        qkvz = self.in_proj_qkvz(x).view(T, self.nk, 2 * self.dk + 2 * ratio * self.dv)
        q, k, v, z = torch.split(qkvz, [self.dk, self.dk, ratio * self.dv, ratio * self.dv], dim=-1)
        ba = self.in_proj_ba(x).view(T, self.nk, 2 * ratio)
        b, a = torch.split(ba, [ratio, ratio], dim=-1)
        mixed = torch.cat((q.reshape(T, -1), k.reshape(T, -1), v.reshape(T, -1)), dim=-1)  # [T, conv_dim]
        return mixed, z.reshape(T, self.nv, self.dv), b.reshape(T, self.nv), a.reshape(T, self.nv)

    def forward(self, x: torch.Tensor, batch: ForwardBatch, conv_states: torch.Tensor,
                ssm_states: torch.Tensor) -> torch.Tensor:
        T = x.shape[0]
        mixed, z, b, a = self._split_projections(x)
        beta = b.sigmoid()
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)
        weight = self.conv1d.weight.squeeze(1)  # [conv_dim, K]
        nd, r = batch.num_decodes, self.rank
        conv_pool, ssm_pool = conv_states[:, r], ssm_states[:, r]  # [num_slots, ...] views of this layer
        core = torch.empty(T, self.nv, self.dv, dtype=x.dtype, device=x.device)

        if nd:  # one new token per sequence, states updated in their slots
            slots = batch.state_slots[:nd]
            q, k, v = self._heads(kernels.causal_conv1d_update_slots(mixed[:nd], weight, conv_pool, slots))
            core[:nd] = kernels.gated_delta_rule_step_slots(q, k, v, g[:nd], beta[:nd], ssm_pool, slots)

        if nd < batch.num_seqs:  # every prefill segment in one call per op
            slots = batch.state_slots[nd:]
            cu = batch.cu_seqlens[nd:] - batch.cu_seqlens[nd]
            rows = slice(nd, T)  # decode tokens come first, one each
            offsets = [batch.checkpoint_offsets.get(i, []) for i in range(nd, batch.num_seqs)]
            before = conv_pool[slots] if any(offsets) else None  # conv states the segments start from
            q, k, v = self._heads(kernels.causal_conv1d_varlen(mixed[rows], weight, cu, conv_pool, slots))
            core[rows], states = kernels.chunk_gated_delta_rule_varlen(
                q, k, v, g[rows], beta[rows], cu, ssm_pool, slots, state_positions=offsets)
            if before is not None:
                self._save_checkpoints(batch, mixed[rows], cu.tolist(), offsets, before, states, conv_pool, ssm_pool)

        core = self.norm(core.reshape(-1, self.dv), z.reshape(-1, self.dv)).reshape(T, self.value_dim)
        return self.out_proj(core)

    def _save_checkpoints(self, batch: ForwardBatch, mixed: torch.Tensor, cu: list[int], offsets: list[list[int]],
                          before: torch.Tensor, states: torch.Tensor, conv_pool: torch.Tensor,
                          ssm_pool: torch.Tensor) -> None:
        """Copies the states after each checkpoint offset of each prefill segment into the
        checkpoint slots asking for them: the delta-rule state the chunked rule returned
        (`states`, segment by segment, offset by offset) and the conv window ending there."""
        nd, j = batch.num_decodes, 0
        for i, offs in enumerate(offsets):
            if not offs:
                continue
            # the conv input history of segment i: its starting state, then its tokens [C, K-1+len]
            history = torch.cat((before[i], mixed[cu[i]:cu[i + 1]].t().to(before.dtype)), dim=1)
            for off, slots in zip(offs, batch.checkpoint_slots[nd + i]):
                for ck in slots:
                    conv_pool[ck] = history[:, off: off + self.kernel - 1]
                    ssm_pool[ck] = states[j]
                j += 1

    def _heads(self, y: torch.Tensor):
        n = y.shape[0]
        q, k, v = torch.split(y, [self.key_dim, self.key_dim, self.value_dim], dim=-1)
        return q.reshape(n, self.nk, self.dk), k.reshape(n, self.nk, self.dk), v.reshape(n, self.nv, self.dv)


class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class SparseMoE(nn.Module):
    """Top-k softmax routing over experts (weights fused at load: gate_up [E, 2I, H],
    down [E, H, I]) plus a shared expert scaled by sigmoid(shared_expert_gate(x))."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        E, H, I = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.top_k, self.norm_topk_prob = cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.gate = nn.Linear(H, E, bias=False)
        self.gate_up_proj = nn.Parameter(torch.zeros(E, 2 * I, H))
        self.down_proj = nn.Parameter(torch.zeros(E, H, I))
        self.shared_expert = MLP(H, cfg.shared_expert_intermediate_size)
        self.shared_expert_gate = nn.Linear(H, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probs = F.softmax(self.gate(x), dim=-1, dtype=torch.float32)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)  # [T, k]
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        weights = weights.to(x.dtype)
        out = torch.zeros_like(x)
        for e in torch.unique(experts).tolist():
            rows, which = torch.where(experts == e)
            gate, up = F.linear(x[rows], self.gate_up_proj[e]).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, self.down_proj[e]) * weights[rows, which, None]
            out.index_add_(0, rows, y)
        return out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, linear_rank: int, attention_rank: int):
        super().__init__()
        self.is_attention = cfg.layer_types[layer] == FULL
        self.cache_rank = attention_rank if self.is_attention else linear_rank
        if self.is_attention:
            self.self_attn = Attention(cfg)
        else:
            self.linear_attn = GatedDeltaNet(cfg, linear_rank)
        self.mlp = SparseMoE(cfg) if cfg.is_moe_layer(layer) else MLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, batch: ForwardBatch, caches: "ModelCaches") -> torch.Tensor:
        h = self.input_layernorm(x)
        if self.is_attention:
            h = self.self_attn(h, batch, caches.kv[self.cache_rank])
        else:
            h = self.linear_attn(h, batch, caches.conv_states, caches.ssm_states)
        x = x + h
        return x + self.mlp(self.post_attention_layernorm(x))


class ModelCaches:
    """The tensors the model reads and writes besides weights (see workers.model.batch)."""

    def __init__(self, kv: list[tuple[torch.Tensor, torch.Tensor]], conv_states: torch.Tensor,
                 ssm_states: torch.Tensor):
        self.kv, self.conv_states, self.ssm_states = kv, conv_states, ssm_states


class Qwen3NextForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        layers, lin, att = [], 0, 0
        for i, kind in enumerate(cfg.layer_types):
            layers.append(DecoderLayer(cfg, i, lin, att))
            att, lin = (att + 1, lin) if kind == FULL else (att, lin + 1)
        self.model.layers = nn.ModuleList(layers)
        self.model.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, caches: ModelCaches) -> torch.Tensor:
        """Returns fp32 logits [len(batch.logits_indices), vocab]."""
        x = self.model.embed_tokens(batch.input_ids)  # [T, hidden]
        for layer in self.model.layers:
            x = layer(x, batch, caches)
        x = self.model.norm(x[batch.logits_indices])
        return self.lm_head(x).float()
