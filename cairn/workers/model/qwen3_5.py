"""Qwen3.5 / Qwen3.6, dense (`qwen3_5`) and MoE (`qwen3_5_moe`), exactly as transformers'
`Qwen3_5ForCausalLM` / `Qwen3_5MoeForCausalLM` compute their text.

What differs from Qwen3-Next (cairn.workers.model.qwen3_next):
- the Gated DeltaNet input projections are separate: `in_proj_qkv` (rows q | k | v),
  `in_proj_z`, `in_proj_b`, `in_proj_a`;
- dense: every layer has the SwiGLU MLP. MoE: every layer is sparse (top-k softmax routing,
  weights renormalised, a sigmoid-gated shared expert); experts are published fused
  (`mlp.experts.gate_up_proj` [E, 2I, H], `mlp.experts.down_proj` [E, H, I]), while
  transformers' `save_pretrained` writes them per expert: both load;
- RoPE is interleaved M-RoPE (`rope_parameters.mrope_section`, `mrope_interleaved`); a text
  token's three position components are equal, so for text it is the plain partial rotation.

Two checkpoint layouts load. The published vision-language one (`model_type: qwen3_5` /
`qwen3_5_moe`, `*ForConditionalGeneration`) keeps the text config under `text_config` and the
text model under `model.language_model.*` beside a vision tower (`model.visual.*`): the vision
tower is skipped without being read, and `tie_word_embeddings` is the top-level one, as
transformers reads it. The text-only one (`qwen3_5_text` / `qwen3_5_moe_text`, `*ForCausalLM`)
has the text fields at the top and the model under `model.*`. `mtp.*` heads are skipped.
"""

from __future__ import annotations

import torch
from torch import nn

from cairn.workers.model.model_config import ModelConfig
from cairn.workers.model.family import Family
from cairn.workers.model.gated_deltanet import GatedDeltaNet
from cairn.workers.model.hybrid import HybridForCausalLM
from cairn.workers.model.sharding import conv_channels, rows, scaled_rows

class Qwen3_5GatedDeltaNet(GatedDeltaNet):
    def __init__(self, cfg: ModelConfig, rank: int):
        super().__init__(cfg, rank)
        self.in_proj_qkv = nn.Linear(cfg.hidden_size, self.conv_dim, bias=False)
        self.in_proj_z = nn.Linear(cfg.hidden_size, self.value_dim, bias=False)
        self.in_proj_b = nn.Linear(cfg.hidden_size, self.nv, bias=False)
        self.in_proj_a = nn.Linear(cfg.hidden_size, self.nv, bias=False)

    def _split_projections(self, x: torch.Tensor):
        T = x.shape[0]
        return (self.in_proj_qkv(x), self.in_proj_z(x).view(T, self.nv, self.dv),
                self.in_proj_b(x), self.in_proj_a(x))


class Qwen3_5ForCausalLM(HybridForCausalLM):
    delta_net = Qwen3_5GatedDeltaNet


def tensor_name(name: str) -> str | None:
    if name.startswith(("model.visual.", "mtp.")):
        return None
    if name.startswith("model.language_model."):
        return "model." + name[len("model.language_model."):]
    return name


# Separate input projections: q|k|v rows follow the conv channels; z, b, a are per value head.
SHARD_RULES = {
    "linear_attn.in_proj_qkv.weight": conv_channels,
    "linear_attn.in_proj_z.weight": scaled_rows(lambda c: c.linear_num_value_heads, lambda c: c.linear_value_head_dim),
    "linear_attn.in_proj_b.weight": rows(lambda c: c.linear_num_value_heads),
    "linear_attn.in_proj_a.weight": rows(lambda c: c.linear_num_value_heads),
}

FAMILIES = (
    Family(name="qwen3_5", model_class=Qwen3_5ForCausalLM, tensor_name=tensor_name, shard_rules=SHARD_RULES),
    Family(name="qwen3_5_moe", model_class=Qwen3_5ForCausalLM, tensor_name=tensor_name, shard_rules=SHARD_RULES),
)
