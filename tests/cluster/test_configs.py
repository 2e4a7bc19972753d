"""configs/: each file is valid by the schema of the tool that reads it (Ray Serve's
ServeDeploySchema, Ray's autoscaler schema, RoutingConfig), and builds what it says it builds.
`cairn serve` really reads cairn/configs/local.yaml, and flags given on the command line override it.
No Ray cluster is started here: building a Serve application only binds deployments."""

import argparse
import json
import os
import re
from pathlib import Path

import pytest
import yaml

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
pytest.importorskip("ray")

from ray.serve.schema import ServeDeploySchema  # noqa: E402

from cairn.cluster import deploy  # noqa: E402
from cairn.cluster.api.http_limits import HTTPLimits  # noqa: E402
from cairn.cluster.api.limits import APILimits  # noqa: E402
from cairn.cluster.api.api_options import APIOptions  # noqa: E402
from cairn.cluster.api.tenants import Tenants, key_digest  # noqa: E402
from cairn.cluster.app import app_builder  # noqa: E402
from cairn.cluster.cli import build_parser  # noqa: E402
from cairn.cluster.routing.routing_config import RoutingConfig  # noqa: E402
from tests.support.paths import REPO

CONFIGS = REPO / "cairn" / "configs"


def load(name: str) -> dict:
    return yaml.safe_load((CONFIGS / name).read_text())


def engine_of(app):
    """The Engine deployment and its bound (model_dir, engine_options, routing, spec) of a built app."""
    ingress = app._bound_deployment
    assert ingress.name == "Ingress"
    engine = ingress.init_args[0]._bound_deployment
    assert engine.name == "Engine"
    return engine, engine.init_args


def serve_args(argv: list[str]) -> argparse.Namespace:
    return build_parser().parse_args(["serve", *argv])


# ---- serve.yaml ------------------------------------------------------------------------------

def test_serve_yaml_is_a_serve_deploy_config_whose_app_builds_gpu_engine_replicas():
    config = ServeDeploySchema.model_validate(load("serve.yaml"))
    (app,) = config.applications
    assert app.import_path == "cairn.cluster.app:app_builder" and app.route_prefix == "/"
    args = app.args
    assert {"model_dir", "autoscaling", "engine_options", "routing", "num_cpus", "num_gpus"} <= args.keys()
    built = app_builder(args)
    engine, (model_dir, engine_options, routing, spec) = engine_of(built)
    assert engine.ray_actor_options["num_gpus"] == args["num_gpus"] == 1
    assert engine.ray_actor_options["num_cpus"] == args["num_cpus"]
    assert engine.max_ongoing_requests == engine_options.max_num_seqs, "a replica admits what its engine runs"
    assert engine._deployment_config.health_check_period_s == args["health_check_period_s"]
    assert RoutingConfig.model_validate(routing) == RoutingConfig.model_validate(args["routing"]).for_engines(spec)
    assert engine_options.page_size == routing["page_size"]
    assert Path(model_dir).is_dir(), "model_dir null serves the demo model"
    ingress = built._bound_deployment
    for deployment in (engine, ingress):  # a replica scaled down or replaced finishes its streams
        assert deployment._deployment_config.graceful_shutdown_timeout_s == args["graceful_shutdown_timeout_s"] \
            >= config.http_options.request_timeout_s
    assert APIOptions.model_validate(ingress.init_args[3]).http_limits == HTTPLimits(**args["http_limits"])
    assert config.http_options.keep_alive_timeout_s == 90


def serve_yaml_with_its_hub_example() -> dict:
    """serve.yaml with its commented Hugging Face example (runtime_env, model_dir) in place of the
    live lines it stands for."""
    example = re.compile(r"^( {4,})# ((?:runtime_env|model_dir):.*| {2,}[A-Za-z_]+:.*)$")
    out: list[str] = []
    for line in (CONFIGS / "serve.yaml").read_text().splitlines():
        match = example.match(line)
        if match:
            indent, text = match.groups()
            key = indent + text.split(":")[0] + ":"
            live = [i for i, kept in enumerate(out) if kept.startswith(key)]
            if live:
                del out[live[-1]]
            line = indent + text
        out.append(line)
    return yaml.safe_load("\n".join(out))


