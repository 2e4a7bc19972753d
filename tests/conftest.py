"""Shared test setup: the environment every test runs in, and the fixtures (helpers that are not
fixtures live in `tests/support/`).

TRITON_INTERPRET must be set before any @triton.jit is decorated, so it is set here, first.
Nothing may come from a hub: HF_HUB_OFFLINE=1. Tiny checkpoints are built locally, once per
session: by transformers (the outside oracle's own save_pretrained) and by `cairn demo-model`.
Engines run fp32 (`CAIRN_DTYPE=float32`: what `dtype="auto"` picks, here and in every process the
tests start): the parity oracles are fp32, and auto would pick bf16 on a CPU with native bf16.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("CAIRN_DTYPE", "float32")

import shutil  # noqa: E402
import subprocess  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from tests.support.checkpoints import HUB_MAIN, HUB_REPO, HUB_V2, build_hf_checkpoint, write_hub_snapshot  # noqa: E402
from tests.support.ray_checks import free_port  # noqa: E402

# Tiny models are overhead-bound: one intra-op thread is fastest and immune to a busy neighbour core.
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def hf_checkpoint(tmp_path_factory):
    made: dict[str, Path] = {}

    def get(kind: str) -> Path:
        if kind not in made:
            made[kind] = build_hf_checkpoint(tmp_path_factory.mktemp(f"hf-{kind}"), kind)
        return made[kind]

    return get


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    from cairn.workers.demo import write_demo_model

    return write_demo_model(tmp_path_factory.mktemp("demo-tiny"), size="tiny", seed=0)


@pytest.fixture(scope="session")
def demo_model(tmp_path_factory):
    """`demo_model(arch)`: the tiny demo checkpoint of that architecture, written once a session."""
    from cairn.workers.demo import write_demo_model

    made: dict[str, Path] = {}

    def get(arch: str) -> Path:
        if arch not in made:
            made[arch] = write_demo_model(tmp_path_factory.mktemp(f"demo-{arch}"), size="tiny", seed=0, arch=arch)
        return made[arch]

    return get


@pytest.fixture(scope="session")
def trained_spec_model(tmp_path_factory) -> Path:
    """The tiny qwen3_5 demo model trained for speculative decoding, with its trained MTP head
    (`cairn demo-model --mtp trained`; about a minute on CPU, once a session)."""
    from cairn.workers.demo import write_demo_model
    from cairn.workers.demo.speculative_training import train_for_speculation

    path = write_demo_model(tmp_path_factory.mktemp("demo-trained-mtp"), size="tiny", arch="qwen3_5")
    train_for_speculation(path)
    return path


@pytest.fixture
def fresh_compile_watch(monkeypatch):
    """cairn.kernels.common.compile_watch as in a process that has compiled nothing yet (other
    tests launch kernels in this one)."""
    from cairn.kernels.common import compile_watch

    monkeypatch.setattr(compile_watch, "_seen", [])
    monkeypatch.setattr(compile_watch, "_keys", set())
    return compile_watch


@pytest.fixture
def hf_hub(tmp_path, tiny_model_dir, monkeypatch) -> Path:
    """A Hugging Face cache, $HF_HOME/hub, holding the tiny demo model as HUB_REPO: `main` at
    HUB_MAIN, branch `v2` at HUB_V2 (another config); HF_HUB_OFFLINE=1. Returns the cache."""
    cache = tmp_path / "hf" / "hub"
    repo = cache / f"models--{HUB_REPO.replace('/', '--')}"
    write_hub_snapshot(repo, HUB_MAIN, tiny_model_dir)
    write_hub_snapshot(repo, HUB_V2, tiny_model_dir, rms_norm_eps=1e-5)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(HUB_MAIN)
    (repo / "refs" / "v2").write_text(HUB_V2)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.delenv("HUGGINGFACE_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return cache


@pytest.fixture
def loader_reads(monkeypatch) -> dict[str, list[str]]:
    """Records what cairn.workers.model.loader reads from safetensors files: {"whole": tensor names
    read whole (`get_tensor`), "sliced": names read in slices (`get_slice`)}."""
    import cairn.workers.model.loader as loader

    reads: dict[str, list[str]] = {"whole": [], "sliced": []}
    real_open = loader.safe_open

    class Recording:
        def __init__(self, *args, **kwargs):
            self.handle = real_open(*args, **kwargs)

        def __enter__(self):
            self.handle.__enter__()
            return self

        def __exit__(self, *exc):
            return self.handle.__exit__(*exc)

        def keys(self):
            return self.handle.keys()

        def get_tensor(self, name):
            reads["whole"].append(name)
            return self.handle.get_tensor(name)

        def get_slice(self, name):
            reads["sliced"].append(name)
            return self.handle.get_slice(name)

    monkeypatch.setattr(loader, "safe_open", Recording)
    return reads


@pytest.fixture(scope="session")
def redis_url():
    """A real redis-server on a free loopback port for the whole run; stopped at the end."""
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed (apt-get install -y redis-server)")
    import redis

    port = free_port()
    proc = subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                             "--appendonly", "no"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"redis://127.0.0.1:{port}/0"
    client, deadline = redis.Redis.from_url(url), time.monotonic() + 10
    while True:
        try:
            client.ping()
            break
        except redis.ConnectionError:
            if time.monotonic() > deadline or proc.poll() is not None:
                proc.kill()
                raise
            time.sleep(0.02)
    yield url
    client.close()
    proc.terminate()
    proc.wait(timeout=10)


@pytest.fixture(scope="session")
def ray_hf_home(tmp_path_factory) -> Path:
    """The Hugging Face home every Ray worker of the run sees (offline): a test that deploys by
    hub id writes its snapshot under `<this>/hub` first (`write_hub_snapshot`)."""
    return tmp_path_factory.mktemp("ray-hf-home")


@pytest.fixture(scope="session")
def ray_session(ray_hf_home):
    """One local Ray for the whole run (ray.init costs seconds and a gigabyte). A Ray an earlier
    test left running (an in-process deploy) is shut down first, so the order tests run in does
    not matter."""
    ray = pytest.importorskip("ray")
    if ray.is_initialized():
        ray.shutdown()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, namespace="cairn-tests",
             object_store_memory=80 * 1024 * 1024,
             runtime_env={"env_vars": {"HF_HOME": str(ray_hf_home), "HF_HUB_OFFLINE": "1"}})
    yield ray
    try:
        from ray import serve

        serve.shutdown()
    except Exception:  # serve was never started
        pass
    ray.shutdown()


