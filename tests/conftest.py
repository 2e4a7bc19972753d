"""Shared test setup.

TRITON_INTERPRET must be set before any @triton.jit is decorated, so it is set here, first.
Nothing may come from a hub: HF_HUB_OFFLINE=1. Tiny checkpoints are built locally, once per
session: by transformers (the outside oracle's own save_pretrained) and by `cairn demo-model`.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

import shutil  # noqa: E402
import socket  # noqa: E402
import subprocess  # noqa: E402
import time  # noqa: E402
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


def build_hf_checkpoint(path: Path, kind: str, dtype: torch.dtype = torch.float32, seed: int = 0, **save) -> Path:
    """Writes a random Qwen3NextForCausalLM with transformers' own save_pretrained."""
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen3NextConfig(**CHECKPOINTS[kind])
    model = Qwen3NextForCausalLM(cfg).eval()
    with torch.no_grad():  # zero-initialised norms would hide a wrong (1 + w) convention
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
        model.model.embed_tokens.weight.mul_(20)  # sharper logits: greedy choices are not near-ties
    model.to(dtype).save_pretrained(path, **save)
    return path


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
def ray_session():
    """One local Ray for the whole run (ray.init costs seconds and a gigabyte)."""
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, namespace="cairn-tests",
             object_store_memory=80 * 1024 * 1024)
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
