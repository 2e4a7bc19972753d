"""The Ray Serve application: an HTTP ingress in front of a deployment of engine replicas.

`build_application(model_dir, replicas, ...)` returns the bound application; `app_builder(args)`
is the same for `serve run` / `serve deploy` (`import_path: cairn.cluster.app:app_builder`, as in
cairn/configs/serve.yaml and cairn/configs/local.yaml). The parts:
- `Engine` deployment: `cairn.cluster.engine_replica.EngineReplica`, one engine per replica. Its
  request router comes from `RoutingConfig` (cache affinity by default, `cairn.cluster.routing`),
  which takes the engines' page size and recurrence from their `EngineSpec`. Each replica gets
  the deployment's `EngineOptions` whole (pickled with its other arguments, as the spec is).
  With `engine_options.tensor_parallel_size` N > 1 a replica is a placement group of N bundles
  (each `num_cpus` and `num_gpus`, `STRICT_PACK`: one node), Serve's `placement_group_bundles`:
  the replica runs in the first as rank 0 and starts its other ranks in the rest
  (`cairn.cluster.tp_ranks`). To the index and the router it is one worker, which fetches
  nothing from its peers, so the router's `fetch` is off for it.
- `Ingress` deployment: `cairn.cluster.ingress.Ingress`, the OpenAI-compatible HTTP API.

Engine options: `build_application` takes one `EngineOptions` (default `SERVED`: warm-up on,
every kernel compiled before a replica takes requests). `app_builder` is where a Serve config's
`engine_options` mapping becomes that value, the only place (`EngineOptions.from_config`, over
`SERVED`): a key that is no option, or a value out of range, fails there, at deploy, named. The
one change the deploy makes is `dtype` "auto", chosen here for the engines' device (a new value).

The model is a checkpoint directory or a Hugging Face id (`cairn.workers.model_source.ModelSource`).
The deploy step resolves an id once, to read the `EngineSpec`, and hands every replica and the
ingress the id pinned to the commit it read (`org/name@<commit>`): each resolves it on its own
node, from that node's cache or the hub, so the cluster needs no shared filesystem.

Replacing or removing a replica (a redeploy, scaling down) drains it: Serve stops routing to it
and waits up to `graceful_shutdown_timeout_s` (default 120 s, against Serve's 20: a long stream
must finish) for what it has in flight, checking every `graceful_shutdown_wait_loop_s`, on both
deployments; an engine replica then leaves the cache index (`cairn.cluster.engine_replica`). With
`autoscaling` (Serve's autoscaling_config) the engine replicas follow their queue: Serve's
`target_ongoing_requests` counts each replica's running and waiting requests.

Each engine replica admits up to `max_ongoing_requests` requests (default: the engine's
`max_num_seqs`, since the engine batches that many; Serve's own default of 5 would cap a replica
far below what its engine runs and make Serve, not the router, decide where load goes). Each
ingress replica admits `ingress_max_ongoing_requests` HTTP requests (default 1024): a streamed
completion holds its slot for its whole life, and with Serve's default of 5 a sixth concurrent
client would wait at the proxy for one of them to finish.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

from ray import serve

from cairn.cluster.api.http_limits import HTTPLimits
from cairn.cluster.api.api_options import APIOptions
from cairn.cluster.engine_replica import EngineReplica
from cairn.cluster.ingress import Ingress
from cairn.cluster.routing.routing_config import RoutingConfig
from cairn.workers.engine_options import SERVED, EngineOptions


def build_application(model_dir: str | Path | None = None, replicas: int = 2, *,
                      engine_options: EngineOptions = SERVED, routing: RoutingConfig | None = None,
                      num_cpus: float = 0.5, num_gpus: float = 0, ingress_replicas: int = 1,
                      api: APIOptions | dict[str, Any] | None = None, api_key: str | None = None,
                      api_keys: list[str] | None = None, api_keys_file: str | None = None,
                      metrics_key: str | None = None, api_key_digests: list[str] | None = None,
                      metrics_key_digest: str | None = None,
                      autoscaling: dict[str, Any] | None = None, max_ongoing_requests: int | None = None,
                      ingress_max_ongoing_requests: int = 1024, ingress_max_replicas_per_node: int | None = None,
                      health_check_period_s: float | None = None,
                      graceful_shutdown_timeout_s: float = 120.0, graceful_shutdown_wait_loop_s: float = 1.0):
    """The bound Serve application. `model_dir` is a directory or a Hugging Face id
    (`org/name[@revision]`); None serves the tiny demo model.
    `max_ongoing_requests` per engine replica defaults to the engine's max_num_seqs;
    `health_check_period_s` (Serve's default: 10) is how often the controller checks a replica,
    hence how soon it replaces one that died. `ingress_max_replicas_per_node` (Serve's
    max_replicas_per_node; None: no bound) spreads the ingress replicas over nodes: each node's
    proxy prefers an ingress replica on its own node. `api` (`cairn.cluster.api.api_options.APIOptions`,
    or its fields as a dict) goes whole to the ingress (`cairn.cluster.ingress.Ingress`), validated
    here, at deploy, not in every replica. Keys (`api_key`: one key of the tenant "default";
    `api_keys`: `[TENANT:]KEY` values; `metrics_key`) reach the ingress only as digests, beside
    any `api_key_digests` and `metrics_key_digest` given (`cairn.cluster.api.tenants`): Serve logs
    what it deploys."""
    from cairn.workers import EngineSpec, ModelSource, demo_model_dir
    from cairn.workers.model import read_model_config
    from cairn.workers.precision import choose_dtype

    from cairn.cluster.api.tenants import Tenants, key_digest

    api = api if isinstance(api, APIOptions) else APIOptions.model_validate(api or {})
    check_ingress_limits(api.http_limits)
    for name, instead in (("request_timeout_s", "Serve's http_options.request_timeout_s"),
                          ("echo_request_id", "Serve's proxy, which echoes X-Request-Id itself")):
        if name in api.model_fields_set:
            raise ValueError(f"{name}: behind Serve's proxy it is {instead}")
    digests = [*Tenants.load([*([f"default:{api_key}"] if api_key else []), *(api_keys or [])], environ={},
                             api_key_digests=api_key_digests or ()).digests()]
    if metrics_key:
        metrics_key_digest = key_digest(metrics_key)
    source = ModelSource.parse(model_dir or demo_model_dir("tiny"))
    local_dir = source.local_dir()
    source = source.pinned(local_dir)  # every node loads the snapshot the spec was read from
    options = engine_options  # what every replica runs: auto's dtype chosen once, here, for their device
    if options.dtype == "auto":
        config_dtype = read_model_config(Path(local_dir) / "config.json").torch_dtype
        options = replace(options, dtype=choose_dtype("auto", config_dtype, "cuda" if num_gpus else "cpu"))
    spec = EngineSpec.from_model_dir(local_dir, options)
    routing = (routing or RoutingConfig()).for_engines(spec)
    if options.tensor_parallel_size > 1 and routing.fetch:  # a rank cannot fetch its slice (engine_peer_fetch)
        routing = routing.model_copy(update=dict(fetch=False))  # so the router must not price a fetch
    placement: dict[str, Any] = dict(num_cpus=num_cpus, num_gpus=num_gpus)
    extra: dict[str, Any] = dict(graceful_shutdown_timeout_s=graceful_shutdown_timeout_s,
                                 graceful_shutdown_wait_loop_s=graceful_shutdown_wait_loop_s)
    if health_check_period_s is not None:
        extra["health_check_period_s"] = health_check_period_s
    engine_extra = dict(extra)
    tp = options.tensor_parallel_size
    if tp > 1:  # the replica is rank 0 in bundle 0; its other ranks take the others (cairn.cluster.tp_ranks)
        engine_extra.update(placement_group_bundles=[{"CPU": num_cpus, "GPU": num_gpus} if num_gpus else
                                                     {"CPU": num_cpus}] * tp,
                            placement_group_strategy="STRICT_PACK")
    engine = serve.deployment(
        EngineReplica, name="Engine", ray_actor_options=placement,
        request_router_config=routing.request_router_config(),
        max_ongoing_requests=max_ongoing_requests or options.max_num_seqs,
        **engine_extra,
        **({"autoscaling_config": autoscaling} if autoscaling else {"num_replicas": replicas}),
    ).bind(str(source), options, routing.model_dump(), spec)
    ingress_extra = dict(extra)
    if ingress_max_replicas_per_node is not None:
        ingress_extra["max_replicas_per_node"] = ingress_max_replicas_per_node
    ingress = serve.deployment(serve.ingress()(Ingress), name="Ingress", num_replicas=ingress_replicas,
                               max_ongoing_requests=ingress_max_ongoing_requests,
                               ray_actor_options=dict(num_cpus=min(num_cpus, 0.25)), **ingress_extra)
    return ingress.bind(engine, str(source), spec, api.model_dump(mode="json", exclude_defaults=True),
                        api_key_digests=digests or None, api_keys_file=api_keys_file,
                        metrics_key_digest=metrics_key_digest)


def check_ingress_limits(http_limits: HTTPLimits) -> None:
    """Refuses, at deploy rather than in every replica, limits set that the ingress cannot
    enforce: behind Serve's proxy the connection is the proxy's (`cairn.cluster.api.http_limits`)."""
    given = http_limits.model_fields_set
    if "keep_alive_timeout_s" in given:
        raise ValueError("http_limits.keep_alive_timeout_s: behind Serve's proxy, set http_options.keep_alive_timeout_s")
    if "header_timeout_s" in given:
        raise ValueError("http_limits.header_timeout_s: Serve's proxy has no header timeout to set (its "
                         "http_options.request_timeout_s bounds a whole request)")
    if "stream_stall_timeout_s" in given:
        raise ValueError("http_limits.stream_stall_timeout_s: behind Serve's proxy the ingress cannot see a client "
                         "that stops reading (the proxy buffers its stream); http_options.request_timeout_s bounds it")


API_KEYS = tuple(APIOptions.model_fields)  # a config's keys that are the API's options


def app_builder(args: dict[str, Any]):
    """`import_path: cairn.cluster.app:app_builder` for `serve run` / `serve deploy`. Keys: model_dir
    (a directory or a Hugging Face id; null: the demo model), replicas, engine_options (a mapping
    of `EngineOptions` fields, made into one here, over `SERVED`), routing
    (a dict, or a path to a routing YAML: absolute, relative to the working directory, or to this
    repository), num_cpus, num_gpus, ingress_replicas, the API's options
    (`cairn.cluster.api.api_options.APIOptions`: served_model_name, max_body_bytes, api_limits,
    http_limits, tenant_limits, shared_cache_tenants, public_system_prompts,
    special_tokens_in_content, tool_call_parser, ...; gathered into one `api`), api_key, api_keys,
    api_keys_file, metrics_key, api_key_digests, metrics_key_digest, autoscaling,
    max_ongoing_requests, ingress_max_ongoing_requests, ingress_max_replicas_per_node,
    health_check_period_s, graceful_shutdown_timeout_s, graceful_shutdown_wait_loop_s. Unknown
    keys are an error. Serve logs these arguments: give keys in a config as `api_key_digests` /
    `metrics_key_digest` or in an `api_keys_file`, never as `api_keys` (`cairn serve --api-key`
    sends digests)."""
    args = dict(args or {})
    engine_options = EngineOptions.from_config(args.pop("engine_options", None) or {}, SERVED)  # the one place
    routing = args.pop("routing", None)
    if isinstance(routing, str):
        path = Path(routing)
        if not path.is_absolute() and not path.exists():  # cairn's own configs, from any folder:
            package = Path(__file__).resolve().parents[1]   # cairn/configs/x.yaml or configs/x.yaml
            path = next((p for p in (package.parent / routing, package / routing) if p.exists()), path)
        routing = RoutingConfig.from_yaml(path)
    elif isinstance(routing, dict):
        routing = RoutingConfig.model_validate(routing)
    api = {key: args.pop(key) for key in API_KEYS if key in args}
    return build_application(args.pop("model_dir", None), args.pop("replicas", 2), routing=routing,
                             engine_options=engine_options, api=APIOptions.model_validate(api), **args)
