"""`--model` and a Serve config's `model_dir` take a Hugging Face id as well as a directory.

Each test builds a Hugging Face cache on disk as huggingface_hub lays it out (conftest's `hf_hub`:
`models--org--name/{blobs,snapshots/<commit>,refs/<branch>}`, snapshot files linked to blobs)
holding the tiny demo model, and points HF_HOME at it with HF_HUB_OFFLINE=1: nothing reaches a
hub. The id resolves (by branch, by revision, by commit), serves offline by its id (`cairn serve
--replicas 1`, the ingress and engine replica constructors a Serve deployment runs on each node;
`cairn generate` in tests/cluster/test_cli_generate.py) under its id as the model name, and an id that
resolves to nothing fails before Ray starts, naming the id and the cache it looked in.
"""

import asyncio
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest

from tests.support.checkpoints import HUB_MAIN as MAIN, HUB_REPO as REPO, HUB_V2 as V2
from tests.support.fake_clients import OneTokenClient
from tests.support.ray_checks import free_port
from cairn.workers import EngineOptions, EngineSpec, ModelNotFound, ModelSource, SamplingParams
from tests.support.paths import REPO as CHECKOUT

ROOT = CHECKOUT

def snapshot_of(cache: Path, commit: str) -> Path:
    return cache / f"models--{REPO.replace('/', '--')}" / "snapshots" / commit


# ---- resolving -------------------------------------------------------------------------------

def test_an_id_resolves_offline_to_the_snapshot_its_main_branch_names(hf_hub):
    source = ModelSource.parse(REPO)
    assert (source.repo_id, source.revision, source.directory) == (REPO, None, None)
    local = source.local_dir()
    assert local == snapshot_of(hf_hub, MAIN) and (local / "config.json").is_file()
    assert source.served_name == REPO and str(source) == REPO


def test_a_revision_resolves_by_branch_or_by_commit(hf_hub, tiny_model_dir):
    assert ModelSource.parse(f"{REPO}@v2").local_dir() == snapshot_of(hf_hub, V2)
    assert ModelSource.parse(f"{REPO}@{MAIN}").local_dir() == snapshot_of(hf_hub, MAIN)
    assert ModelSource.parse(f"{REPO}@v2").served_name == REPO, "the name clients use leaves the revision out"
    main, v2 = (EngineSpec.from_model_dir(ModelSource.parse(m).local_dir()) for m in (REPO, f"{REPO}@v2"))
    assert v2 != main, "another config, another model"
    assert main == EngineSpec.from_model_dir(tiny_model_dir), "the same files through the cache's links"


def test_pinning_names_the_commit_read_so_every_node_loads_that_snapshot(hf_hub, tiny_model_dir):
    source = ModelSource.parse(f"{REPO}@v2")
    pinned = source.pinned(source.local_dir())
    assert str(pinned) == f"{REPO}@{V2}" and pinned.served_name == REPO
    (hf_hub / f"models--{REPO.replace('/', '--')}" / "refs" / "v2").write_text(MAIN)  # the branch moves on
    assert ModelSource.parse(str(pinned)).local_dir() == snapshot_of(hf_hub, V2)
    directory = ModelSource.parse(tiny_model_dir)
    assert directory.pinned(tiny_model_dir) == directory


def test_hf_hub_cache_is_read_at_each_call_and_wins_over_hf_home(hf_hub, tmp_path, monkeypatch):
    moved = tmp_path / "elsewhere"
    shutil.move(hf_hub, moved)
    with pytest.raises(ModelNotFound, match=str(hf_hub)):
        ModelSource.parse(REPO).local_dir()
    monkeypatch.setenv("HF_HUB_CACHE", str(moved))
    assert ModelSource.parse(REPO).local_dir().parent.parent.parent == moved
    with pytest.raises(ModelNotFound, match=str(hf_hub)):  # an explicit environment is the one read
        ModelSource.parse(REPO).local_dir({"HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1"})


def test_an_existing_directory_is_a_directory_even_where_it_reads_as_an_id(tmp_path, monkeypatch, hf_hub):
    monkeypatch.chdir(tmp_path)
    (tmp_path / REPO).mkdir(parents=True)
    source = ModelSource.parse(REPO)
    assert source.directory == tmp_path / REPO and source.repo_id is None
    assert source.local_dir() == tmp_path / REPO and source.served_name == "tiny"
    assert str(ModelSource.parse(".")) == str(tmp_path), "a directory travels in a config as an absolute path"


@pytest.mark.parametrize("text", ["a/b/c", "/no/such/dir", "./no-such-dir", "~/no-such-dir", "org/", "name",
                                  "org/na me", "org--x/name", "org/name@", "org/name@two words", "org/name@a@b"])
def test_what_is_neither_a_directory_nor_an_id_is_refused_by_name(text):
    with pytest.raises(ValueError, match="neither a directory nor a Hugging Face id|revision after") as e:
        ModelSource.parse(text)
    assert repr(text) in str(e.value)


