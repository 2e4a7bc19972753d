"""The hybrid models cairn runs: one normalised config, shared layers over a varlen paged batch,
a family per published architecture (workers.model.registry), and the loader.

Imported lazily (PEP 562), as `workers` is: `workers.model.config` (what plans and the arena
read) loads without the layers, and so without torch."""

from __future__ import annotations

from workers.lazy import lazy_exports

_WHERE = {
    "ForwardBatch": "workers.model.batch", "CheckpointError": "workers.model.config",
    "ModelConfig": "workers.model.config", "HybridForCausalLM": "workers.model.hybrid",
    "ModelCaches": "workers.model.hybrid", "load_model": "workers.model.loader", "FAMILIES": "workers.model.registry",
    "config_from_dict": "workers.model.model_types", "read_model_config": "workers.model.model_types",
    "supported_model_types": "workers.model.model_types",
}
__all__ = sorted(_WHERE)


__getattr__, __dir__ = lazy_exports(__name__, _WHERE)
