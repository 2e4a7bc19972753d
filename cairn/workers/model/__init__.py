"""The hybrid models cairn runs: one normalised config, shared layers over a varlen paged batch,
a family per published architecture (cairn.workers.model.family_registry), and the loader.

Imported lazily (PEP 562), as `workers` is: `cairn.workers.model.model_config` (what plans and the arena
read) loads without the layers, and so without torch."""

from __future__ import annotations

from cairn.workers.lazy import lazy_exports

_WHERE = {
    "ForwardBatch": "cairn.workers.model.batch", "CheckpointError": "cairn.workers.model.model_config",
    "ModelConfig": "cairn.workers.model.model_config", "HybridForCausalLM": "cairn.workers.model.hybrid",
    "ModelCaches": "cairn.workers.model.hybrid", "load_model": "cairn.workers.model.loader", "FAMILIES": "cairn.workers.model.family_registry",
    "config_from_dict": "cairn.workers.model.model_types", "read_model_config": "cairn.workers.model.model_types",
    "supported_model_types": "cairn.workers.model.model_types",
}
__all__ = sorted(_WHERE)


__getattr__, __dir__ = lazy_exports(__name__, _WHERE)