def test_an_unknown_id_names_the_id_its_revision_the_cache_and_offline_mode(hf_hub):
    with pytest.raises(ModelNotFound) as e:
        ModelSource.parse("cairn-org/nothing").local_dir()
    message = str(e.value)
    for wanted in ("'cairn-org/nothing'", "revision 'main'", str(hf_hub), "models--cairn-org--nothing",
                   "HF_HUB_OFFLINE=1", "hub from being asked"):
        assert wanted in message, message
    with pytest.raises(ModelNotFound, match=r"revision 'v9'.*no snapshot in the cache .*models--cairn-org--tiny"):
        ModelSource.parse(f"{REPO}@v9").local_dir()
    assert isinstance(e.value, FileNotFoundError), "a missing model is an OSError, as callers catch it"


def test_an_unreachable_hub_is_named_as_asked_when_not_offline(hf_hub, monkeypatch):
    import huggingface_hub
    from huggingface_hub.errors import LocalEntryNotFoundError

    def unreachable(*args, **kwargs):
        assert kwargs["local_files_only"] is False
        try:
            raise ConnectionError("Name or service not known")
        except ConnectionError as cause:
            raise LocalEntryNotFoundError("An error happened while trying to locate the files") from cause

    monkeypatch.setattr(huggingface_hub, "snapshot_download", unreachable)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    with pytest.raises(ModelNotFound, match="the hub was asked and could not give it: ConnectionError: Name or "
                                            "service not known"):
        ModelSource.parse("cairn-org/nothing").local_dir()


def test_only_the_files_the_engine_reads_are_fetched_into_the_cache_the_environment_names(hf_hub, monkeypatch):
    import huggingface_hub
    from huggingface_hub.utils import filter_repo_objects

    asked = {}

    def record(repo_id, **kwargs):
        asked.update(kwargs, repo_id=repo_id)
        return str(snapshot_of(hf_hub, MAIN))

    monkeypatch.setattr(huggingface_hub, "snapshot_download", record)
    monkeypatch.setenv("HF_TOKEN", "hf_test")
    ModelSource.parse(f"{REPO}@v2").local_dir()
    assert (asked["repo_id"], asked["revision"], Path(asked["cache_dir"])) == (REPO, "v2", hf_hub)
    assert asked["local_files_only"] is True and asked["token"] == "hf_test"
    repo_files = ["config.json", "generation_config.json", "model-00001-of-00002.safetensors",
                  "model-00002-of-00002.safetensors", "model.safetensors.index.json", "tokenizer.json",
                  "tokenizer_config.json", "chat_template.jinja", "README.md", ".gitattributes",
                  "pytorch_model.bin", "original/consolidated.00.pth", "merges.txt", "vocab.json", "LICENSE"]
    fetched = set(filter_repo_objects(repo_files, allow_patterns=asked["allow_patterns"]))
    assert fetched == set(repo_files[:8])


# ---- serving by id ---------------------------------------------------------------------------

def run_cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-m", "cairn.cluster.cli", *args], capture_output=True, text=True, env=env,
                          timeout=timeout)


def test_cairn_generate_refuses_an_unknown_id_with_a_message_not_a_traceback(hf_hub):
    proc = run_cli("generate", "--model", "cairn-org/nothing", "--prompt", "x")
    assert proc.returncode == 2
    assert "cairn generate: Hugging Face model 'cairn-org/nothing'" in proc.stderr and str(hf_hub) in proc.stderr
    assert "Traceback" not in proc.stderr


