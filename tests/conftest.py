"""Shared test setup.

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

import hashlib  # noqa: E402
import json  # noqa: E402
import shutil  # noqa: E402
import socket  # noqa: E402
import subprocess  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
from contextlib import ExitStack, contextmanager  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

# Tiny models are overhead-bound: one intra-op thread is fastest and immune to a busy neighbour core.
torch.set_num_threads(1)

# Small Qwen3-Next shapes that keep every feature of the architecture: GQA, partial rotary,
# more value heads than key heads, key dim != value dim, odd vocab.
BASE = dict(
    vocab_size=211, hidden_size=48, intermediate_size=80, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    linear_key_head_dim=8, linear_value_head_dim=12, linear_num_key_heads=2, linear_num_value_heads=6,
    linear_conv_kernel_dim=4, max_position_embeddings=512, rms_norm_eps=1e-6, num_experts=0,
)
CHECKPOINTS = {
    "dense": dict(BASE, full_attention_interval=2),
    "moe": dict(BASE, num_experts=6, num_experts_per_tok=2, moe_intermediate_size=24,
                shared_expert_intermediate_size=32, decoder_sparse_step=1, mlp_only_layers=[2],
                full_attention_interval=4),
    "tied": dict(BASE, tie_word_embeddings=True, full_attention_interval=4, num_hidden_layers=3,
                 layer_types=["linear_attention", "full_attention", "linear_attention"]),
    "attention_only": dict(BASE, num_hidden_layers=2, layer_types=["full_attention"] * 2),
}

# Qwen3.5 / 3.6 text shapes: head_dim 32 so interleaved M-RoPE has three non-empty sections
# (rotary dim 8 = 2 * (2 + 1 + 1)); three DeltaNet layers to one attention layer, as published.
Q35_TEXT = dict({k: v for k, v in BASE.items() if k != "num_experts"}, head_dim=32, full_attention_interval=4,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
                                 "mrope_section": [2, 1, 1], "mrope_interleaved": True})
Q35_MOE_TEXT = dict({k: v for k, v in Q35_TEXT.items() if k != "intermediate_size"}, num_experts=6,
                    num_experts_per_tok=2, moe_intermediate_size=24, shared_expert_intermediate_size=32)
Q35_VISION = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=48, patch_size=4,
                  num_position_embeddings=16)
# kind -> (transformers model class, its config class, config kwargs); "vl" kinds are the
# published vision-language layout (text under model.language_model.*, a vision tower beside it).
QWEN3_5_CHECKPOINTS = {
    "q35_dense": ("Qwen3_5ForCausalLM", "Qwen3_5TextConfig", Q35_TEXT),
    "q35_dense_vl": ("Qwen3_5ForConditionalGeneration", "Qwen3_5Config",
                     dict(text_config=Q35_TEXT, vision_config=Q35_VISION)),
    "q35_tied": ("Qwen3_5ForCausalLM", "Qwen3_5TextConfig", dict(Q35_TEXT, tie_word_embeddings=True)),
    "q35_tied_vl": ("Qwen3_5ForConditionalGeneration", "Qwen3_5Config",
                    dict(text_config=Q35_TEXT, vision_config=Q35_VISION, tie_word_embeddings=True)),
    "q35_moe": ("Qwen3_5MoeForCausalLM", "Qwen3_5MoeTextConfig", Q35_MOE_TEXT),
    "q35_moe_vl": ("Qwen3_5MoeForConditionalGeneration", "Qwen3_5MoeConfig",
                   dict(text_config=Q35_MOE_TEXT, vision_config=Q35_VISION)),
}


# Shapes that split 2 and 4 ways (tensor parallelism): 8 query heads over 2 K/V heads (fewer K/V
# heads than 4 ranks: replicated), 4 key heads with 2 value heads each, an odd vocabulary (the last
# rank's vocabulary rows are padding).
TP_TEXT = dict(vocab_size=211, hidden_size=64, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
               head_dim=16, linear_key_head_dim=8, linear_value_head_dim=12, linear_num_key_heads=4,
               linear_num_value_heads=8, linear_conv_kernel_dim=4, max_position_embeddings=512, rms_norm_eps=1e-6,
               full_attention_interval=2)
TP_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48)
CHECKPOINTS["tp_next_moe"] = dict(TP_TEXT, intermediate_size=96, decoder_sparse_step=1, mlp_only_layers=[1], **TP_MOE)
QWEN3_5_CHECKPOINTS["tp_q35"] = ("Qwen3_5ForCausalLM", "Qwen3_5TextConfig", dict(TP_TEXT, intermediate_size=96))
QWEN3_5_CHECKPOINTS["tp_q35_moe_vl"] = ("Qwen3_5MoeForConditionalGeneration", "Qwen3_5MoeConfig",
                                        dict(text_config=dict(TP_TEXT, **TP_MOE),
                                             vision_config=dict(Q35_VISION, out_hidden_size=64),
                                             tie_word_embeddings=True))


def build_hf_checkpoint(path: Path, kind: str, dtype: torch.dtype = torch.float32, seed: int = 0, **save) -> Path:
    """Writes a random model of `kind` (CHECKPOINTS: Qwen3-Next; QWEN3_5_CHECKPOINTS: Qwen3.5)
    with transformers' own save_pretrained."""
    import transformers

    if kind in QWEN3_5_CHECKPOINTS:
        model_class, config_class, kwargs = QWEN3_5_CHECKPOINTS[kind]
    else:
        model_class, config_class, kwargs = "Qwen3NextForCausalLM", "Qwen3NextConfig", CHECKPOINTS[kind]
    torch.manual_seed(seed)
    cfg = getattr(transformers, config_class)(**kwargs)
    model = getattr(transformers, model_class)(cfg).eval()
    with torch.no_grad():  # zero-initialised norms would hide a wrong (1 + w) convention
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
        model.get_input_embeddings().weight.mul_(20)  # sharper logits: greedy choices are not near-ties
    model.to(dtype).save_pretrained(path, **save)
    return path


