"""Qwen3-Next (`model_type: qwen3_next`), exactly as transformers' `Qwen3NextForCausalLM`
computes it.

What is its own: the Gated DeltaNet input projections are grouped per key head
(`in_proj_qkvz` rows are [q | k | v (ratio heads) | z (ratio heads)] per key head, `in_proj_ba`
likewise [b | a]); the MLP is dense or sparse per layer (`decoder_sparse_step`,
`mlp_only_layers`). Checkpoints are text-only, tensors named as the model names them; `mtp.*`
(multi-token-prediction heads of published checkpoints) are skipped.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from workers.model.config import BOOKKEEPING, ConfigReader, ModelConfig, read_hybrid_fields
from workers.model.family import Family
from workers.model.gated_deltanet import GatedDeltaNet
from workers.model.hybrid import HybridForCausalLM
from workers.model.sharding import scaled_rows


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


def read_config(raw: dict[str, Any], source: str) -> ModelConfig:
    r = ConfigReader(raw, source)
    r.ignore(*BOOKKEEPING)
    cfg = ModelConfig(
        **read_hybrid_fields(r),
        model_type="qwen3_next",
        intermediate_size=r.need("intermediate_size"),
        tie_word_embeddings=bool(r.opt("tie_word_embeddings", False)),
        num_experts=r.opt_int("num_experts", 0),
        num_experts_per_tok=r.opt_int("num_experts_per_tok", 0),
        moe_intermediate_size=r.opt_int("moe_intermediate_size", 0),
        shared_expert_intermediate_size=r.opt_int("shared_expert_intermediate_size", 0),
        decoder_sparse_step=r.opt("decoder_sparse_step", 1),
        norm_topk_prob=bool(r.opt("norm_topk_prob", True)),
        mlp_only_layers=tuple(r.opt("mlp_only_layers", ())),
        torch_dtype=str(r.opt("dtype", r.opt("torch_dtype", "float32"))),
        source=source,
    )
    cfg.check(r.bad)
    r.warn_unread()
    return cfg


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

FAMILY = Family(name="qwen3_next", model_types=("qwen3_next",), read_config=read_config,
                model_class=Qwen3NextForCausalLM, tensor_name=tensor_name, shard_rules=SHARD_RULES)
