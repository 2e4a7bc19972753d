"""`EngineSpec`: the facts about an engine that the rest of a deployment must agree on, made once.

- `fingerprint`: names the model (cairn.cache_service.hashing), so pages of another model never match;
- `page_size`: tokens per KV page, the unit of page hashes, checkpoints and routing scores;
- `max_model_len`: the longest sequence (prompt + output, tokens) the engine runs: the option
  if given, capped by the model's `max_position_embeddings`;
- `recurrent`: the model has recurrent layers, so a worker resumes at its deepest state
  checkpoint, not at its page hit (cairn.cache_service.scoring.resume_at_token);
- `vocab_size`: token ids are in [0, vocab_size);
- `page_bytes`, `state_bytes`: what one KV page (every attention layer's K and V) and one
  recurrent state (every linear layer's conv and delta-rule state; 0 without recurrent layers)
  take on one device, in the dtype the engine runs in (`cairn.workers.precision.run_dtype`). Under tensor
  parallelism, on one rank: each rank holds its heads' share (`cairn.workers.model.sharding`) and
  copies it over its own link. The arena's sizes (`cairn.workers.cache.arena`): a state slot adds at most
  15 bytes of alignment. The router prices copying them back from host memory with them.

The engine, the ingress (through either engine client) and the router's config all read this
one value; nothing re-derives these facts. `EngineSpec.from_model_dir` reads config.json and the
weight files' names and sizes, never the weights, so the deploy step and the ingress build the
very value each engine builds. Immutable and picklable: it travels to Ray replicas as is.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields
from pathlib import Path

from cairn.cache_service.hashing import branch_root, fingerprint, model_fingerprint, page_hashes, root_hash
from cairn.workers.cache.arena import DTYPE_BYTES, conv_state_bytes, page_bytes, ssm_state_bytes
from cairn.workers.model.model_config import ModelConfig
from cairn.workers.model.model_types import read_model_config
from cairn.workers.model.sharding import shard_config
from cairn.workers.engine_options import EngineOptions
from cairn.workers.precision import run_dtype


@dataclass(frozen=True)
class EngineSpec:
    fingerprint: str
    page_size: int       # tokens
    max_model_len: int   # tokens, prompt + output
    recurrent: bool
    vocab_size: int
    page_bytes: int = 0   # bytes, on one device; 0: not known (a spec made by hand), copies look free
    state_bytes: int = 0  # bytes, on one device; 0 also for a model without recurrent layers

    @classmethod
    def of(cls, cfg: ModelConfig, options: EngineOptions, model_fingerprint: str | None = None) -> EngineSpec:
        """The spec of a model in memory, `cfg` as one device holds it (under tensor parallelism,
        a rank's `shard_config`, as an engine's model has it); without a checkpoint's
        fingerprint, its config names it."""
        if model_fingerprint is None:
            model_fingerprint = fingerprint({f.name: getattr(cfg, f.name) for f in fields(cfg) if f.compare})
        limit = cfg.max_position_embeddings
        dtype_bytes = DTYPE_BYTES[run_dtype(options, cfg.torch_dtype)]
        state = conv_state_bytes(cfg, dtype_bytes) + ssm_state_bytes(cfg) if cfg.recurrent else 0
        return cls(fingerprint=model_fingerprint, page_size=options.page_size,
                   max_model_len=min(options.max_model_len or limit, limit),
                   recurrent=cfg.recurrent, vocab_size=cfg.vocab_size,
                   page_bytes=page_bytes(cfg, options.page_size, dtype_bytes), state_bytes=state)

    @classmethod
    def from_model_dir(cls, model_dir: str | Path, options: EngineOptions | None = None) -> EngineSpec:
        """The spec an engine loading `model_dir` with `options` will have (reads no weights),
        sized from a rank's shard. A `tensor_parallel_size` the model's shapes do not divide is
        left to the engine to refuse (it does, when it starts); the sizes are then the whole
        model's."""
        model_dir = Path(model_dir)
        options = options or EngineOptions()
        cfg = read_model_config(model_dir / "config.json")
        try:
            cfg = shard_config(cfg, options.tensor_parallel_size)
        except ValueError:
            pass
        return cls.of(cfg, options, model_fingerprint(model_dir))

    def hash_root(self, cache_salt: str | None = None, tenant: str | None = None) -> bytes:
        """The root of this engine's page-hash chains for `tenant` under `cache_salt`: what a
        request carries."""
        return root_hash(self.fingerprint, self.page_size, cache_salt, tenant)

    def page_hashes(self, token_ids: Sequence[int], root: bytes, shared_pages: int = 0) -> list[bytes]:
        """The hashes of a prompt's whole pages under `root` (one per page_size tokens). With
        `shared_pages`, the first ones are a public prefix every root shares: they hash under the
        unsalted, tenant-less root, and the chain branches back to `root` after them
        (`cairn.cache_service.hashing.branch_root`). Only a prompt with a whole page of its own after
        the prefix branches: otherwise its output pages would chain off the shared ones."""
        ps = self.page_size
        if shared_pages <= 0 or len(token_ids) // ps <= shared_pages:
            return page_hashes(token_ids, ps, root)
        shared = page_hashes(token_ids[:shared_pages * ps], ps, self.hash_root())
        return shared + page_hashes(token_ids, ps, root, start=shared_pages, parent=branch_root(shared[-1], root))