def hf_reference_model(path: Path):
    """transformers' own model for a checkpoint directory, by the class config.json names."""
    import json

    import transformers

    name = json.loads((Path(path) / "config.json").read_text())["architectures"][0]
    return getattr(transformers, name).from_pretrained(path).eval()


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
    from workers.demo import write_demo_model

    return write_demo_model(tmp_path_factory.mktemp("demo-tiny"), size="tiny", seed=0)


@pytest.fixture(scope="session")
def demo_model(tmp_path_factory):
    """`demo_model(arch)`: the tiny demo checkpoint of that architecture, written once a session."""
    from workers.demo import write_demo_model

    made: dict[str, Path] = {}

    def get(arch: str) -> Path:
        if arch not in made:
            made[arch] = write_demo_model(tmp_path_factory.mktemp(f"demo-{arch}"), size="tiny", seed=0, arch=arch)
        return made[arch]

    return get


HUB_REPO = "cairn-org/tiny"  # the Hugging Face id `hf_hub` holds
HUB_MAIN = hashlib.sha1(b"main").hexdigest()  # commits are 40 hex digits, as the hub's are
HUB_V2 = hashlib.sha1(b"v2").hexdigest()


def write_hub_snapshot(repo: Path, commit: str, model_dir: Path, **config_changes) -> Path:
    """One snapshot of `model_dir`'s files under a cache's `models--org--name` folder, each file a
    link to its blob, as huggingface_hub writes it; `config_changes` are written into config.json."""
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (repo / "blobs").mkdir(exist_ok=True)
    for f in model_dir.iterdir():
        data = f.read_bytes()
        if f.name == "config.json" and config_changes:
            data = json.dumps({**json.loads(data), **config_changes}).encode()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snapshot / f.name).symlink_to(os.path.relpath(blob, snapshot))
    return snapshot


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
    """Records what workers.model.loader reads from safetensors files: {"whole": tensor names
    read whole (`get_tensor`), "sliced": names read in slices (`get_slice`)}."""
    import workers.model.loader as loader

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


def assert_same_output(a, b) -> None:
    """Two engine outputs are the same computation: equal tokens, logprobs within 1e-4 (fp32
    rounding of a different batch or split)."""
    assert a.token_ids == b.token_ids
    torch.testing.assert_close(torch.tensor([lp.logprob for lp in a.logprobs]),
                               torch.tensor([lp.logprob for lp in b.logprobs]), atol=1e-4, rtol=0)


