"""Reading a Qwen3-Next `config.json` (`model_type: qwen3_next`) into a `ModelConfig` (the model
itself: `cairn.workers.model.qwen3_next`). No torch: the deploy step, the ingress and the router read
a checkpoint's config without loading a model.
"""

from __future__ import annotations

from typing import Any

from cairn.workers.model.model_config import BOOKKEEPING, ConfigReader, ModelConfig, read_hybrid_fields


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