def test_serve_yamls_hugging_face_example_is_valid_and_each_node_resolves_in_the_cache_it_names(monkeypatch):
    from ray.runtime_env import RuntimeEnv

    from cairn.workers import ModelNotFound, ModelSource

    config = ServeDeploySchema.model_validate(serve_yaml_with_its_hub_example())
    (app,) = config.applications
    env_vars = RuntimeEnv(**app.runtime_env)["env_vars"]  # Ray's own check of a runtime_env
    assert {"HF_HOME", "HF_TOKEN", "HF_HUB_OFFLINE"} <= env_vars.keys()
    assert all(isinstance(v, str) for v in env_vars.values()), "env_vars values are strings"
    source = ModelSource.parse(app.args["model_dir"])
    assert source.repo_id and source.repo_id.count("/") == 1 and source.directory is None
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    with pytest.raises(ModelNotFound, match=re.escape(str(Path(env_vars["HF_HOME"]) / "hub"))):
        deploy.resolve_models(serve_yaml_with_its_hub_example())  # the cache its runtime_env names, offline


def test_serve_yaml_autoscales_engine_replicas_by_their_queue_within_rays_schema():
    from ray.serve.config import AutoscalingConfig

    args = load("serve.yaml")["applications"][0]["args"]
    wanted = AutoscalingConfig.model_validate(args["autoscaling"])  # Ray's own schema
    engine, (_, engine_options, _, _) = engine_of(app_builder(args))
    built = engine._deployment_config.autoscaling_config
    assert built == wanted and (built.min_replicas, built.max_replicas) == (1, 4)
    assert 0 < built.target_ongoing_requests <= engine_options.max_num_seqs, \
        "the queue a replica aims at fits what it admits"
    cluster = load("cluster.yaml")
    assert built.max_replicas <= sum(t.get("max_workers", 0) for t in cluster["available_node_types"].values()
                                     if t["resources"].get("GPU")), "one GPU per replica"
    fixed = deploy.apply_overrides(load("serve.yaml"), serve_args(["--replicas", "3"]))["applications"][0]["args"]
    assert "autoscaling" not in fixed and engine_of(app_builder(fixed))[0].num_replicas == 3, \
        "--replicas replaces autoscaling"


def test_the_ingress_refuses_limits_that_belong_to_servess_proxy():
    with pytest.raises(ValueError, match="http_options.keep_alive_timeout_s"):
        app_builder({"http_limits": {"keep_alive_timeout_s": 5}})
    with pytest.raises(ValueError, match="no header timeout"):
        app_builder({"http_limits": {"header_timeout_s": 5}})
    with pytest.raises(ValueError, match="max_header_bytes"):
        app_builder({"http_limits": {"max_header_bytes": -1}})
    with pytest.raises(ValueError, match="http_options.request_timeout_s"):
        app_builder({"request_timeout_s": 5})
    ingress = app_builder({"http_limits": {"body_timeout_s": 5}, "api_keys": ["a:k"], "metrics_key": "m",
                           "shared_cache_tenants": True, "max_body_bytes": 1024})._bound_deployment
    assert ingress.init_kwargs == dict(api_key_digests=[f"a:{key_digest('k')}"], api_keys_file=None,
                                       metrics_key_digest=key_digest("m"))
    api = ingress.init_args[3]
    assert APIOptions.model_validate(api) == APIOptions(shared_cache_tenants=True, max_body_bytes=1024,
                                                        http_limits=HTTPLimits(body_timeout_s=5)), \
        "the API's options reach the ingress whole, as one APIOptions"
    assert not {"k", "m"} & {v for v in (*ingress.init_args[1:], *api.values()) if isinstance(v, str)}, \
        "keys reach the ingress as digests"


def test_app_builder_takes_routing_as_a_path_and_refuses_unknown_keys():
    engine, (_, _, routing, spec) = engine_of(app_builder({"routing": "cairn/configs/routing.yaml", "replicas": 3}))
    assert RoutingConfig.model_validate(routing) == RoutingConfig.from_yaml(CONFIGS / "routing.yaml").for_engines(spec)
    assert engine.num_replicas == 3
    with pytest.raises(TypeError, match="replica"):
        app_builder({"replica": 3})


# ---- cluster.yaml ----------------------------------------------------------------------------

def test_app_builder_spreads_ingress_replicas_over_nodes_only_when_asked():
    """Each node's proxy prefers an ingress replica on its own node (proxy_location: EveryNode)."""
    spread = app_builder({"ingress_replicas": 3, "ingress_max_replicas_per_node": 1})._bound_deployment
    assert spread._replica_config.max_replicas_per_node == 1 and spread._deployment_config.num_replicas == 3
    assert app_builder({})._bound_deployment._replica_config.max_replicas_per_node is None


