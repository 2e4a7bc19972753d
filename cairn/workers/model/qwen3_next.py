"""Qwen3-Next (`model_type: qwen3_next`), exactly as transformers' `Qwen3NextForCausalLM`
computes it.

What is its own: the Gated DeltaNet input projections are grouped per key head
(`in_proj_qkvz` rows are [q | k | v (ratio heads) | z (ratio heads)] per key head, `in_proj_ba`
likewise [b | a]); the MLP is dense or sparse per layer (`decoder_sparse_step`,
`mlp_only_layers`). Checkpoints are text-only, tensors named as the model names them; `mtp.*`
(multi-token-prediction heads of published checkpoints) are skipped.
"""

from __future__ import annotations

import torch
from torch import nn

from cairn.workers.model.model_config import ModelConfig
from cairn.workers.model.family import Family
from cairn.workers.model.gated_deltanet import GatedDeltaNet
from cairn.workers.model.hybrid import HybridForCausalLM
from cairn.workers.model.sharding import scaled_rows


class Qwen3NextGatedDeltaNet(GatedDeltaNet):
    def __init__(self, cfg: ModelConfig, rank: int):
        super().__init__(cfg, rank)
        self.in_proj_qkvz = nn.Linear(cfg.hidden_size, 2 * self.key_dim + 2 * self.value_dim, bias=False)
        self.in_proj_ba = nn.Linear(cfg.hidden_size, 2 * self.nv, bias=False)

    def _split_projections(self, x: torch.Tensor):
        T, ratio = x.shape[0], self.nv // self.nk
        qkvz = self.in_proj_qkvz(x).view(T, self.nk, 2 * self.dk + 2 * ratio * self.dv)
        q, k, v, z = torch.split(qkvz, [self.dk, self.dk, ratio * self.dv, ratio * self.dv], dim=-1)
        ba = self.in_proj_ba(x).view(T, self.nk, 2 * ratio)
        b, a = torch.split(ba, [ratio, ratio], dim=-1)
        mixed = torch.cat((q.reshape(T, -1), k.reshape(T, -1), v.reshape(T, -1)), dim=-1)  # [T, conv_dim]
        return mixed, z.reshape(T, self.nv, self.dv), b.reshape(T, self.nv), a.reshape(T, self.nv)


class Qwen3NextForCausalLM(HybridForCausalLM):
    delta_net = Qwen3NextGatedDeltaNet


def tensor_name(name: str) -> str | None:
    return None if name.startswith("mtp.") else name


def _ratio(cfg: ModelConfig) -> int:
    return cfg.linear_num_value_heads // cfg.linear_num_key_heads


# Both input projections are grouped per key head: a rank's rows are its key heads' groups.
SHARD_RULES = {
    "linear_attn.in_proj_qkvz.weight": scaled_rows(
        lambda c: c.linear_num_key_heads,
        lambda c: 2 * c.linear_key_head_dim + 2 * _ratio(c) * c.linear_value_head_dim),
    "linear_attn.in_proj_ba.weight": scaled_rows(lambda c: c.linear_num_key_heads, lambda c: 2 * _ratio(c)),
}

FAMILY = Family(name="qwen3_next", model_class=Qwen3NextForCausalLM, tensor_name=tensor_name, shard_rules=SHARD_RULES)
