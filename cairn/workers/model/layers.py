"""The layers every hybrid family shares, exactly as transformers computes them.

- `RMSNorm`: zero-centred, y = x / rms(x) * (1 + w), in fp32, fused with the residual add;
- `GatedRMSNorm`: plain-weight RMSNorm times silu(gate) (the DeltaNet output norm);
- `Rotary`: partial RoPE's frequencies, rotate-half layout, applied with the q/k norm. M-RoPE (Qwen3.5) splits the frequencies into
  temporal/height/width sections, each rotated by its own position; a text token has all three
  equal, so for text M-RoPE is exactly this rotation, interleaved or not;
- `Attention`: gated full attention (q_proj yields query and an output gate per head, RMSNorm on
  q and k per head, partial RoPE, GQA) over paged KV;
- `MLP`: SwiGLU; `SparseMoE`: top-k softmax routing over fused experts plus a sigmoid-gated
  shared expert.

Each is a pure function of its weights and inputs; the KV cache it writes is passed in.
All attention ops, norms and rotary come from `kernels` (Triton on CUDA, the torch reference on
CPU), one launch each on a GPU.
"""

from __future__ import annotations

import torch
from torch import nn

from cairn import kernels
from cairn.workers.model.batch import ForwardBatch
from cairn.workers.model.model_config import ModelConfig
from cairn.workers.model.mrope import rope_axes


class RMSNorm(nn.Module):
    """Zero-centred RMSNorm: y = x / rms(x) * (1 + w), computed in fp32. Given the residual
    stream, it adds x to it first and returns (y, the new stream): one fused op
    (`kernels.rms_norm`)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        return kernels.rms_norm(x, self.weight, self.eps, residual)


class GatedRMSNorm(nn.Module):
    """RMSNorm with a plain weight, then multiplied by silu(gate) (DeltaNet's output norm)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        return kernels.gated_rms_norm(x, gate, self.weight, self.eps)


class Rotary(nn.Module):
    """Partial RoPE's frequencies for the first `rotary_dim` channels of each head (rotate-half
    layout); `kernels.qk_norm_rope` applies them. With interleaved M-RoPE (`mrope_section`),
    `rope_axes` [rotary_dim / 2] int32 names each frequency's axis (cairn.workers.model.mrope), for
    steps whose positions are [3, T] (image tokens); None otherwise."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        dim = cfg.rotary_dim
        inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        axes = torch.tensor(rope_axes(cfg.mrope_section, dim), dtype=torch.int32) if cfg.mrope_section else None
        self.register_buffer("rope_axes", axes, persistent=False)
        self.dim = dim

    def refresh(self, cfg: ModelConfig, device) -> None:
        """Its buffers made again on `device` (a model built on the meta device has none)."""
        for name, buf in Rotary(cfg).named_buffers():
            setattr(self, name, buf.to(device))


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
        k = self.k_proj(x).view(T, self.num_kv_heads, self.head_dim)
        axes = self.rotary.rope_axes if batch.positions.dim() == 2 else None  # [3, T]: a step with image tokens
        q, k = kernels.qk_norm_rope(q, k, self.q_norm.weight, self.k_norm.weight, batch.positions,
                                    self.rotary.inv_freq, self.q_norm.eps, rope_axes=axes)  # [T, H, D], [T, H_kv, D]
        v = self.v_proj(x).view(T, self.num_kv_heads, self.head_dim)
        k_cache, v_cache = kv
        kernels.store_kv(k, v, k_cache, v_cache, batch.slot_mapping)

        nd = batch.num_decodes
        parts = []
        if nd:
            parts.append(kernels.paged_attention_decode(
                q[:nd], k_cache, v_cache, batch.page_table[:nd], batch.seq_lens[:nd], self.scale))
        if nd < batch.num_seqs:
            plan = batch.prefill
            parts.append(kernels.paged_attention_prefill(
                q[nd:], k_cache, v_cache, batch.page_table[nd:], plan.device("cu"), batch.seq_lens[nd:], self.scale,
                plan))
        out = torch.cat(parts) if len(parts) > 1 else parts[0]
        return self.o_proj(kernels.sigmoid_gate(out.reshape(T, -1), gate))


class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(kernels.silu_mul(self.gate_proj(x), self.up_proj(x)))


class SparseMoE(nn.Module):
    """Top-k softmax routing over experts (weights fused at load: gate_up [E, 2I, H],
    down [E, H, I]) plus a shared expert scaled by sigmoid(shared_expert_gate(x))."""

    READS_WEIGHTS = ("shared_expert", "shared_expert_gate")  # their weights go to the fused op as tensors

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
        s = self.shared_expert
        shared = kernels.SharedExpert(s.gate_proj.weight, s.up_proj.weight, s.down_proj.weight,
                                      self.shared_expert_gate.weight)
        return kernels.fused_moe(x, self.gate(x), self.gate_up_proj, self.down_proj, self.top_k, self.norm_topk_prob,
                                 shared)