def test_cluster_yaml_passes_rays_autoscaler_schema_and_sets_up_gpu_workers():
    import jsonschema
    import ray
    from ray.autoscaler._private.util import prepare_config, validate_config

    config = load("cluster.yaml")
    schema = json.loads((Path(ray.__file__).parent / "autoscaler" / "ray-schema.json").read_text())
    jsonschema.validate(config, schema)
    validate_config(prepare_config(config))  # Ray's own check, defaults filled in as `ray up` does

    types = config["available_node_types"]
    head = types[config["head_node_type"]]
    gpu = [t for name, t in types.items() if name != config["head_node_type"]]
    assert gpu and all(t["resources"].get("GPU", 0) >= 1 and t["max_workers"] >= 1 for t in gpu)
    assert head["resources"].get("GPU", 0) == 0

    setup = config["setup_commands"]
    torch_at = next(i for i, c in enumerate(setup) if "torch==2.13.0" in c)
    cairn_at = next(i for i, c in enumerate(setup) if "pip install" in c and "cairn" in c)
    assert torch_at < cairn_at, "torch is installed first (pinned), then the repository"
    assert any("ray start --head" in c for c in config["head_start_ray_commands"])
    assert any("ray start --address" in c for c in config["worker_start_ray_commands"])


def test_the_8gpu_cluster_and_its_serve_config_pass_rays_schemas_and_build_tensor_parallel_replicas(tiny_model_dir):
    """cairn/configs/cluster-8gpu.yaml (Ray's autoscaler schema) and cairn/configs/serve-8gpu.yaml
    (ServeDeploySchema): Qwen3-Next-80B at TP 4 and Qwen3.5-397B at TP 8, each replica a
    STRICT_PACK placement group of one GPU bundle per rank that fits one 8-GPU node. Built here
    with the demo model in place of the hub ids (no hub)."""
    import jsonschema
    import ray
    from ray.autoscaler._private.util import prepare_config, validate_config

    cluster = load("cluster-8gpu.yaml")
    jsonschema.validate(cluster, json.loads((Path(ray.__file__).parent / "autoscaler" / "ray-schema.json").read_text()))
    validate_config(prepare_config(cluster))
    node = cluster["available_node_types"]["gpu8_worker"]["resources"]
    config = ServeDeploySchema.model_validate(load("serve-8gpu.yaml"))
    sizes = {}
    for app in config.applications:
        args = dict(app.args, model_dir=str(tiny_model_dir))
        tp = args["engine_options"]["tensor_parallel_size"]
        engine, (_, engine_options, routing, _) = engine_of(app_builder(args))
        bundles = engine._replica_config.placement_group_bundles
        assert bundles == [{"CPU": args["num_cpus"], "GPU": 1}] * tp
        assert engine._replica_config.placement_group_strategy == "STRICT_PACK"
        assert engine.ray_actor_options["num_gpus"] == 1, "the replica itself is rank 0, in the first bundle"
        assert args["replicas"] * tp <= node["GPU"] and args["replicas"] * tp * args["num_cpus"] <= node["CPU"]
        assert engine_options.cache_memory_bytes <= 80 * 2**30, "per GPU, beside its share of the weights"
        sizes[app.args["model_dir"]] = tp
    assert sizes == {"Qwen/Qwen3-Next-80B-A3B-Instruct": 4, "Qwen/Qwen3.5-397B-A17B": 8}
    assert len({app.args["routing"]["index_actor_name"] for app in config.applications}) == 2, "an index per model"


def test_serve_yamls_tensor_parallel_example_builds_a_placement_group_per_replica():
    text = (CONFIGS / "serve.yaml").read_text().replace("        tensor_parallel_size: 1  #", "        # was:")
    text = text.replace("        # tensor_parallel_size: 4", "        tensor_parallel_size: 4")
    (app,) = ServeDeploySchema.model_validate(yaml.safe_load(text)).applications
    engine, (_, engine_options, _, _) = engine_of(app_builder(app.args))
    assert engine_options.tensor_parallel_size == 4
    assert engine._replica_config.placement_group_bundles == [{"CPU": app.args["num_cpus"], "GPU": 1}] * 4
    plain, _ = engine_of(app_builder(load("serve.yaml")["applications"][0]["args"]))
    assert plain._replica_config.placement_group_bundles is None, "TP 1: an ordinary replica"


# ---- routing.yaml ----------------------------------------------------------------------------

def test_routing_yaml_loads_into_the_routing_config():
    config = RoutingConfig.from_yaml(CONFIGS / "routing.yaml")
    assert config.policy == "cache_affinity" and config.redis_url is None
    assert config.request_router_config().request_router_class == "cairn.cluster.routing.router:CacheAffinityRouter"


# ---- local.yaml: the default of `cairn serve` ------------------------------------------------

