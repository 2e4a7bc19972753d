"""cairn: a Ray Serve cluster for hybrid LLMs (full attention + Gated DeltaNet) whose prefix cache
keeps working when chat templates rewrite history.

One import package, so that nothing cairn installs takes a generic top-level name another
distribution may also use (transformers depends on Hugging Face's `kernels`). Its rooms:

- `cairn.workers`: one engine per device (model, prefix cache, scheduler, runner, sampler). No Ray.
- `cairn.kernels`: the ops the model runs (Triton, C++ on CPU, torch references).
- `cairn.cache_service`: page hashing, cache events, the cluster-wide cache index and its actor.
- `cairn.cluster`: Ray Serve (ingress, engine replicas, cache-affinity routing, the HTTP API, the CLI).
- `cairn.configs`: Serve, cluster and routing configs, shipped as package data.

Importing `cairn` loads nothing else: each room is imported by name.
"""