def open_chat_stream(http, model: str, messages: list[dict], max_tokens: int = 1500):
    """A long streamed chat completion kept in flight (ignore_eos) until its response is closed:
    load a replica holds while a test routes around it. `http`: an httpx.Client on the server."""
    body = {"model": model, "stream": True, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0,
            "messages": messages}
    return http.send(http.build_request("POST", "/v1/chat/completions", json=body), stream=True)


def chat_turns(client, model: str, system: str, questions: list[str]) -> tuple[list[int], list[int], set]:
    """A conversation through the official client, greedy, each answer echoed back with its
    reasoning as a chat app does: (prompt tokens, cached tokens) per turn, and the replicas
    (`cluster.ingress.REPLICA_HEADER`) that served it. `client` may be a list of clients: turn t
    goes through client[t % len(client)]."""
    from cluster.ingress import REPLICA_HEADER

    clients = client if isinstance(client, (list, tuple)) else [client]
    messages, prompts, cached, replicas = [{"role": "system", "content": system}], [], [], set()
    for turn, question in enumerate(questions):
        messages.append({"role": "user", "content": question})
        raw = clients[turn % len(clients)].chat.completions.with_raw_response.create(
            model=model, messages=messages, max_tokens=8, temperature=0)
        out = raw.parse()
        prompts.append(out.usage.prompt_tokens)
        cached.append(out.usage.prompt_tokens_details.cached_tokens)
        replicas.add(raw.headers.get(REPLICA_HEADER))
        message = out.choices[0].message
        messages.append({"role": "assistant", "content": message.content or "",
                         "reasoning_content": getattr(message, "reasoning_content", None) or ""})
    return prompts, cached, replicas


def index_converged(engine, index, timeout_s: float = 20.0) -> dict[str, tuple[frozenset, frozenset]]:
    """Waits until the cache index holds exactly what every live engine replica holds, and no one
    else; returns replica -> (pages, states). `engine`: the Engine deployment's handle; `index()`:
    the index actor now registered (looked up each time: a new one once killed for good)."""
    import ray

    deadline = time.monotonic() + timeout_s
    while True:
        held = {w: (p, s) for w, p, s in engine.broadcast("cache_contents").results(timeout_s=30)}
        actor = index()
        known = {w: ray.get(actor.contents.remote(w), timeout=30) for w in held}
        stale = ray.get(actor.workers_needing_resync.remote(), timeout=30)
        if not stale and ray.get(actor.workers.remote(), timeout=30) == set(held) and all(
                known[w] is not None and tuple(known[w]) == held[w] for w in held):
            return held
        sizes = {w: ((len(p), len(s)), known[w] and (len(known[w][0]), len(known[w][1])))
                 for w, (p, s) in held.items()}
        assert time.monotonic() < deadline, f"index never converged: needing resync {stale}, " \
                                            f"(replica, index) sizes {sizes}"
        time.sleep(0.25)


class LoadThreads:
    """Threads running `_run(k)` (k = 0 .. threads - 1, a subclass's load loop, which returns once
    `_stop` is set) from the start of a `with` block to its end, which stops and joins them."""

    def __init__(self, threads: int):
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(k,), daemon=True) for k in range(threads)]

    def __enter__(self):
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        for t in self._threads:
            t.join(timeout=90)

    def _run(self, k: int) -> None:
        raise NotImplementedError


def kill_index_actor(name: str, namespace: str = "cairn") -> None:
    """Kills a test's cache-index actor (detached: it outlives its app) if it is still there."""
    import ray

    try:
        ray.kill(ray.get_actor(name, namespace=namespace), no_restart=True)
    except ValueError:  # never created, or already gone
        pass


def wait_for_log(proc: subprocess.Popen, log_path: Path, text: str, timeout_s: float) -> None:
    """Waits until `text` appears in the log of `proc` (a `cairn serve`), failing with the log's
    tail if the process exits first or the time runs out."""
    deadline = time.monotonic() + timeout_s
    while text not in log_path.read_text():
        assert proc.poll() is None, f"cairn serve exited with {proc.returncode}:\n{log_path.read_text()[-3000:]}"
        assert time.monotonic() < deadline, f"cairn serve never came up:\n{log_path.read_text()[-3000:]}"
        time.sleep(0.5)