def test_local_yaml_builds_two_cpu_replicas_of_the_demo_model_with_the_in_memory_index():
    config = ServeDeploySchema.model_validate(load("local.yaml"))
    assert (config.http_options.host, config.http_options.port) == ("127.0.0.1", 8000)
    (app,) = config.applications
    engine, (model_dir, _, routing, spec) = engine_of(app_builder(app.args))
    assert engine.num_replicas == 2
    assert engine.ray_actor_options.get("num_gpus", 0) == 0 and 0 < engine.ray_actor_options["num_cpus"] <= 1
    assert routing["redis_url"] is None, "in-memory index"
    assert Path(model_dir).is_dir() and json.loads((Path(model_dir) / "config.json").read_text())["model_type"] \
        == "qwen3_next"


def test_replicas_fetch_from_their_peers_by_default_unless_told_not_to_and_never_under_tensor_parallelism():
    assert engine_of(app_builder({}))[1][2]["fetch"] is True
    assert engine_of(app_builder({"routing": {"fetch": False}}))[1][2]["fetch"] is False
    tp = {"engine_options": {"tensor_parallel_size": 2}, "routing": {"fetch": True}}
    assert engine_of(app_builder(tp))[1][2]["fetch"] is False, "a rank cannot fetch its slice: nothing to price"


def test_routing_takes_page_size_recurrent_and_sizes_from_the_engines_and_refuses_others():
    from cairn.workers import EngineSpec

    _, (model_dir, _, routing, spec) = engine_of(app_builder({"engine_options": {"page_size": 8}}))
    assert spec == EngineSpec.from_model_dir(model_dir, __import__("cairn.workers").workers.EngineOptions(page_size=8))
    assert (routing["page_size"], routing["recurrent"]) == (8, True) == (spec.page_size, spec.recurrent)
    assert (routing["page_bytes"], routing["state_bytes"]) == (spec.page_bytes, spec.state_bytes)
    assert spec.page_bytes > 0 and spec.state_bytes > 0
    ingress_spec = app_builder({"engine_options": {"page_size": 8}})._bound_deployment.init_args[2]
    assert ingress_spec == spec, "the ingress hashes with the engines' spec"
    with pytest.raises(ValueError, match="routing page_size is 16 but the engines' is 8"):
        app_builder({"engine_options": {"page_size": 8}, "routing": {"page_size": 16}})
    with pytest.raises(ValueError, match="routing recurrent is False but the engines' is True"):
        app_builder({"routing": {"recurrent": False}})
    with pytest.raises(ValueError, match=f"routing page_bytes is 1 but the engines' is {spec.page_bytes}"):
        app_builder({"engine_options": {"page_size": 8}, "routing": {"page_bytes": 1}})
    with pytest.raises(ValueError, match="routing state_bytes is 0 but the engines' is"):
        app_builder({"routing": {"state_bytes": 0}})
    same = dict(page_size=8, page_bytes=spec.page_bytes, state_bytes=spec.state_bytes)
    assert engine_of(app_builder({"engine_options": {"page_size": 8}, "routing": same}))[1][2] == routing


