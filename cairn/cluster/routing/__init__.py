"""Request routing: send each request to the engine replica where it recomputes the least.

Split along its contracts, each module's doc stating its rules:
- `routing_config`: `RoutingConfig` (cairn/configs/routing.yaml) and the router class paths per policy.
- `cost`: cost in tokens and `rank_replicas`, pure functions.
- `predicted`: `PredictedHolders`, what this router sent where (fresh predictions, and the
  fallback memory while the index cannot answer).
- `ranker`: `AffinityRanker`, one router's state and decisions.
- `registry`: the routers of this process, which the ingress reports first outputs to and reads
  counters from (a module of its own: Serve ships the router's module by value).
- `index_handle`: `IndexHandle`, the one way to the cache index actor, for routers and replicas.
- `router`: the Ray Serve adapters, `CacheAffinityRouter` and `RayPrefixRouter`.
`cost`, `predicted`, `ranker` and `router_registry` import no Ray (tests/test_architecture.py): the
decisions are tested as plain Python. Nothing here imports the rest of `cluster`. This file
imports nothing, so importing a pure module never pulls in Ray.
"""
