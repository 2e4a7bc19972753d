"""Reading Qwen3.5 / Qwen3.6 `config.json`s, dense (`qwen3_5`) and MoE (`qwen3_5_moe`), into a
`ModelConfig` (the model itself: `cairn.workers.model.qwen3_5`). No torch: the deploy step, the
ingress and the router read a checkpoint's config without loading a model.

Two layouts: the published vision-language one (`model_type: qwen3_5` / `qwen3_5_moe`) keeps
the text config under `text_config`, and `tie_word_embeddings` is the top-level one, as
transformers reads it; the text-only one (`qwen3_5_text` / `qwen3_5_moe_text`) has the text
fields at the top.
"""

from __future__ import annotations

from typing import Any

from cairn.workers.model.model_config import BOOKKEEPING, ConfigReader, ModelConfig, read_hybrid_fields

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