def test_the_spec_sizes_a_page_and_a_state_as_one_device_of_the_engine_holds_them(tiny_model_dir):
    """What the router prices a copy from host memory with: the arena's page and state sizes, on
    one rank under tensor parallelism, in the engine's dtype."""
    from cairn.workers import EngineOptions, EngineSpec
    from cairn.workers.cache.arena import ArenaLayout
    from cairn.workers.model.model_types import read_model_config
    from cairn.workers.model.sharding import shard_config

    cfg = read_model_config(tiny_model_dir / "config.json")
    for options, dtype_bytes in ((EngineOptions(), 4), (EngineOptions(dtype="bfloat16"), 2),
                                 (EngineOptions(tensor_parallel_size=2), 4)):
        spec = EngineSpec.from_model_dir(tiny_model_dir, options)
        layout = ArenaLayout.plan(shard_config(cfg, options.tensor_parallel_size), options, dtype_bytes)
        assert spec.page_bytes == layout.block_bytes
        assert layout.slot_bytes - 16 < spec.state_bytes <= layout.slot_bytes, "a slot only pads a state"
    whole, half = (EngineSpec.from_model_dir(tiny_model_dir, EngineOptions(tensor_parallel_size=n)) for n in (1, 2))
    assert (half.page_bytes, half.state_bytes) == (whole.page_bytes // 2, whole.state_bytes // 2)


def test_cairn_serve_deploys_local_yaml_when_no_config_is_given(tmp_path, monkeypatch):
    assert deploy.load_config() == load("local.yaml")
    edited = load("local.yaml")
    edited["applications"][0]["args"]["replicas"] = 5
    (tmp_path / "local.yaml").write_text(yaml.safe_dump(edited))
    monkeypatch.setattr(deploy, "LOCAL_CONFIG", tmp_path / "local.yaml")
    assert deploy.load_config()["applications"][0]["args"]["replicas"] == 5, "the file is what is read"
    monkeypatch.setattr(deploy, "LOCAL_CONFIG", tmp_path / "absent.yaml")
    with pytest.raises(OSError):  # no second copy of the default to fall back to
        deploy.load_config()


def test_the_default_config_is_configs_local_yaml_shipped_as_package_data():
    import tomllib
    from importlib import resources

    from cairn import configs
    assert Path(configs.__file__).parent == CONFIGS
    assert Path(str(deploy.LOCAL_CONFIG)) == Path(str(resources.files("cairn.configs") / "local.yaml")) == \
        CONFIGS / "local.yaml"
    setuptools = tomllib.loads((CONFIGS.parents[1] / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert "cairn.*" in setuptools["packages"]["find"]["include"], "a wheel holds the configs package"
    assert "*.yaml" in setuptools["package-data"]["*"], "and its YAML files"
    assert not hasattr(deploy, "FALLBACK_CONFIG"), "the default is written once, in cairn/configs/local.yaml"


def test_flags_override_the_config_and_absent_flags_leave_it_alone(tmp_path):
    local = load("local.yaml")
    assert deploy.apply_overrides(local, serve_args([])) == local
    model = tmp_path / "model"
    model.mkdir()
    out = deploy.apply_overrides(local, serve_args(
        ["--replicas", "3", "--port", "9001", "--model", str(model), "--num-cpus", "0.25",
         "--routing", str(CONFIGS / "routing.yaml"), "--max-num-seqs", "8"]))
    args = out["applications"][0]["args"]
    assert out["http_options"] == {"host": "127.0.0.1", "port": 9001, "keep_alive_timeout_s": 5}
    assert args["replicas"] == 3 and args["num_cpus"] == 0.25 and args["model_dir"] == str(model)
    assert args["engine_options"] == {"max_num_seqs": 8}
    assert RoutingConfig.model_validate(args["routing"]) == RoutingConfig.from_yaml(CONFIGS / "routing.yaml")
    assert args["num_gpus"] == 0, "not given: the config's value"
    assert local["applications"][0]["args"]["replicas"] == 2, "the config itself is not modified"
    ServeDeploySchema.model_validate(out)
    serve_yaml = deploy.apply_overrides(load("serve.yaml"), serve_args(["--replicas", "8", "--max-num-seqs", "32"]))
    engine_options = serve_yaml["applications"][0]["args"]["engine_options"]
    assert engine_options["max_num_seqs"] == 32 and engine_options["page_size"] == 16, "merged, not replaced"
    speculating = deploy.apply_overrides(local, serve_args(["--speculative-tokens", "2", "--speculative-max-seqs", "4"]))
    assert speculating["applications"][0]["args"]["engine_options"] == {"num_speculative_tokens": 2,
                                                                        "speculative_max_num_seqs": 4}


@pytest.mark.parametrize("native, gpus, want", [(True, 0, "bfloat16"), (False, 0, "float32"), (False, 1, "float32")])
def test_auto_dtype_is_chosen_once_at_deploy_for_the_engines_devices(monkeypatch, tiny_model_dir, native, gpus, want):
    """Every replica runs (and the spec every router and ingress reads says) one dtype: auto is
    resolved where the app is built, for the device the engines run on (a GPU: the checkpoint's,
    fp32 for the demo model; a CPU: bf16 where it is native); a --dtype given is passed as is."""
    from cairn.workers import precision

    monkeypatch.delenv("CAIRN_DTYPE")
    monkeypatch.setattr(precision, "native_bf16_cpu", lambda: native)
    app = app_builder({"model_dir": str(tiny_model_dir), "replicas": 1, "num_gpus": gpus})
    _, (_, engine_options, _, spec) = engine_of(app)
    assert engine_options.dtype == want
    from cairn.workers import EngineOptions, EngineSpec

    fp32 = EngineSpec.from_model_dir(tiny_model_dir, EngineOptions(dtype="float32"))
    assert spec.page_bytes * (2 if want == "bfloat16" else 1) == fp32.page_bytes
    flagged = deploy.apply_overrides(load("local.yaml"), serve_args(["--dtype", "float32"]))
    assert flagged["applications"][0]["args"]["engine_options"] == {"dtype": "float32"}
    assert build_parser().parse_args(["serve", "--dtype", "bfloat16"]).dtype == "bfloat16"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--dtype", "int8"])


def test_key_tenant_and_limit_flags_go_to_the_app_and_the_proxy(tmp_path):
    keys = tmp_path / "keys"
    keys.write_text("alice:k-a\n")
    out = deploy.apply_overrides(load("local.yaml"), serve_args(
        ["--api-key", "alice:k-a", "--api-key", "bare", "--api-keys-file", str(keys), "--metrics-key", "ops",
         "--shared-cache-tenants", "--max-header-bytes", "8192", "--body-timeout", "15", "--max-body-bytes", "4096",
         "--keep-alive-timeout", "7", "--request-timeout", "120", "--tenant-limit", "requests_per_minute=30"]))
    args = out["applications"][0]["args"]
    assert args["api_key_digests"] == Tenants.load(["alice:k-a", "bare"]).digests(), "keys travel as digests"
    assert args["api_keys_file"] == str(keys.resolve()) and "k-a" not in json.dumps(out)
    assert args["metrics_key_digest"] == key_digest("ops") and '"ops"' not in json.dumps(out)
    assert args["shared_cache_tenants"] is True and args["max_body_bytes"] == 4096
    assert args["tenant_limits"] == {"requests_per_minute": 30}
    assert args["http_limits"] == {"max_header_bytes": 8192, "body_timeout_s": 15}
    assert out["http_options"]["keep_alive_timeout_s"] == 7 and out["http_options"]["request_timeout_s"] == 120
    ServeDeploySchema.model_validate(out)
    ingress = app_builder(args)._bound_deployment
    assert APIOptions.model_validate(ingress.init_args[3]).http_limits == HTTPLimits(**args["http_limits"])
    with pytest.raises(ValueError, match="no header timeout"):
        deploy.apply_overrides(load("local.yaml"), serve_args(["--header-timeout", "5"]))
    with pytest.raises(ValueError, match="whole seconds"):
        deploy.apply_overrides(load("local.yaml"), serve_args(["--keep-alive-timeout", "2.5"]))
    untouched = deploy.apply_overrides(load("local.yaml"), serve_args([]))["applications"][0]["args"]
    assert not {"api_key_digests", "metrics_key_digest", "shared_cache_tenants", "http_limits",
                "tenant_limits"} & untouched.keys()
    with pytest.raises(ValueError, match="tenant-limit"):
        deploy.apply_overrides(load("local.yaml"), serve_args(["--tenant-limit", "rpm=3"]))


# ---- grafana-dashboard.json ------------------------------------------------------------------

def dashboard_metrics() -> dict[str, set[str]]:
    """Each panel's title -> the metric names its expressions read."""
    dashboard = json.loads((CONFIGS / "grafana-dashboard.json").read_text())
    return {panel["title"]: {name for t in panel["targets"] for name in re.findall(r"\bray_cairn_[a-z0-9_]+\b", t["expr"])}
            for panel in dashboard["panels"]}


def test_the_grafana_dashboard_reads_only_metrics_cairn_exports(tiny_model_dir):
    """Ray exports `ray_` + each name /metrics shows (cairn.cluster.metrics_export; tests/ray/test_cluster.py
    checks the dashboard against a real export), so /metrics of a real engine, and the routers'
    counters, are what the panels may name."""
    from fastapi.testclient import TestClient
    from prometheus_client.parser import text_string_to_metric_families

    from cairn.cluster.api import build_app
    from cairn.cluster.api.engine_client import LocalEngineClient
    from cairn.cluster.api.api_options import APIOptions
    from cairn.cluster.routing.ranker import AffinityRanker
    from cairn.workers import EngineFront

    engine = EngineFront.from_pretrained(tiny_model_dir, num_pages=64, max_num_seqs=2)
    with TestClient(build_app(LocalEngineClient(engine), tiny_model_dir, APIOptions(served_model_name="tiny"))) as c:
        assert c.post("/v1/completions", json={"model": "tiny", "prompt": "cairn " * 40, "max_tokens": 2}).status_code == 200
        text = c.get("/metrics").text
    exported = {s.name for f in text_string_to_metric_families(text) for s in f.samples}
    exported |= {f"cairn_router_{name}_total" for name in AffinityRanker(RoutingConfig(page_size=16, recurrent=True, page_bytes=8192,
                                                                                  state_bytes=16896)).counts}
    panels = dashboard_metrics()
    for title, names in panels.items():
        assert names, f"panel {title!r} reads no cairn metric"
        missing = {n for n in names if n.removeprefix("ray_") not in exported}
        assert not missing, f"panel {title!r} reads metrics cairn does not export: {missing}"
    shown = set().union(*panels.values())
    for wanted in ("ray_cairn_cached_tokens_total", "ray_cairn_prompt_tokens_total",
                   "ray_cairn_time_to_first_token_seconds_bucket", "ray_cairn_inter_token_latency_seconds_bucket",
                   "ray_cairn_engine_waiting_requests", "ray_cairn_engine_running_requests",
                   "ray_cairn_engine_state_bytes", "ray_cairn_engine_cache_used_bytes",
                   "ray_cairn_router_index_fallbacks_total"):
        assert wanted in shown, f"the dashboard shows no {wanted}"


def test_cairn_serve_in_process_refuses_bad_limits_and_bad_keys_before_loading_anything(tmp_path, capsys):
    from cairn.cluster.cli import main

    assert main(["serve", "--replicas", "1", "--stream-stall-timeout", "0"]) == 2
    assert "stream_stall_timeout_s" in capsys.readouterr().err
    (tmp_path / "keys").write_text("alice:secret-1\nsecret-2\n")
    assert main(["serve", "--replicas", "1", "--api-keys-file", str(tmp_path / "keys")]) == 2
    err = capsys.readouterr().err
    assert "keys:2: expected TENANT:KEY" in err and "secret" not in err.replace(str(tmp_path), "")
    assert main(["serve", "--replicas", "1", "--body-timeout", "-1"]) == 2


def test_cairn_serve_in_process_hands_its_engine_one_engine_options_and_refuses_a_bad_one(monkeypatch, capsys):
    from cairn.cluster.api import server
    from cairn.cluster.cli import main
    from cairn.workers import EngineOptions

    got = {}
    monkeypatch.setattr(server, "serve_in_process", lambda model, options, **kwargs: got.update(kwargs))
    assert main(["serve", "--replicas", "1", "--max-num-seqs", "8", "--cache-policy", "exact"]) == 0
    assert got["engine_options"] == EngineOptions(max_num_seqs=8, cache_policy="exact", warm_up=True)
    assert main(["serve", "--replicas", "1", "--max-num-seqs", "0"]) == 2
    assert "cairn serve: max_num_seqs must be a positive integer" in capsys.readouterr().err


def test_the_engine_flags_of_cairn_serve_reach_the_arena_sizing_as_one_engine_options(tiny_model_dir, monkeypatch):
    """On Ray, `cairn serve`'s engine flags are written into the Serve config, the app makes them
    one `EngineOptions`, and that value, whole, is what the replica's engine sizes its arena from
    (Serve pickles it to the replica; here the replica is built in this process, up to the sizing)."""
    import asyncio
    import pickle
    from types import SimpleNamespace

    from cairn.cluster import engine_replica
    from cairn.workers import EngineOptions
    from cairn.workers.cache import device_budget

    args = serve_args(["--model", str(tiny_model_dir), "--max-num-seqs", "8", "--cache-memory-bytes", str(8 << 20),
                       "--cache-policy", "all", "--host-cache-bytes", str(1 << 20), "--dtype", "float32",
                       "--enforce-eager"])
    config = deploy.apply_overrides(deploy.load_config(args.config), args)  # what serve_forever deploys
    engine, (model, options, routing, spec) = engine_of(app_builder(config["applications"][0]["args"]))
    parsed = EngineOptions(max_num_seqs=8, cache_memory_bytes=8 << 20, cache_policy="all", host_cache_bytes=1 << 20,
                           dtype="float32", enforce_eager=True, warm_up=True)
    assert options == parsed and engine.max_ongoing_requests == 8

    class Sized(Exception):
        pass

    seen = []

    def sizing(asked, device, group=None, reserve=0):
        seen.append(asked)
        raise Sized  # the engine need not be built further

    monkeypatch.setattr(device_budget, "sized", sizing)
    monkeypatch.setattr(engine_replica.serve, "get_replica_context",
                        lambda: SimpleNamespace(replica_id=SimpleNamespace(to_full_id_str=lambda: "Engine#1")))
    class Replica(engine_replica.EngineReplica):
        def __del__(self):  # it never started: nothing to close (Serve awaits the real one)
            pass

    replica = Replica.__new__(Replica)
    with pytest.raises(Sized):
        asyncio.run(replica.__init__(model, pickle.loads(pickle.dumps(options)), routing, spec))
    assert seen == [parsed]


def test_a_bad_engine_option_in_a_serve_config_fails_where_the_app_is_built_naming_it(tmp_path):
    """`app_builder` makes the config's `engine_options` one `EngineOptions`, first: a bad value
    or an unknown key fails there, naming the option, before the model is looked for."""
    from cairn.workers import EngineOptionError

    config = load("local.yaml")
    config["applications"][0]["args"]["engine_options"] = {"max_num_seqs": 0}
    (app,) = ServeDeploySchema.model_validate(config).applications  # to Serve, args are the app's business
    with pytest.raises(EngineOptionError, match="max_num_seqs must be a positive integer, got 0") as bad:
        app_builder(dict(app.args, model_dir=str(tmp_path / "absent")))
    assert bad.value.option == "max_num_seqs"
    with pytest.raises(EngineOptionError, match=r"unknown engine option\(s\) \['max_num_seq'\]") as unknown:
        app_builder({"engine_options": {"max_num_seq": 8}})
    assert unknown.value.option == "max_num_seq"
    flagged = deploy.apply_overrides(load("local.yaml"), serve_args(["--cache-policy", "lru"]))
    with pytest.raises(EngineOptionError, match="cache_policy must be one of"):
        app_builder(flagged["applications"][0]["args"])


def test_request_limit_and_special_token_flags_reach_the_ingress_and_bad_ones_fail_at_deploy():
    out = deploy.apply_overrides(load("local.yaml"), serve_args(
        ["--api-limit", "max_messages=512", "--api-limit", "prepare_wait_s=2.5", "--special-tokens-in-content"]))
    args = out["applications"][0]["args"]
    assert args["api_limits"] == {"max_messages": 512, "prepare_wait_s": 2.5}
    assert args["special_tokens_in_content"] is True
    ingress = app_builder(args)._bound_deployment
    api = APIOptions.model_validate(ingress.init_args[3])
    assert api.api_limits == APILimits(max_messages=512, prepare_wait_s=2.5) and api.special_tokens_in_content
    with pytest.raises(ValueError, match="max_mesages"):
        deploy.apply_overrides(load("local.yaml"), serve_args(["--api-limit", "max_mesages=5"]))
    with pytest.raises(ValueError):
        app_builder({"api_limits": {"max_messages": 0}})


def test_the_tool_call_parser_flag_reaches_the_ingress_and_a_wrong_name_fails_at_deploy():
    from cairn.cluster.api.tool_call_formats import TOOL_CALL_PARSERS
    from cairn.cluster.cli import TOOL_CALL_PARSERS as CLI_CHOICES

    assert CLI_CHOICES == TOOL_CALL_PARSERS  # the CLI spells them out so that --help imports nothing
    args = deploy.apply_overrides(load("local.yaml"), serve_args(["--tool-call-parser", "qwen3_xml"]))
    assert args["applications"][0]["args"]["tool_call_parser"] == "qwen3_xml"
    ingress = app_builder(args["applications"][0]["args"])._bound_deployment
    assert APIOptions.model_validate(ingress.init_args[3]).tool_call_parser == "qwen3_xml"
    assert "tool_call_parser" not in deploy.apply_overrides(load("local.yaml"), serve_args([]))["applications"][0]["args"]
    with pytest.raises(ValueError, match="tool_call_parser"):
        app_builder({"tool_call_parser": "hermes"})


# ---- what another node must reach ------------------------------------------------------------------
CLUSTER_CONFIGS = [("cluster.yaml", "serve.yaml"), ("cluster-8gpu.yaml", "serve-8gpu.yaml")]


def strings(value):
    """Every string in a loaded YAML document, keys included."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for k, v in value.items():
            yield from strings(k)
            yield from strings(v)
    elif isinstance(value, list):
        for v in value:
            yield from strings(v)


@pytest.mark.parametrize("cluster_file, serve_file", CLUSTER_CONFIGS)
def test_nothing_in_a_cluster_config_dials_this_machine_for_what_another_node_must_reach(cluster_file, serve_file):
    from urllib.parse import urlsplit

    from cairn.cache_service.actor import HEAD_HOST

    cluster, serve = load(cluster_file), load(serve_file)
    for text in [*strings(cluster), *strings(serve)]:
        assert not re.search(r"\b(127\.0\.0\.1|localhost)\b", text), f"a loopback address in a cluster config: {text!r}"
    assert serve["proxy_location"] == "EveryNode" and serve["http_options"]["host"] == "0.0.0.0"
    # the index's Redis: on the head, reachable from every node, kept on disk, never evicting
    starts = " ".join(cluster["head_start_ray_commands"])
    redis = re.search(r"redis-server (.*?)(\)|$)", starts).group(1)
    flags = dict(re.findall(r"--([\w-]+) (\S+)", redis))
    assert flags["bind"] == "0.0.0.0" and flags["protected-mode"] == "no"
    assert flags["appendonly"] == "yes" and flags["maxmemory-policy"] == "noeviction"
    assert any("ray start --address=$RAY_HEAD_IP" in c for c in cluster["worker_start_ray_commands"])
    ray_port = re.search(r"ray start --head --port=(\d+)", starts).group(1)
    namespaces = set()
    for app in serve["applications"]:
        routing = RoutingConfig.model_validate(app["args"]["routing"])
        url = urlsplit(routing.redis_url)
        assert url.hostname == HEAD_HOST and str(url.port) == flags["port"] != ray_port
        namespaces.add(routing.namespace)
    assert len(namespaces) == len(serve["applications"]), "apps sharing one Redis keep their keys apart"
