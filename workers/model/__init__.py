"""The hybrid models cairn runs: one normalised config, shared layers over a varlen paged batch,
a family per published architecture (workers.model.registry), and the loader."""

from workers.model.batch import ForwardBatch
from workers.model.config import CheckpointError, ModelConfig
from workers.model.hybrid import HybridForCausalLM, ModelCaches
from workers.model.loader import load_model
from workers.model.registry import FAMILIES, config_from_dict, read_model_config, supported_model_types

__all__ = ["CheckpointError", "FAMILIES", "ForwardBatch", "HybridForCausalLM", "ModelCaches", "ModelConfig",
           "config_from_dict", "load_model", "read_model_config", "supported_model_types"]
