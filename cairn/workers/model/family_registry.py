"""Which family runs a checkpoint: `config.json`'s `model_type` -> cairn.workers.model.family.Family.

Adding a family is one module (cairn/workers/model/<family>.py, exporting its `Family`) plus its line
in `FAMILIES` below, and its config reader's line in `cairn.workers.model.model_types` (the
torch-free half, which `read_model_config` and `config_from_dict` are). `family_for` refuses a
`model_type` nobody registered, naming the ones that are.
"""

from __future__ import annotations

from typing import Any

from cairn.workers.model import qwen3_5, qwen3_next
from cairn.workers.model.family import Family
from cairn.workers.model.model_types import FAMILY_CONFIGS, config_from_dict, family_name_for, read_model_config

__all__ = ["FAMILIES", "config_from_dict", "family_for", "family_named", "read_model_config"]

FAMILIES: tuple[Family, ...] = (
    qwen3_next.FAMILY,
    *qwen3_5.FAMILIES,
)
_BY_NAME = {f.name: f for f in FAMILIES}
assert _BY_NAME.keys() == FAMILY_CONFIGS.keys(), "every family has a config reader in cairn.workers.model.model_types"


def family_for(raw: dict[str, Any], source: str = "config.json") -> Family:
    return _BY_NAME[family_name_for(raw, source)]


def family_named(name: str) -> Family:
    """The family a `ModelConfig.model_type` names."""
    return _BY_NAME[name]
