"""Families load as published: the registry picks the family from `config.json`, Qwen3.5's
fused experts and vision-language layout load without reading the vision tower, every config
field is accounted for, and the engine's pools take their shapes from the loaded family, as
transformers' own cache has them."""

import json
import logging
import shutil

import pytest
import torch
from tests.support.checkpoints import build_hf_checkpoint, hf_reference_model
from safetensors.torch import load_file, save_file

from cairn.workers import Engine
from cairn.workers.model import CheckpointError, config_from_dict, supported_model_types

IDS = [5, 17, 3, 99, 42, 7, 7, 120, 1, 64, 33]


def fuse_experts(path):
    """Rewrites transformers' per-expert tensors the way published Qwen3.5 MoE checkpoints
    store them: one gate_up_proj [E, 2I, H] and one down_proj [E, H, I] per layer."""
    weights = load_file(path / "model.safetensors")
    prefixes = sorted({k.split(".experts.")[0] for k in weights if ".experts." in k})
    for prefix in prefixes:
        n = len({k for k in weights if k.startswith(prefix + ".experts.") and k.endswith("down_proj.weight")})
        gate_up = [torch.cat((weights.pop(f"{prefix}.experts.{e}.gate_proj.weight"),
                              weights.pop(f"{prefix}.experts.{e}.up_proj.weight"))) for e in range(n)]
        down = [weights.pop(f"{prefix}.experts.{e}.down_proj.weight") for e in range(n)]
        weights[f"{prefix}.experts.gate_up_proj"] = torch.stack(gate_up)
        weights[f"{prefix}.experts.down_proj"] = torch.stack(down)
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    return prefixes


@pytest.fixture(scope="module")
def q35_moe_vl(tmp_path_factory):
    return build_hf_checkpoint(tmp_path_factory.mktemp("q35-moe-vl"), "q35_moe_vl")


def test_published_fused_experts_load_the_same_model(q35_moe_vl, tmp_path):
    fused = tmp_path / "fused"
    shutil.copytree(q35_moe_vl, fused)
    assert fuse_experts(fused), "the checkpoint has MoE layers"
    with torch.no_grad():
        expected = hf_reference_model(q35_moe_vl)(torch.tensor([IDS])).logits[0].float()
    got = Engine.from_pretrained(fused, num_pages=8, max_num_seqs=1).prompt_logits(IDS)
    torch.testing.assert_close(got, expected, atol=2e-4, rtol=1e-4)


def test_the_language_models_loader_skips_the_vision_tower_and_the_engine_reads_it_once(q35_moe_vl, loader_reads):
    from cairn.workers.model import load_model

    visual = sorted(k for k in load_file(q35_moe_vl / "model.safetensors") if k.startswith("model.visual."))
    assert visual
    load_model(q35_moe_vl)
    read = loader_reads["whole"] + loader_reads["sliced"]
    assert read and not [n for n in read if n.startswith("model.visual.")]
    for names in loader_reads.values():
        names.clear()
    engine = Engine.from_pretrained(q35_moe_vl, num_pages=8, max_num_seqs=1)
    read = loader_reads["whole"] + loader_reads["sliced"]
    assert sorted(n for n in read if n.startswith("model.visual.")) == visual  # by the tower's loader, once each
    assert engine.runner.encoder is not None
    assert engine.prompt_logits(IDS[:3]).shape == (3, engine.config.vocab_size)


def edit(path, change):
    cfg = json.loads((path / "config.json").read_text())
    change(cfg)
    (path / "config.json").write_text(json.dumps(cfg))


def set_in(keys, value):
    def change(cfg):
        node = cfg
        for key in keys[:-1]:
            node = node[key]
        if value is None:
            node.pop(keys[-1], None)
        else:
            node[keys[-1]] = value
    return change


@pytest.mark.parametrize("keys, value, field", [
    (["text_config"], None, "text_config"),
    (["text_config", "model_type"], "qwen3_next", "text_config.model_type"),
    (["text_config", "hidden_act"], "gelu", "text_config.hidden_act"),
    (["text_config", "attn_output_gate"], False, "text_config.attn_output_gate"),
    (["text_config", "layer_types"], ["mamba"] * 4, "text_config.layer_types"),
    (["text_config", "rope_parameters", "mrope_section"], [2, 2, 2], "text_config.rope_parameters.mrope_section"),
    (["text_config", "rope_parameters", "rope_type"], "yarn", "text_config.rope_parameters.rope_type"),
    (["text_config", "num_experts"], None, "text_config.num_experts"),
    (["text_config", "num_experts_per_tok"], 99, "text_config.num_experts_per_tok"),
])
def test_unsupported_qwen3_5_fields_are_named(q35_moe_vl, tmp_path, keys, value, field):
    bad = tmp_path / "bad"
    shutil.copytree(q35_moe_vl, bad)
    edit(bad, set_in(keys, value))
    with pytest.raises(CheckpointError, match=f"config.json: field '{field}'"):
        Engine.from_pretrained(bad)


