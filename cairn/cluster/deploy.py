"""`cairn serve` on Ray: start or join a cluster, deploy, print the endpoint, wait for Ctrl-C.

What is deployed is always a Serve config (Ray's `ServeDeploySchema`, the format of
`serve deploy`): the file given with `--config` (cairn/configs/serve.yaml), else the default
cairn/configs/local.yaml (2 CPU replicas of the demo model, in-memory cache index, 127.0.0.1:8000),
read as package data of the `configs` package (importlib.resources), so an installed cairn
deploys the same file a checkout does; it is written nowhere else.
Flags given on the command line override it (`apply_overrides`): `--model` (a directory, made
absolute, or a Hugging Face id, which every node resolves for itself), `--replicas` (which
replaces an `autoscaling` config), `--routing` (loaded here and sent inline), `--num-cpus`,
`--num-gpus`, engine options (`engine_option_flags`, written over the config's `engine_options`
as plain values: the app makes them into one `EngineOptions`, `cairn.cluster.app.app_builder`),
API keys (`--api-key` values and `--metrics-key` as digests,
`api_key_digests` and `metrics_key_digest`, since Serve logs application arguments;
`--api-keys-file` as an absolute path; `--shared-cache-tenants`), every tenant's quotas
(`--tenant-limit`), model name, `--max-body-bytes` and the ingress's `http_limits`
(`--max-header-bytes`, `--body-timeout`) go into every application's `args`;
`--host`, `--port`, `--keep-alive-timeout` and `--request-timeout` into `http_options`, the
proxy's (`--header-timeout` is refused: Serve's proxy has none). The config's models are then
resolved here (`resolve_models`: an id that resolves to nothing fails before Ray starts), and it
is deployed the way `serve deploy` does (the controller imports each application's
`import_path` with its `args`; `deployments:` overrides and `runtime_env` apply), and this
process waits until every application is RUNNING.

Without `--address` (or RAY_ADDRESS) a new local Ray is started and stopped on exit; with it the
cluster is joined and, on exit, only the applications deployed here are deleted. SIGINT and
SIGTERM both stop it cleanly (exit status 0); a failed deployment exits 1.
"""

from __future__ import annotations

import argparse
import copy
import os
import signal
import sys
import threading
import time
from importlib import resources
from pathlib import Path
from typing import Any

LOCAL_CONFIG = resources.files("cairn.configs") / "local.yaml"  # the default Serve config


def load_config(path: str | Path | None = None) -> dict[str, Any]:
    """The Serve config at `path` (default: cairn/configs/local.yaml, `LOCAL_CONFIG`) as a plain dict,
    validated by Ray's ServeDeploySchema; errors name the file (OSError if it cannot be read)."""
    import yaml
    from pydantic import ValidationError
    from ray.serve.schema import ServeDeploySchema

    source = Path(path) if path is not None else LOCAL_CONFIG
    data = yaml.safe_load(source.read_text())
    try:
        ServeDeploySchema.model_validate(data)
    except ValidationError as e:
        raise ValueError(f"{source}: not a Serve config: {e}") from None
    return data


