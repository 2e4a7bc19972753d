"""A checkpoint we cannot run is refused with a message naming the file and the field or
tensor at fault; the published checkpoints' older config spelling loads."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from cairn.workers import Engine
from cairn.workers.model import CheckpointError, config_from_dict


@pytest.fixture
def ckpt(hf_checkpoint, tmp_path):
    dst = tmp_path / "ckpt"
    shutil.copytree(hf_checkpoint("dense"), dst)
    return dst


def edit_config(path, **changes):
    cfg = json.loads((path / "config.json").read_text())
    for k, v in changes.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    (path / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize("changes, field", [
    (dict(model_type="llama"), "model_type"),
    (dict(hidden_size=None), "hidden_size"),
    (dict(num_hidden_layers=-1), "num_hidden_layers"),
    (dict(layer_types=["linear_attention"]), "layer_types"),
    (dict(layer_types=["mamba"] * 4), "layer_types"),
    (dict(num_key_value_heads=3), "num_key_value_heads"),
    (dict(linear_num_value_heads=5), "linear_num_value_heads"),
    (dict(hidden_act="gelu"), "hidden_act"),
    (dict(rope_parameters={"rope_type": "yarn", "factor": 4.0}), "rope_parameters.rope_type"),
    (dict(dtype="float8"), "dtype"),
])
def test_bad_config_fields_are_named(ckpt, changes, field):
    edit_config(ckpt, **changes)
    with pytest.raises(CheckpointError, match=f"config.json: field '{field}'"):
        Engine.from_pretrained(ckpt)


def test_missing_or_broken_files_are_named(ckpt, tmp_path):
    with pytest.raises(CheckpointError, match="not a directory"):
        Engine.from_pretrained(tmp_path / "nope")
    (ckpt / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="config.json: not valid JSON"):
        Engine.from_pretrained(ckpt)


def test_missing_weights_file_is_named(ckpt):
    (ckpt / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="no model.safetensors"):
        Engine.from_pretrained(ckpt)
    (ckpt / "model.safetensors").write_bytes(b"garbage")
    with pytest.raises(CheckpointError, match="model.safetensors: not a readable safetensors"):
        Engine.from_pretrained(ckpt)


def test_missing_and_misshapen_tensors_are_named(ckpt):
    weights = load_file(ckpt / "model.safetensors")
    name = "model.layers.0.linear_attn.A_log"
    save_file({k: v for k, v in weights.items() if k != name}, ckpt / "model.safetensors")
    with pytest.raises(CheckpointError, match=f"model.safetensors: missing tensor '{name}'"):
        Engine.from_pretrained(ckpt)
    weights[name] = torch.zeros(3)
    save_file(weights, ckpt / "model.safetensors")
    with pytest.raises(CheckpointError, match=rf"tensor '{name}' has shape \(3,\)"):
        Engine.from_pretrained(ckpt)


def test_published_config_spelling_loads():
    raw = {"model_type": "qwen3_next", "vocab_size": 100, "hidden_size": 32, "intermediate_size": 64,
           "num_hidden_layers": 8, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
           "full_attention_interval": 4, "rope_theta": 10000000, "partial_rotary_factor": 0.25,
           "eos_token_id": 7}
    cfg = config_from_dict(raw)
    assert cfg.attention_layers == [3, 7] and cfg.rope_theta == 1e7 and cfg.rotary_dim == 4
    assert cfg.eos_token_ids == (7,)


def test_mtp_tensors_of_published_checkpoints_are_ignored(ckpt, hf_checkpoint):
    weights = load_file(ckpt / "model.safetensors")
    weights["mtp.fc.weight"] = torch.zeros(4, 4)
    save_file(weights, ckpt / "model.safetensors")
    ids = [1, 2, 3, 4, 5]
    torch.testing.assert_close(Engine.from_pretrained(ckpt, num_pages=4).prompt_logits(ids),
                               Engine.from_pretrained(hf_checkpoint("dense"), num_pages=4).prompt_logits(ids))