def actor_nodes() -> dict[str, str]:
    """Every live named actor of the connected Ray cluster -> the id of the node it runs on (from
    the GCS's actor table: Ray's state API needs a dashboard, which test clusters may not run)."""
    import ray

    return {a["Name"]: a["Address"]["NodeID"] for a in ray._private.state.actors(actor_state_name="ALIVE").values()
            if a["Name"]}


def wait_until(condition, timeout_s: float, what: str, every_s: float = 0.1):
    """`condition()` once it is truthy, polled every `every_s`; TimeoutError naming `what` past `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not (value := condition()):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not within {timeout_s} s")
        time.sleep(every_s)
    return value


def mirrors_agree(ingress, index, engines: list[str], seen: dict | None = None) -> bool:
    """Whether every ingress replica's index mirror (`Ingress.routing_state`, through the Ingress
    deployment's handle `ingress`) holds the index actor's (`index`) epoch, cursor and digest and
    knows exactly the engine replicas `engines`; what was read is left in `seen` (`ingresses`,
    `index`)."""
    import ray

    seen = {} if seen is None else seen
    seen.update(ingresses=ingress.broadcast("routing_state").results(timeout_s=30),
                index=ray.get(index.digest.remote(), timeout=30))
    want = [seen["index"][k] for k in ("epoch", "cursor", "digest")]
    mirrors = [m for state in seen["ingresses"] for m in state["routers"]]
    return all(state["routers"] for state in seen["ingresses"]) and all(
        [m.get(k) for k in ("epoch", "cursor", "digest")] == want and m["workers"] == sorted(engines)
        for m in mirrors)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
    """One local Ray for the whole run (ray.init costs seconds and a gigabyte)."""
    ray = pytest.importorskip("ray")
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


class OneTokenClient:
    """An `EngineClient` with no engine behind it: it keeps every request it gets and answers each
    with one token. For API tests that need the ingress's work, not a model's."""

    def __init__(self, max_model_len: int = 1 << 16):
        from workers import EngineSpec

        self.spec = EngineSpec(fingerprint="scripted", page_size=16, max_model_len=max_model_len, recurrent=True,
                               vocab_size=512)
        self.requests: list = []

    async def generate(self, request):
        from workers import RequestOutput

        self.requests.append(request)
        yield RequestOutput(request.request_id, [5], None, 1, 0, token_ids=[5], finish_reason="length")

    async def abort(self, request_id):
        return False

    async def metrics(self):
        return {}

    def num_waiting(self):
        return 0

    async def ready(self):
        return True


class ScriptedClient(OneTokenClient):
    """An `EngineClient` that answers every request with `script`, one token per output, and keeps
    the requests: exact tokens in, exact text out."""

    def __init__(self):
        super().__init__(max_model_len=4096)
        self.script: list[int] = []

    async def generate(self, request):
        import asyncio

        from workers import RequestOutput

        self.requests.append(request)
        out: list[int] = []
        for t in self.script[:request.params.max_tokens]:
            out.append(t)
            done = len(out) == len(self.script) or len(out) == request.params.max_tokens
            yield RequestOutput(request.request_id, [t], None, len(out), 0, token_ids=list(out) if done else None,
                                finish_reason=("stop" if len(out) == len(self.script) else "length") if done else None)
            await asyncio.sleep(0)


def byte_tokens(tok, text: str) -> list[int]:
    """One token per UTF-8 byte (the byte-level alphabet), so characters and tags split."""
    from cluster.api.tokenizer import byte_of_char

    char_of = {b: ch for ch, b in byte_of_char().items()}
    return [tok.token_to_id(char_of[b]) for b in text.encode()]


def with_template(model_dir: Path, out: Path, template: str) -> Path:
    """`out`: `model_dir`'s tokenizer with the chat template `template` (a tokenizer-only model
    directory, for the API over a scripted engine)."""
    shutil.copy(model_dir / "tokenizer.json", out / "tokenizer.json")
    (out / "chat_template.jinja").write_text(template)
    return out


@contextmanager
def background_apps(*apps):
    """A `BackgroundServer` for each ASGI app, in order; all stopped on exit."""
    from cluster.api.server import BackgroundServer

    with ExitStack() as stack:
        yield [stack.enter_context(BackgroundServer(app)) for app in apps]
