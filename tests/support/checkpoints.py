"""Tiny checkpoints the tests build: transformers' own (`build_hf_checkpoint`, the outside oracle's
save_pretrained, with its model as `hf_reference_model`), a hub snapshot layout
(`write_hub_snapshot`), a model directory with another chat template (`with_template`), and the
shapes they are built with."""

from __future__ import annotations

import hashlib
import os
import json
import shutil
from pathlib import Path

import torch


# Small Qwen3-Next shapes that keep every feature of the architecture: GQA, partial rotary,
# more value heads than key heads, key dim != value dim, odd vocab.
BASE = dict(
    vocab_size=211, hidden_size=48, intermediate_size=80, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    linear_key_head_dim=8, linear_value_head_dim=12, linear_num_key_heads=2, linear_num_value_heads=6,
    linear_conv_kernel_dim=4, max_position_embeddings=512, rms_norm_eps=1e-6, num_experts=0,
)


CHECKPOINTS = {
    "dense": dict(BASE, full_attention_interval=2),
    "moe": dict(BASE, num_experts=6, num_experts_per_tok=2, moe_intermediate_size=24,
                shared_expert_intermediate_size=32, decoder_sparse_step=1, mlp_only_layers=[2],
                full_attention_interval=4),
    "tied": dict(BASE, tie_word_embeddings=True, full_attention_interval=4, num_hidden_layers=3,
                 layer_types=["linear_attention", "full_attention", "linear_attention"]),
    "attention_only": dict(BASE, num_hidden_layers=2, layer_types=["full_attention"] * 2),
}


# Qwen3.5 / 3.6 text shapes: head_dim 32 so interleaved M-RoPE has three non-empty sections
# (rotary dim 8 = 2 * (2 + 1 + 1)); three DeltaNet layers to one attention layer, as published.
Q35_TEXT = dict({k: v for k, v in BASE.items() if k != "num_experts"}, head_dim=32, full_attention_interval=4,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
                                 "mrope_section": [2, 1, 1], "mrope_interleaved": True})


Q35_MOE_TEXT = dict({k: v for k, v in Q35_TEXT.items() if k != "intermediate_size"}, num_experts=6,
                    num_experts_per_tok=2, moe_intermediate_size=24, shared_expert_intermediate_size=32)


Q35_VISION = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=48, patch_size=4,
                  num_position_embeddings=16)


Q35_VISION_IDS = dict(image_token_id=200, video_token_id=201, vision_start_token_id=198, vision_end_token_id=199)
# Images move a token's rotary position on three axes: a rotary dim of 16 gives each axis more than
# one frequency (8 = 3 + 3 + 2 pairs), the fastest of height and width turning 0.3 rad a row.
Q35_VISION_TEXT = dict(Q35_TEXT, rope_parameters=dict(Q35_TEXT["rope_parameters"], partial_rotary_factor=0.5,
                                                      mrope_section=[3, 3, 2]))


# kind -> (transformers model class, its config class, config kwargs); "vl" kinds are the
# published vision-language layout (text under model.language_model.*, a vision tower beside it).
QWEN3_5_CHECKPOINTS = {
    "q35_dense": ("Qwen3_5ForCausalLM", "Qwen3_5TextConfig", Q35_TEXT),
    "q35_dense_vl": ("Qwen3_5ForConditionalGeneration", "Qwen3_5Config",
                     dict(text_config=Q35_TEXT, vision_config=Q35_VISION)),
    "q35_tied": ("Qwen3_5ForCausalLM", "Qwen3_5TextConfig", dict(Q35_TEXT, tie_word_embeddings=True)),
    "q35_tied_vl": ("Qwen3_5ForConditionalGeneration", "Qwen3_5Config",
                    dict(text_config=Q35_TEXT, vision_config=Q35_VISION, tie_word_embeddings=True)),
    "q35_moe": ("Qwen3_5MoeForCausalLM", "Qwen3_5MoeTextConfig", Q35_MOE_TEXT),
    # images in the prompt: the vision token ids inside the tiny vocabulary
    "q35_vision": ("Qwen3_5ForConditionalGeneration", "Qwen3_5Config",
                   dict(text_config=Q35_VISION_TEXT, vision_config=Q35_VISION, **Q35_VISION_IDS)),
    "q35_moe_vision": ("Qwen3_5MoeForConditionalGeneration", "Qwen3_5MoeConfig",
                       dict(text_config=dict(Q35_MOE_TEXT, rope_parameters=Q35_VISION_TEXT["rope_parameters"]),
                            vision_config=Q35_VISION, **Q35_VISION_IDS)),
    "q35_moe_vl": ("Qwen3_5MoeForConditionalGeneration", "Qwen3_5MoeConfig",
                   dict(text_config=Q35_MOE_TEXT, vision_config=Q35_VISION)),
}