def apply_overrides(config: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """A copy of `config` with the flags that were given (not None) written over it."""
    from cairn.cluster.api.tenants import Tenants, key_digest
    from cairn.cluster.routing.routing_config import RoutingConfig
    from cairn.workers import ModelSource

    config = copy.deepcopy(config)
    http = config.setdefault("http_options", {})
    for flag, key in (("host", "host"), ("port", "port"), ("request_timeout", "request_timeout_s")):
        if getattr(args, flag, None) is not None:
            http[key] = getattr(args, flag)
    if getattr(args, "keep_alive_timeout", None) is not None:
        if args.keep_alive_timeout != int(args.keep_alive_timeout):
            raise ValueError("--keep-alive-timeout: Serve's proxy takes whole seconds")
        http["keep_alive_timeout_s"] = int(args.keep_alive_timeout)
    if getattr(args, "header_timeout", None) is not None:
        raise ValueError("--header-timeout: Serve's proxy has no header timeout (in-process only: --replicas 1)")
    app_args: dict[str, Any] = {}
    if getattr(args, "model", None):  # an absolute directory, or the Hugging Face id as given
        app_args["model_dir"] = str(ModelSource.parse(args.model))
    if getattr(args, "routing", None):
        app_args["routing"] = RoutingConfig.from_yaml(args.routing).model_dump(mode="json")
    if getattr(args, "api_keys_file", None):
        app_args["api_keys_file"] = str(Path(args.api_keys_file).expanduser().resolve())
    if getattr(args, "api_key", None):  # Serve logs application arguments: keys travel as digests
        app_args["api_key_digests"] = Tenants.load(args.api_key, environ={}).digests()
    if getattr(args, "metrics_key", None):
        app_args["metrics_key_digest"] = key_digest(args.metrics_key)
    for flag, key in (("replicas", "replicas"), ("num_cpus", "num_cpus"), ("num_gpus", "num_gpus"),
                      ("served_model_name", "served_model_name"), ("shared_cache_tenants", "shared_cache_tenants"),
                      ("max_body_bytes", "max_body_bytes"), ("special_tokens_in_content", "special_tokens_in_content"),
                      ("tool_call_parser", "tool_call_parser")):
        if getattr(args, flag, None) is not None:
            app_args[key] = getattr(args, flag)
    engine_options = engine_option_flags(args)
    limits = http_limit_flags(args, in_process=False)
    api_limits = api_limit_flags(args)
    tenant_limits = tenant_limit_flags(args)
    if getattr(args, "public_system_prompt", None):
        app_args["public_system_prompts"] = public_prompt_flags(args)
    if getattr(args, "image_url_allow", None):
        app_args["image_url_allow"] = list(args.image_url_allow)
    for app in config.get("applications", []):
        merged = dict(app.get("args") or {})
        merged.update(app_args)
        if "replicas" in app_args:
            merged.pop("autoscaling", None)  # a count given on the command line replaces autoscaling
        if engine_options:
            merged["engine_options"] = {**(merged.get("engine_options") or {}), **engine_options}
        if limits:
            merged["http_limits"] = {**(merged.get("http_limits") or {}), **limits}
        if api_limits:
            merged["api_limits"] = {**(merged.get("api_limits") or {}), **api_limits}
        if tenant_limits:
            merged["tenant_limits"] = {**(merged.get("tenant_limits") or {}), **tenant_limits}
        app["args"] = merged
    return config


def resolve_models(config: dict[str, Any]) -> None:
    """Resolves every application's `model_dir` here, before Ray starts, with the environment its
    `runtime_env` gives (`HF_HOME`, `HF_HUB_OFFLINE`, `HF_TOKEN`...): a Hugging Face id that
    resolves to nothing raises `workers.ModelNotFound` now, naming where it looked, rather than
    failing every replica. With a local Ray (and on a cluster's head node) this is also where the
    controller builds the application, which then finds the snapshot fetched now in the cache."""
    from cairn.workers import ModelSource

    for app in config.get("applications", []):
        model = (app.get("args") or {}).get("model_dir")
        if model:
            env_vars = (app.get("runtime_env") or {}).get("env_vars") or {}
            ModelSource.parse(model).local_dir({**os.environ, **env_vars})


ENGINE_FLAGS = ("max_num_seqs", "cache_policy", "cache_memory_bytes", "memory_utilization", "host_cache_bytes",
                "tensor_parallel_size", "dtype", "enforce_eager", "async_scheduling",
                "num_speculative_tokens", "speculative_max_num_seqs")  # `cairn serve`'s flags named as EngineOptions fields


def engine_option_flags(args: argparse.Namespace) -> dict[str, Any]:
    """The `cairn.workers.engine_options.EngineOptions` fields the flags give, as given (checked where the
    options are made)."""
    return {name: getattr(args, name) for name in ENGINE_FLAGS if getattr(args, name, None) is not None}


def public_prompt_flags(args: argparse.Namespace) -> list[str]:
    """The system prompts the `--public-system-prompt FILE` flags name (each file's text, whole)."""
    return [Path(f).expanduser().read_text(encoding="utf-8") for f in getattr(args, "public_system_prompt", None) or ()]


def _limit_flags(flag: str, items: Any, model: Any) -> dict[str, float]:
    """The fields of `model` that `--FLAG NAME=VALUE` flags give (checked by the model)."""
    out: dict[str, float] = {}
    for item in items or ():
        name, sep, value = item.partition("=")
        if not sep or name not in model.model_fields:
            raise ValueError(f"--{flag} {item!r}: expected NAME=VALUE with NAME one of {sorted(model.model_fields)}")
        try:
            out[name] = float(value) if "." in value else int(value)
        except ValueError:
            raise ValueError(f"--{flag} {item!r}: {value!r} is not a number") from None
    model(**out)
    return out


def api_limit_flags(args: argparse.Namespace) -> dict[str, float]:
    """The `cairn.cluster.api.limits.APILimits` fields `--api-limit NAME=VALUE` flags give (checked)."""
    from cairn.cluster.api.limits import APILimits

    return _limit_flags("api-limit", getattr(args, "api_limit", None), APILimits)


def tenant_limit_flags(args: argparse.Namespace) -> dict[str, float]:
    """The `cairn.cluster.api.quotas.TenantLimits` fields `--tenant-limit NAME=VALUE` flags give: every
    tenant's quotas (a keys file may give a tenant its own)."""
    from cairn.cluster.api.quotas import TenantLimits

    return _limit_flags("tenant-limit", getattr(args, "tenant_limit", None), TenantLimits)


def http_limit_flags(args: argparse.Namespace, in_process: bool) -> dict[str, float]:
    """The `HTTPLimits` fields the flags give: the app's (header size, body time) and, for the
    in-process server, the connection's (header time, keep-alive)."""
    flags = {"max_header_bytes": getattr(args, "max_header_bytes", None),
             "body_timeout_s": getattr(args, "body_timeout", None)}
    if in_process:
        flags.update(header_timeout_s=args.header_timeout, keep_alive_timeout_s=args.keep_alive_timeout,
                     stream_stall_timeout_s=getattr(args, "stream_stall_timeout", None))
    elif getattr(args, "stream_stall_timeout", None) is not None:
        raise ValueError("--stream-stall-timeout: behind Serve's proxy a client that stops reading is not seen "
                         "(in-process only: --replicas 1); --request-timeout bounds its stream")
    return {k: v for k, v in flags.items() if v is not None}


def _wait_running(names: list[str], stop: threading.Event, report_every_s: float = 30.0) -> str | None:
    """Waits until every application is RUNNING; an error message if one failed (None: running,
    or stopped meanwhile). Says what Serve reports while it takes long (e.g. no GPU to place on)."""
    from ray import serve

    next_report = time.monotonic() + report_every_s
    while not stop.is_set():
        apps = serve.status().applications
        states = {n: apps.get(n) for n in names}
        failed = [f"{n}: {a.status}: {a.message}" for n, a in states.items()
                  if a is not None and a.status in ("DEPLOY_FAILED", "UNHEALTHY")]
        if failed:
            return "; ".join(failed)
        if all(a is not None and a.status == "RUNNING" for a in states.values()):
            return None
        if time.monotonic() > next_report:
            next_report += report_every_s
            for n, a in states.items():
                print(f"cairn serve: still deploying {n}: {a.status if a else 'not started'}"
                      f"{': ' + a.message if a and a.message else ''}", file=sys.stderr, flush=True)
        stop.wait(0.5)
    return None


def serve_forever(args: argparse.Namespace) -> int:
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    import ray
    from ray import serve
    from ray.serve._private import api as serve_api
    from ray.serve.config import gRPCOptions
    from ray.serve.schema import ServeDeploySchema

    try:
        data = apply_overrides(load_config(args.config), args)
        config = ServeDeploySchema.model_validate(data)
        resolve_models(data)
    except (OSError, ValueError) as e:
        print(f"cairn serve: {e}", file=sys.stderr)
        return 2
    address = args.address or os.environ.get("RAY_ADDRESS") or None
    stop = threading.Event()
    names = [app.name for app in config.applications]
    if address:
        ray.init(address=address, namespace="serve")
    else:
        ray.init(address="local", include_dashboard=False, namespace="serve")
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    status = 0
    try:
        client = serve_api.serve_start(http_options=config.http_options.model_dump(),
                                       proxy_location=config.proxy_location,
                                       grpc_options=gRPCOptions(**config.grpc_options.model_dump()),
                                       controller_options=config.controller_options)
        client.deploy_apps(config, _blocking=False)
        failure = _wait_running(names, stop)
        if failure:
            print(f"cairn serve: deployment failed: {failure}", file=sys.stderr, flush=True)
            status = 1
        elif not stop.is_set():
            http = client.http_config  # a joined cluster's Serve may already listen elsewhere
            where = "a joined Ray cluster" if address else "a local Ray"
            for app in config.applications:
                url = f"http://{http.host}:{http.port}{(app.route_prefix or '/').rstrip('/')}/v1"
                print(f"cairn: serving on {url} (application {app.name}; {where}; Ctrl-C to stop)", flush=True)
            while not stop.wait(0.5):  # a timed wait: signal handlers run between the waits
                pass
    finally:
        try:
            if address:  # someone else's cluster: take down only what we deployed
                for name in names:
                    serve.delete(name, _blocking=True)
            else:
                serve.shutdown()
        except Exception as e:  # stopping anyway
            print(f"cairn serve: while stopping: {e}", file=sys.stderr)
        ray.shutdown()
        print("cairn: stopped", flush=True)
    return status
