"""`EngineSpec`: the facts about an engine that the rest of a deployment must agree on, made once.

- `fingerprint`: names the model (cache_service.hashing), so pages of another model never match;
- `page_size`: tokens per KV page, the unit of page hashes, checkpoints and routing scores;
- `max_model_len`: the longest sequence (prompt + output, tokens) the engine runs: the option
  if given, capped by the model's `max_position_embeddings`;
- `recurrent`: the model has recurrent layers, so a worker resumes at its deepest state
  checkpoint, not at its page hit (cache_service.scoring.resume_at_token);
- `vocab_size`: token ids are in [0, vocab_size).

The engine, the ingress (through either engine client) and the router's config all read this
one value; nothing re-derives these facts. `EngineSpec.from_model_dir` reads config.json and the
weight files' names and sizes, never the weights, so the deploy step and the ingress build the
very value each engine builds. Immutable and picklable: it travels to Ray replicas as is.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields
from pathlib import Path

from cache_service.hashing import branch_root, fingerprint, model_fingerprint, page_hashes, root_hash
from workers.model.config import ModelConfig
from workers.model.registry import read_model_config
from workers.options import EngineOptions


@dataclass(frozen=True)
class EngineSpec:
    fingerprint: str
    page_size: int       # tokens
    max_model_len: int   # tokens, prompt + output
    recurrent: bool
    vocab_size: int

    @classmethod
    def of(cls, cfg: ModelConfig, options: EngineOptions, model_fingerprint: str | None = None) -> EngineSpec:
        """The spec of a model in memory; without a checkpoint's fingerprint, its config names it."""
        if model_fingerprint is None:
            model_fingerprint = fingerprint({f.name: getattr(cfg, f.name) for f in fields(cfg) if f.compare})
        limit = cfg.max_position_embeddings
        return cls(fingerprint=model_fingerprint, page_size=options.page_size,
                   max_model_len=min(options.max_model_len or limit, limit),
                   recurrent=cfg.has_recurrent_layers, vocab_size=cfg.vocab_size)

    @classmethod
    def from_model_dir(cls, model_dir: str | Path, options: EngineOptions | None = None) -> EngineSpec:
        """The spec an engine loading `model_dir` with `options` will have (reads no weights)."""
        model_dir = Path(model_dir)
        cfg = read_model_config(model_dir / "config.json")
        return cls.of(cfg, options or EngineOptions(), model_fingerprint(model_dir))

    def hash_root(self, cache_salt: str | None = None, tenant: str | None = None) -> bytes:
        """The root of this engine's page-hash chains for `tenant` under `cache_salt`: what a
        request carries."""
        return root_hash(self.fingerprint, self.page_size, cache_salt, tenant)

    def page_hashes(self, token_ids: Sequence[int], root: bytes, shared_pages: int = 0) -> list[bytes]:
        """The hashes of a prompt's whole pages under `root` (one per page_size tokens). With
        `shared_pages`, the first ones are a public prefix every root shares: they hash under the
        unsalted, tenant-less root, and the chain branches back to `root` after them
        (`cache_service.hashing.branch_root`). Only a prompt with a whole page of its own after
        the prefix branches: otherwise its output pages would chain off the shared ones."""
        ps = self.page_size
        if shared_pages <= 0 or len(token_ids) // ps <= shared_pages:
            return page_hashes(token_ids, ps, root)
        shared = page_hashes(token_ids[:shared_pages * ps], ps, self.hash_root())
        return shared + page_hashes(token_ids, ps, root, start=shared_pages, parent=branch_root(shared[-1], root))