# Shapes that split 2 and 4 ways (tensor parallelism): 8 query heads over 2 K/V heads (fewer K/V
# heads than 4 ranks: replicated), 4 key heads with 2 value heads each, an odd vocabulary (the last
# rank's vocabulary rows are padding).
TP_TEXT = dict(vocab_size=211, hidden_size=64, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
               head_dim=16, linear_key_head_dim=8, linear_value_head_dim=12, linear_num_key_heads=4,
               linear_num_value_heads=8, linear_conv_kernel_dim=4, max_position_embeddings=512, rms_norm_eps=1e-6,
               full_attention_interval=2)


TP_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48)


CHECKPOINTS["tp_next_moe"] = dict(TP_TEXT, intermediate_size=96, decoder_sparse_step=1, mlp_only_layers=[1], **TP_MOE)


QWEN3_5_CHECKPOINTS["tp_q35"] = ("Qwen3_5ForCausalLM", "Qwen3_5TextConfig", dict(TP_TEXT, intermediate_size=96))


QWEN3_5_CHECKPOINTS["tp_q35_moe_vl"] = ("Qwen3_5MoeForConditionalGeneration", "Qwen3_5MoeConfig",
                                        dict(text_config=dict(TP_TEXT, **TP_MOE),
                                             vision_config=dict(Q35_VISION, out_hidden_size=64),
                                             tie_word_embeddings=True))


# Images split 2 ways: the tower is whole on every rank, the language model sharded.
QWEN3_5_CHECKPOINTS["tp_q35_vision"] = (
    "Qwen3_5ForConditionalGeneration", "Qwen3_5Config",
    dict(text_config=dict(TP_TEXT, intermediate_size=96, rope_parameters={
        "rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5, "mrope_section": [2, 1, 1],
        "mrope_interleaved": True}), vision_config=dict(Q35_VISION, out_hidden_size=64), **Q35_VISION_IDS))


def build_hf_checkpoint(path: Path, kind: str, dtype: torch.dtype = torch.float32, seed: int = 0, **save) -> Path:
    """Writes a random model of `kind` (CHECKPOINTS: Qwen3-Next; QWEN3_5_CHECKPOINTS: Qwen3.5)
    with transformers' own save_pretrained."""
    import transformers

    if kind in QWEN3_5_CHECKPOINTS:
        model_class, config_class, kwargs = QWEN3_5_CHECKPOINTS[kind]
    else:
        model_class, config_class, kwargs = "Qwen3NextForCausalLM", "Qwen3NextConfig", CHECKPOINTS[kind]
    torch.manual_seed(seed)
    cfg = getattr(transformers, config_class)(**kwargs)
    model = getattr(transformers, model_class)(cfg).eval()
    with torch.no_grad():  # zero-initialised norms would hide a wrong (1 + w) convention
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
        model.get_input_embeddings().weight.mul_(20)  # sharper logits: greedy choices are not near-ties
    model.to(dtype).save_pretrained(path, **save)
    return path


def hf_reference_model(path: Path):
    """transformers' own model for a checkpoint directory, by the class config.json names."""
    import json

    import transformers

    name = json.loads((Path(path) / "config.json").read_text())["architectures"][0]
    return getattr(transformers, name).from_pretrained(path).eval()


HUB_REPO = "cairn-org/tiny"  # the Hugging Face id `hf_hub` holds


HUB_MAIN = hashlib.sha1(b"main").hexdigest()  # commits are 40 hex digits, as the hub's are


HUB_V2 = hashlib.sha1(b"v2").hexdigest()


def write_hub_snapshot(repo: Path, commit: str, model_dir: Path, **config_changes) -> Path:
    """One snapshot of `model_dir`'s files under a cache's `models--org--name` folder, each file a
    link to its blob, as huggingface_hub writes it; `config_changes` are written into config.json."""
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (repo / "blobs").mkdir(exist_ok=True)
    for f in model_dir.iterdir():
        data = f.read_bytes()
        if f.name == "config.json" and config_changes:
            data = json.dumps({**json.loads(data), **config_changes}).encode()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snapshot / f.name).symlink_to(os.path.relpath(blob, snapshot))
    return snapshot


def byte_tokens(tok, text: str) -> list[int]:
    """One token per UTF-8 byte (the byte-level alphabet), so characters and tags split."""
    from cairn.cluster.api.text_tokenizer import byte_of_char

    char_of = {b: ch for ch, b in byte_of_char().items()}
    return [tok.token_to_id(char_of[b]) for b in text.encode()]


def with_template(model_dir: Path, out: Path, template: str) -> Path:
    """`out`: `model_dir`'s tokenizer with the chat template `template` (a tokenizer-only model
    directory, for the API over a scripted engine)."""
    shutil.copy(model_dir / "tokenizer.json", out / "tokenizer.json")
    (out / "chat_template.jinja").write_text(template)
    return out