def test_cairn_serve_in_process_serves_an_id_under_its_name(hf_hub):
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "cairn.cluster.cli", "serve", "--replicas", "1", "--model", REPO,
                             "--port", str(port)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=dict(os.environ, PYTHONPATH=str(ROOT)), start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, proc.stdout.read()
            assert time.monotonic() < deadline, "cairn serve --replicas 1 never answered /health"
            try:
                if httpx.get(base + "/health", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.3)
        assert [m["id"] for m in httpx.get(base + "/v1/models", timeout=30).json()["data"]] == [REPO]
        reply = httpx.post(base + "/v1/chat/completions", timeout=60, json={
            "model": REPO, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
        assert reply.status_code == 200 and reply.json()["model"] == REPO
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def test_cairn_serve_refuses_an_unknown_id_before_ray_starts(hf_hub, monkeypatch, capsys):
    import ray

    from cairn.cluster.cli import main

    def no_ray(*args, **kwargs):
        raise AssertionError("ray.init was called for a model that resolves to nothing")

    monkeypatch.setattr(ray, "init", no_ray)
    for argv in (["serve", "--model", "cairn-org/nothing@v3"],
                 ["serve", "--model", "cairn-org/nothing", "--config", str(ROOT / "cairn" / "configs" / "serve.yaml")],
                 ["serve", "--model", "cairn-org/nothing", "--replicas", "1"]):
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert "cairn serve: Hugging Face model 'cairn-org/nothing'" in err and str(hf_hub) in err, err
    assert main(["serve", "--model", "not a model"]) == 2
    assert "neither a directory nor a Hugging Face id" in capsys.readouterr().err


def test_cairn_serve_resolves_with_the_environment_the_config_gives_its_replicas(hf_hub, tmp_path, monkeypatch):
    from cairn.cluster import deploy

    monkeypatch.setenv("HF_HOME", str(tmp_path / "empty"))
    config = {"applications": [{"name": "a", "import_path": "cairn.cluster.app:app_builder", "args": {"model_dir": REPO},
                                "runtime_env": {"env_vars": {"HF_HOME": str(hf_hub.parent)}}}]}
    deploy.resolve_models(config)  # found in the cache the replicas will read
    del config["applications"][0]["runtime_env"]
    with pytest.raises(ModelNotFound, match=str(tmp_path / "empty")):
        deploy.resolve_models(config)


# ---- on each node: the constructors Serve runs -------------------------------------------------

def test_the_deploy_step_pins_the_id_and_the_ingress_resolves_it_and_serves_it_under_its_name(hf_hub):
    from fastapi.testclient import TestClient

    from cairn.cluster.app import app_builder
    from cairn.cluster.ingress import Ingress

    built = app_builder({"model_dir": REPO})._bound_deployment
    engine_args, ingress_args = built.init_args[0]._bound_deployment.init_args, built.init_args
    assert engine_args[0] == ingress_args[1] == f"{REPO}@{MAIN}", "the config carries the id, pinned"
    spec = ingress_args[2]
    assert spec == EngineSpec.from_model_dir(snapshot_of(hf_hub, MAIN), EngineOptions())

    class Handle:  # the engine deployment, answering as OneTokenClient does
        def __init__(self):
            self.client = OneTokenClient()
            self.generate = SimpleNamespace(remote=lambda request: Stream(self.client.generate(request)))

        def options(self, **_):
            return self

    class Stream:
        def __init__(self, outputs):
            self.outputs = outputs

        def __aiter__(self):
            return self.outputs

        def cancel(self):
            pass

    class Replica(Ingress):
        def __del__(self):  # Serve awaits the async one; here the test does
            pass

    async def construct():
        ingress = Replica.__new__(Replica)
        await ingress.__init__(Handle(), ingress_args[1], spec)
        return ingress

    loop = asyncio.new_event_loop()
    try:
        ingress = loop.run_until_complete(construct())
        assert ingress.model_dir == snapshot_of(hf_hub, MAIN)
        with TestClient(ingress.__serve_build_asgi_app__()) as c:
            assert [m["id"] for m in c.get("/v1/models").json()["data"]] == [REPO]
            reply = c.post("/v1/completions", json={"model": REPO, "prompt": "a cairn", "max_tokens": 1})
            assert reply.status_code == 200 and reply.json()["model"] == REPO
        loop.run_until_complete(Ingress.__del__(ingress))
    finally:
        loop.close()


def test_an_engine_replica_resolves_the_id_on_its_own_node(hf_hub, monkeypatch):
    import gc

    from cairn.cache_service.publisher import ApplyResult
    from cairn.cluster import engine_replica

    class Index:  # the index actor, as far as the publisher asks it
        def __init__(self, cfg):
            pass

        async def get(self):
            return self

        async def call(self, method, *args):
            return ApplyResult(True, False) if method == "apply" else False

    replica_id = SimpleNamespace(to_full_id_str=lambda: "SERVE_REPLICA::test#Engine#1")
    monkeypatch.setattr(engine_replica.serve, "get_replica_context", lambda: SimpleNamespace(replica_id=replica_id))
    monkeypatch.setattr(engine_replica, "IndexHandle", Index)
    spec = EngineSpec.from_model_dir(snapshot_of(hf_hub, V2), EngineOptions())

    class Replica(engine_replica.EngineReplica):
        def __del__(self):  # Serve awaits the async one; here the test does
            pass

    async def run():
        replica = Replica.__new__(Replica)
        await replica.__init__(f"{REPO}@v2", EngineOptions(num_pages=32, max_num_seqs=2, warm_up=True), {}, spec)
        try:
            assert replica.engine.spec == spec, "the replica loaded the v2 snapshot from this node's cache"
            from cairn.workers.request import GenerateRequest

            request = GenerateRequest(request_id="r", prompt_token_ids=[3, 4, 5],
                                      params=SamplingParams(max_tokens=2, temperature=0))
            outs = [out async for out in replica.generate(request)]
            assert outs[-1].finished and outs[-1].worker_id == "SERVE_REPLICA::test#Engine#1"
        finally:
            await engine_replica.EngineReplica.__del__(replica)

    try:
        asyncio.run(run())
    finally:
        gc.unfreeze()
