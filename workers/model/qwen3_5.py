"""Qwen3.5 / Qwen3.6, dense (`qwen3_5`) and MoE (`qwen3_5_moe`), exactly as transformers'
`Qwen3_5ForCausalLM` / `Qwen3_5MoeForCausalLM` compute their text.

What differs from Qwen3-Next (workers.model.qwen3_next):
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

from typing import Any

import torch
from torch import nn

from workers.model.config import BOOKKEEPING, ConfigReader, ModelConfig, read_hybrid_fields
from workers.model.family import Family
from workers.model.gated_deltanet import GatedDeltaNet
from workers.model.hybrid import HybridForCausalLM
from workers.model.sharding import conv_channels, rows, scaled_rows

MOE_FIELDS = ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size")
# Fields of the published configs that do not change the text model's forward pass.
PUBLISHED_EXTRAS = (
    "mtp_num_hidden_layers", "mtp_use_dedicated_embeddings",  # multi-token-prediction heads: unused
    "mamba_ssm_dtype",  # the recurrent state is kept in fp32, as transformers keeps it
)
# What transformers' Qwen3.5 classes do not read (they are Qwen3-Next knobs): every MoE layer is
# sparse and its top-k weights are renormalised, whatever these say.
NOT_READ_BY_TRANSFORMERS = ("decoder_sparse_step", "norm_topk_prob", "mlp_only_layers")
VISION_LANGUAGE = ("vision_config", "image_token_id", "video_token_id", "vision_start_token_id",
                   "vision_end_token_id")


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


def _reader(raw: dict[str, Any], source: str, wrapper: str) -> tuple[ConfigReader, ConfigReader | None]:
    """(the text fields' reader, the vision-language wrapper's reader or None)."""
    if raw.get("model_type") != wrapper:
        return ConfigReader(raw, source), None
    outer = ConfigReader(raw, source)
    text = raw.get("text_config")
    if not isinstance(text, dict):
        raise outer.bad("text_config", "is missing (a vision-language checkpoint keeps its text model's "
                        "config there)")
    outer.ignore(*BOOKKEEPING, *VISION_LANGUAGE, "text_config")
    expected = f"{wrapper}_text"
    if text.get("model_type", expected) != expected:
        raise outer.bad("text_config.model_type", f"is {text.get('model_type')!r}; expected {expected!r}")
    return ConfigReader(text, source, prefix="text_config."), outer


def _read(raw: dict[str, Any], source: str, moe: bool) -> ModelConfig:
    r, outer = _reader(raw, source, "qwen3_5_moe" if moe else "qwen3_5")
    r.ignore(*BOOKKEEPING, *PUBLISHED_EXTRAS, *NOT_READ_BY_TRANSFORMERS)
    r.expect("attn_output_gate", (True,), "cairn runs gated attention only, as transformers does")
    fields = read_hybrid_fields(r)
    if moe:
        mlp = dict(intermediate_size=r.opt_int("intermediate_size", 0), decoder_sparse_step=1, norm_topk_prob=True,
                   **{name: r.need(name) for name in MOE_FIELDS})
    else:
        r.ignore(*MOE_FIELDS)
        mlp = dict(intermediate_size=r.need("intermediate_size"), num_experts=0)
    top = outer or r  # the layout's own `tie_word_embeddings` and dtype, as transformers reads them
    if outer is not None:  # transformers ties by the wrapper's field, not the text config's
        r.ignore("tie_word_embeddings")
    dtype = top.opt("dtype", top.opt("torch_dtype", None)) or r.opt("dtype", r.opt("torch_dtype", "float32"))
    if not fields["eos_token_ids"] and outer is not None:
        fields["eos_token_ids"] = outer.opt_eos()
    cfg = ModelConfig(**fields, **mlp, model_type="qwen3_5_moe" if moe else "qwen3_5",
                      tie_word_embeddings=bool(top.opt("tie_word_embeddings", False)),
                      torch_dtype=str(dtype), source=source)
    cfg.check(r.bad)
    for reader in (r, outer):
        if reader is not None:
            reader.warn_unread()
    return cfg


def read_dense_config(raw: dict[str, Any], source: str) -> ModelConfig:
    return _read(raw, source, moe=False)


def read_moe_config(raw: dict[str, Any], source: str) -> ModelConfig:
    return _read(raw, source, moe=True)


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
    Family(name="qwen3_5", model_types=("qwen3_5", "qwen3_5_text"), read_config=read_dense_config,
           model_class=Qwen3_5ForCausalLM, tensor_name=tensor_name, shard_rules=SHARD_RULES),
    Family(name="qwen3_5_moe", model_types=("qwen3_5_moe", "qwen3_5_moe_text"), read_config=read_moe_config,
           model_class=Qwen3_5ForCausalLM, tensor_name=tensor_name, shard_rules=SHARD_RULES),
)
