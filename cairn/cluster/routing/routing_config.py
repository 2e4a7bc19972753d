"""How requests are routed to engine replicas: one pydantic model, loadable from
cairn/configs/routing.yaml, that also yields the deployment's Ray Serve `RequestRouterConfig`.

Policies (`policy`):
- `cache_affinity` (default): `cairn.cluster.routing.router.CacheAffinityRouter` — the cache index's
  resume point per replica plus load (this repository).
- `pow2`: Ray Serve's default, power of two choices on queue length.
- `round_robin`: Ray Serve's experimental `RoundRobinRouter`.
- `ray_prefix`: Ray Serve LLM's `PrefixCacheAffinityRouter` (a character prefix tree over the
  request's `.prompt` / `.messages`, imported from ray.llm without the ray[llm] extra);
  `ray_prefix_options` go to its `initialize_state`.
Unknown keys are refused, so a misspelt field fails loudly instead of silently defaulting.
`page_size`, `recurrent`, `page_bytes` and `state_bytes` are the engines' (`for_engines`),
never guessed.

A router class path names the module that defines the class (`cairn.cluster.routing.router`), never a
package: Serve ships that module by value, and a package path would ship every module under it,
the process-wide router registry included (see `cairn.cluster.routing.router_registry`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

ROUTER_CLASSES = {
    "cache_affinity": "cairn.cluster.routing.router:CacheAffinityRouter",
    "pow2": "ray.serve._private.request_router.pow_2_router:PowerOfTwoChoicesRequestRouter",
    "round_robin": "ray.serve.experimental.round_robin_router:RoundRobinRouter",
    # Ray Serve LLM's PrefixCacheAffinityRouter, reading a None `.messages` as absent (see there)
    "ray_prefix": "cairn.cluster.routing.router:RayPrefixRouter",
}

# the description's end of every field the deployment takes from the engines' spec (`for_engines`)
FROM_ENGINES = ("Leave it unset: the deployment takes it from the engines (workers.EngineSpec); a value that "
                "differs from theirs fails the deploy.")


class RoutingConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    policy: Literal["cache_affinity", "pow2", "round_robin", "ray_prefix"] = Field(
        "cache_affinity", description="Which request router the engine deployment uses (see the module doc).")
    index_actor_name: str = Field(
        "cairn-cache-index", min_length=1, description="Name of the detached cache-index actor (one per cluster).")
    index_actor_namespace: str = Field(
        "cairn", min_length=1, description="Ray namespace the index actor is registered in.")
    index_mode: Literal["mirror", "remote"] = Field(
        "mirror", description="How the router reads the index. mirror: it keeps a local copy, fed by the index "
        "actor's change feed in the background, and scores each request locally (no round trip per request; "
        "memory: a copy of the index per router). remote: it asks the actor per request, waiting at most "
        "index_timeout_ms.")
    index_staleness_s: float = Field(
        2.0, ge=0.1, description="mirror mode: a mirror not heard from the index for this long counts as "
        "unavailable (requests route by load and the router's memory, counted in "
        "cairn_router_index_fallbacks_total).")
    index_timeout_ms: float = Field(
        20.0, gt=0, description="remote mode: how long the router waits for the index's scores before routing "
        "by load alone (counted in cairn_router_index_fallbacks_total).")
    load_weight: float = Field(
        0.5, ge=0, description="Tokens of cost per token of load: cost = prefill tokens left after the "
        "resume point + load_weight * load tokens. Below 1 favours reuse over balance (a twin's in-flight "
        "prefill of a shared prefix is work the new request shares, not only waits for); 0 routes by cache alone.")
    request_load_tokens: int = Field(
        64, ge=0, description="Load tokens each in-flight request adds besides its own prefill (its decode "
        "and scheduling share; small, since a continuously batched decode adds one token per step to the "
        "steps a new prompt's prefill runs in).")
    occupancy_load_tokens: int = Field(
        2048, ge=0, description="Load tokens of a replica whose pages or state slots are all in use, "
        "from its reported routing stats (scales with the fraction in use).")
    spill_limit: int = Field(
        8, ge=1, description="In-flight requests a replica may have above the least-loaded one before "
        "cache affinity stops preferring it: a hot prefix spills to the next replica instead of piling up.")
    predicted_holder_ttl_s: float = Field(
        2.0, ge=0, description="How long a replica just sent a prompt counts as holding its pages (and a "
        "state at their end), so a burst sharing a new prefix sticks together before its events arrive. "
        "0 disables.")
    fallback_memory_s: float = Field(
        600.0, ge=0, description="How long the router remembers which replica it sent each prompt to. Used only "
        "when the index cannot answer (down, slow, restarting): the remembered replica counts as holding the "
        "prompt's pages and a state at their end, so conversations keep their replica. 0 disables.")
    fallback_memory_pages: int = Field(
        500_000, ge=0, description="Bound on the page hashes that memory holds (oldest forgotten first; "
        "roughly 150 bytes each; at least 10,000 are kept for the fresh predictions).")
    page_size: int | None = Field(
        None, ge=1, description="Tokens per KV page (the page hashes' unit). " + FROM_ENGINES)
    recurrent: bool | None = Field(
        None, description="The model has recurrent layers: a replica resumes at its deepest state "
        "checkpoint, pages beyond it are recomputed; false: at its page hit (attention only). " + FROM_ENGINES)
    page_bytes: int | None = Field(
        None, ge=0, description="Bytes one KV page takes on one device (with tensor parallelism, on one rank): "
        "what bringing a page back from host memory copies. " + FROM_ENGINES)
    state_bytes: int | None = Field(
        None, ge=0, description="Bytes one recurrent state takes on one device (one rank): what bringing a "
        "checkpoint back from host memory copies; 0 without recurrent layers. " + FROM_ENGINES)
    host_bandwidth_bytes_per_s: float = Field(
        20e9, gt=0, description="Bytes per second a replica copies from its host memory back to its device "
        "(PCIe-class; each rank over its own link): a hit on the host costs the copy time, not nothing. Used "
        "only until the replica reports the bandwidth its engine measured (routing stats).")
    prefill_tokens_per_s: float = Field(
        10_000.0, gt=0, description="Prefill tokens per second a replica computes. It converts the seconds of "
        "copying host pages and a host state back to the device into tokens of cost, the unit of every other "
        "term: a copy slower than recomputing those tokens loses to a replica that recomputes them. Used only "
        "until the replica reports the prefill rate its engine measured (routing stats).")
    fetch: bool = Field(
        True, description="Move and fetch: a replica resuming a request less deep than another one pulls the "
        "pages and checkpoint it lacks from that holder (cairn.cluster.replica_peer_fetch) instead of recomputing them, and "
        "the router prices that option (the transfer over fetch_bandwidth_bytes_per_s, and the wait for the holder's "
        "step and a round trip), so it can balance load without losing the cache. Off: a request resumes only from "
        "what its replica holds, so a turn the load term sends away from its conversation's replica recomputes what "
        "that replica holds. Turned off under tensor parallelism (a rank cannot fetch its slice).")
    fetch_bandwidth_bytes_per_s: float = Field(
        1.25e9, gt=0, description="Bytes per second one replica pulls from another (Ray's object store here; "
        "on GPU nodes the NIC, 100-400 Gb/s): a fetched resume point costs its transfer time in tokens.")
    step_seconds: float = Field(
        0.03, gt=0, description="A replica's step time until it reports the one its engine measured (routing "
        "stats): what a fetch from it waits for, at most (a decode step of a loaded GPU engine; a step that "
        "prefills takes longer).")
    fetch_round_trip_s: float = Field(
        0.005, ge=0, description="Seconds a fetch takes besides its transfer and the holder's step: the ask "
        "reaching the holder and the answer reaching the receiver's engine. The router prices a fetch's wait as "
        "the holder's step (the step time it reports) plus this.")
    fetch_timeout_s: float = Field(
        10.0, gt=0, description="How long a replica waits for a holder's pages before recomputing them "
        "(counted in cairn_engine_fetch_fallbacks_total{kind=\"timeout\"}). The holder copies them between two "
        "of its steps, so the wait includes the rest of its current step: milliseconds on a GPU, up to 6 s "
        "measured on 2 CPU cores with 4 conversations in flight (2 s timed out 10 of 16 fetches there).")
    routing_stats_period_s: float = Field(
        2.0, gt=0, description="How often Serve collects each replica's record_routing_stats().")
    redis_url: str | None = Field(
        None, description="Redis holding the cache index (redis://host:port/db); the index then survives "
        "actor restarts. The host ray-head names the Ray head node, where cairn/configs/cluster.yaml runs Redis. "
        "None: in the actor's memory, rebuilt by worker resyncs after a restart.")
    namespace: str = Field(
        "cairn", pattern=r"^[A-Za-z0-9_.-]+$", description="Key prefix of this cluster's index in Redis; "
        "clusters sharing one Redis need distinct namespaces.")
    index_max_pages: int = Field(
        4_000_000, ge=0, description="Bound on the (replica, page) entries the index holds in all.")
    ray_prefix_options: dict[str, Any] = Field(
        default_factory=dict, description="Keyword arguments for Ray's PrefixCacheAffinityRouter "
        "(policy ray_prefix), e.g. imbalanced_threshold, match_rate_threshold.")

    @classmethod
    def from_yaml(cls, path: str | Path) -> RoutingConfig:
        """Loads the YAML mapping at `path`; errors name the file and every bad field."""
        import yaml

        path = Path(path)
        data = yaml.safe_load(path.read_text()) or {}
        if not isinstance(data, dict):
            raise ValueError(f"{path}: expected a mapping of routing settings, got {type(data).__name__}")
        try:
            return cls.model_validate(data)
        except ValidationError as e:
            problems = "; ".join(f"{'.'.join(map(str, err['loc'])) or '(top)'}: {err['msg']} "
                                 f"(got {err.get('input')!r})" for err in e.errors())
            raise ValueError(f"{path}: invalid routing config: {problems}") from None

    def for_engines(self, spec: Any) -> RoutingConfig:
        """This config with the engines' `page_size`, `recurrent`, `page_bytes` and
        `state_bytes` (from their `workers.EngineSpec`); a value set here that differs is a
        ValueError naming both."""
        engines = {"page_size": spec.page_size, "recurrent": spec.recurrent, "page_bytes": spec.page_bytes,
                   "state_bytes": spec.state_bytes}
        for name, value in engines.items():
            mine = getattr(self, name)
            if mine is not None and mine != value:
                raise ValueError(f"routing {name} is {mine!r} but the engines' is {value!r}: the router would "
                                 f"misjudge every replica; leave {name} out of the routing config")
        return self.model_copy(update=engines)

    @property
    def router_class(self) -> str:
        return ROUTER_CLASSES[self.policy]

    def router_kwargs(self) -> dict[str, Any]:
        """What Serve passes to the router's initialize_state (JSON-serializable)."""
        if self.policy == "cache_affinity":
            return self.model_dump(mode="json")
        if self.policy == "ray_prefix":
            return dict(self.ray_prefix_options)
        return {}

    def request_router_config(self):
        """The deployment's `ray.serve.config.RequestRouterConfig` for this policy."""
        from ray.serve.config import RequestRouterConfig

        return RequestRouterConfig(request_router_class=self.router_class,
                                   request_router_kwargs=self.router_kwargs(),
                                   request_routing_stats_period_s=self.routing_stats_period_s)
