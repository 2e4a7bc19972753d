"""Which `config.json` cairn reads, and how: `model_type` -> the family's config reader.

The torch-free half of the family registry (`cairn.workers.model.family_registry` adds the model classes):
the deploy step, the ingress, `EngineSpec` and the router read a checkpoint's config through
here without loading torch. Adding a family is its config reader's line here and its
`Family`'s line in the registry; `read_model_config` and `config_from_dict` refuse a
`model_type` nobody registered, naming the ones that are.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from cairn.workers.model import qwen3_5_config, qwen3_next_config
from cairn.workers.model.model_config import CheckpointError, ModelConfig, read_json

ConfigReader = Callable[[dict[str, Any], str], ModelConfig]

# family name -> (the `model_type`s it reads, its reader)
FAMILY_CONFIGS: dict[str, tuple[tuple[str, ...], ConfigReader]] = {
    "qwen3_next": (("qwen3_next",), qwen3_next_config.read_config),
    "qwen3_5": (("qwen3_5", "qwen3_5_text"), qwen3_5_config.read_dense_config),
    "qwen3_5_moe": (("qwen3_5_moe", "qwen3_5_moe_text"), qwen3_5_config.read_moe_config),
}
_FAMILY_OF = {t: name for name, (types, _) in FAMILY_CONFIGS.items() for t in types}


def supported_model_types() -> list[str]:
    return sorted(_FAMILY_OF)


def family_name_for(raw: dict[str, Any], source: str = "config.json") -> str:
    """The name of the family that reads this `config.json`."""
    model_type = raw.get("model_type")
    if model_type not in _FAMILY_OF:
        raise CheckpointError(f"{source}: field 'model_type' is {model_type!r}; cairn runs "
                              f"{', '.join(repr(t) for t in supported_model_types())}")
    return _FAMILY_OF[model_type]


def config_from_dict(raw: dict[str, Any], source: str = "config.json") -> ModelConfig:
    return FAMILY_CONFIGS[family_name_for(raw, source)][1](raw, source)


def read_model_config(path: str | Path) -> ModelConfig:
    """The `ModelConfig` of a checkpoint's `config.json`, whichever registered family wrote it."""
    return config_from_dict(read_json(path), str(path))
