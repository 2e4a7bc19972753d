"""The Qwen3-Next hybrid model: its config, its layers over a varlen paged batch, its loader."""

from workers.model.batch import ForwardBatch
from workers.model.config import CheckpointError, ModelConfig
from workers.model.loader import load_model
from workers.model.qwen3_next import ModelCaches, Qwen3NextForCausalLM

__all__ = ["CheckpointError", "ForwardBatch", "ModelCaches", "ModelConfig", "Qwen3NextForCausalLM", "load_model"]