def test_unknown_model_type_names_the_supported_ones():
    with pytest.raises(CheckpointError, match="'model_type' is 'mamba2'.*'qwen3_5'.*'qwen3_5_moe_text'.*'qwen3_next'"):
        config_from_dict({"model_type": "mamba2"})
    assert {"qwen3_next", "qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text"} <= set(supported_model_types())


# The shape of a published Qwen3.5 vision-language config.json (Qwen3.5-9B's fields, small sizes).
PUBLISHED = {
    "architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5", "image_token_id": 248056,
    "video_token_id": 248057, "vision_start_token_id": 248053, "vision_end_token_id": 248054,
    "tie_word_embeddings": False, "transformers_version": "4.57.0.dev0",
    "text_config": {
        "model_type": "qwen3_5_text", "attn_output_gate": True, "dtype": "bfloat16", "eos_token_id": 248044,
        "full_attention_interval": 4, "head_dim": 32, "hidden_act": "silu", "hidden_size": 64,
        "initializer_range": 0.02, "intermediate_size": 96, "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": 16, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
        "linear_value_head_dim": 16, "mamba_ssm_dtype": "float32", "max_position_embeddings": 262144,
        "mtp_num_hidden_layers": 1, "mtp_use_dedicated_embeddings": False, "num_attention_heads": 4,
        "num_hidden_layers": 8, "num_key_value_heads": 2, "rms_norm_eps": 1e-06, "use_cache": True,
        "vocab_size": 1000, "attention_bias": False, "attention_dropout": 0.0,
        "rope_parameters": {"mrope_interleaved": True, "mrope_section": [2, 1, 1], "rope_type": "default",
                            "rope_theta": 10000000, "partial_rotary_factor": 0.25},
    },
    "vision_config": {"depth": 27, "hidden_size": 1152, "model_type": "qwen3_5"},
}


def test_published_qwen3_5_config_reads_every_field(caplog):
    with caplog.at_level(logging.WARNING):
        cfg = config_from_dict(PUBLISHED)
    assert not caplog.records, [r.getMessage() for r in caplog.records]
    assert cfg.model_type == "qwen3_5" and cfg.attention_layers == [3, 7] and cfg.num_experts == 0
    assert cfg.rope_theta == 1e7 and cfg.rotary_dim == 8 and cfg.mrope_section == (2, 1, 1)
    assert cfg.eos_token_ids == (248044,) and cfg.torch_dtype == "bfloat16" and not cfg.tie_word_embeddings


def test_a_field_nobody_knows_is_named_in_a_warning(caplog):
    raw = json.loads(json.dumps(PUBLISHED))
    raw["text_config"]["sliding_window_pattern"] = 4
    with caplog.at_level(logging.WARNING):
        config_from_dict(raw)
    assert "text_config.sliding_window_pattern" in caplog.text


@pytest.mark.parametrize("kind", ["moe", "q35_dense_vl", "q35_moe"])
def test_pools_take_the_families_state_shapes_as_transformers_caches_them(hf_checkpoint, kind):
    from transformers import DynamicCache

    path = hf_checkpoint(kind)
    engine = Engine.from_pretrained(path, num_pages=8, max_num_seqs=1)
    hf = hf_reference_model(path)
    cache = DynamicCache(config=hf.config.get_text_config())
    with torch.no_grad():
        hf(torch.tensor([IDS]), cache=cache, use_cache=True)
    caches = engine.runner.caches
    recurrent = [layer for layer in cache.layers if hasattr(layer, "recurrent_states")]
    attention = [layer for layer in cache.layers if not hasattr(layer, "recurrent_states")]
    assert caches.ssm_states.shape[1] == len(recurrent) and len(caches.kv) == len(attention)
    for layer in recurrent:
        assert tuple(caches.ssm_states.shape[2:]) == tuple(layer.recurrent_states[0].shape[1:])
        channels, kernel = layer.conv_states[0].shape[1:]  # transformers keeps the whole kernel window
        assert tuple(caches.conv_states.shape[2:]) == (channels, kernel - 1)
    for (k, _), layer in zip(caches.kv, attention):
        assert (k.shape[2], k.shape[3]) == (layer.keys.shape[1], layer.keys.shape[3])  # kv heads, head dim
