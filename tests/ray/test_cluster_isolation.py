"""No request, tenant or failure reaches another, on a real local Ray.

One Serve app (2 CPU replicas of the tiny demo model, API keys for two tenants) with its cache
index kept in a redis-server of its own (so killing it touches no other test):
- tenants: what tenant A sent is invisible to tenant B, by `cached_tokens` and by timing, and the
  index and the router hold nothing under B's page hashes for it (they are rooted in the tenant);
- a replica killed while it streams: its client gets a retryable error event (503
  `engine_unavailable`) and [DONE] within seconds, never a hang; the next requests succeed (on
  the other replica, then on its replacement);
- Redis killed under load: every request still succeeds (routing falls back to load and memory);
  once Redis is back (empty, as a fresh server is), the index is rebuilt from the replicas.
The index actor's own death (restarted, or killed for good) is tests/ray/test_cluster.py's.
"""

import json
import os
import shutil
import subprocess
import threading
import time
import uuid

import pytest

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
ray = pytest.importorskip("ray")
httpx = pytest.importorskip("httpx")

from cairn.cluster.app import build_application  # noqa: E402
from cairn.cluster.ingress import REPLICA_HEADER  # noqa: E402
from cairn.cluster.routing.routing_config import RoutingConfig  # noqa: E402
from tests.support.chat_tokens import shared_prefix  # noqa: E402
from tests.support.ray_checks import free_port  # noqa: E402

MODEL = "tiny"
INDEX = f"cairn-chaos-index-{uuid.uuid4().hex[:6]}"
KEYS = {"alice": "key-alice", "bob": "key-bob"}
ALICE, BOB = ({"Authorization": f"Bearer {KEYS[t]}"} for t in ("alice", "bob"))


class Redis:
    """A redis-server of this module's own, on a fixed port, that can be killed and restarted."""

    def __init__(self):
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc = None

    def start(self) -> None:
        import redis

        self.proc = subprocess.Popen(["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                                      "--appendonly", "no"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client, deadline = redis.Redis.from_url(self.url), time.monotonic() + 10
        while True:
            try:
                client.ping()
                return
            except redis.ConnectionError:
                assert time.monotonic() < deadline, "redis-server did not start"
                time.sleep(0.05)

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()


@pytest.fixture(scope="module")
def redis_server():
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed (apt-get install -y redis-server)")
    server = Redis()
    server.start()
    yield server
    if server.proc.poll() is None:
        server.kill()


@pytest.fixture(scope="module")
def app(ray_session, tiny_model_dir, redis_server):
    from ray import serve

    port = free_port()
    routing = RoutingConfig(index_actor_name=INDEX, index_timeout_ms=500, routing_stats_period_s=0.5,
                            redis_url=redis_server.url, namespace=f"chaos-{uuid.uuid4().hex[:6]}")
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(build_application(tiny_model_dir, replicas=2, num_cpus=0.25, routing=routing,
                                api=dict(served_model_name=MODEL), health_check_period_s=1.0,
                                api_keys=[f"{t}:{k}" for t, k in KEYS.items()]),
              name="chaos", route_prefix="/")
    yield f"http://127.0.0.1:{port}", serve.get_deployment_handle("Engine", app_name="chaos")
    serve.shutdown()
    ray.kill(ray.get_actor(INDEX, namespace=routing.index_actor_namespace), no_restart=True)


def body(i: int, max_tokens: int = 8, stream: bool = False) -> dict:
    return {"model": MODEL, "max_tokens": max_tokens, "stream": stream, "ignore_eos": True,
            "messages": [{"role": "system", "content": f"Chaos drill {i}. " + "Stack stones. " * 20},
                         {"role": "user", "content": "How tall should a cairn be?"}]}


def replicas(handle) -> set[str]:
    return {worker for worker, _, _ in handle.broadcast("cache_contents").results(timeout_s=30)}


def index_holds_every_replica(handle) -> bool:
    index = ray.get_actor(INDEX, namespace="cairn")
    held = {w: (p, s) for w, p, s in handle.broadcast("cache_contents").results(timeout_s=30)}
    known = {w: ray.get(index.contents.remote(w), timeout=30) for w in held}
    return all(known[w] is not None and tuple(known[w]) == held[w] for w in held) and \
        set(ray.get(index.workers.remote(), timeout=30)) == set(held)


def ttft(client: httpx.Client, headers: dict, prompt_body: dict) -> tuple[float, int]:
    """(seconds to the first streamed token, cached_tokens) of one streamed chat."""
    start, first, cached = time.monotonic(), None, None
    with client.stream("POST", "/v1/chat/completions", headers=headers,
                       json=dict(prompt_body, stream=True, stream_options={"include_usage": True})) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if first is None and event["choices"] and event["choices"][0]["delta"]:
                first = time.monotonic() - start
            if event.get("usage"):
                cached = event["usage"]["prompt_tokens_details"]["cached_tokens"]
    return first, cached


def long_chat() -> dict:
    """A chat of about 600 tokens no one has sent before: its text opens with a random token string,
    so a prober's own earlier probes share with it only the system role header."""
    tag = uuid.uuid4().hex
    return {"model": MODEL, "max_tokens": 2, "ignore_eos": True,
            "messages": [{"role": "system", "content": f"{tag} ledger. " + "The cairn on the ridge stands. " * 70},
                         {"role": "user", "content": f"What does ledger {tag[:6]} say?"}]}


def test_tenant_b_cannot_learn_what_tenant_a_sent_by_cached_tokens_or_timing(app, tiny_model_dir):
    url, handle = app
    own, probe_hit, probe_fresh, bobs, bound = [], [], [], [], []
    with httpx.Client(base_url=url, timeout=60) as client:
        for _ in range(5):
            secret, fresh = long_chat(), long_chat()
            ttft(client, ALICE, secret)  # alice sends it: her replica caches it
            own.append(ttft(client, ALICE, secret))  # and her next send hits
            bound.append(shared_prefix(tiny_model_dir, secret["messages"], bobs))  # what bob's own share with it
            probe_hit.append(ttft(client, BOB, secret))  # bob probes with alice's prompt...
            probe_fresh.append(ttft(client, BOB, fresh))  # ...and with one nobody sent
            bobs += [secret["messages"], fresh["messages"]]
    assert all(cached > 0 for _, cached in own), f"alice's own prompt must hit her cache: {own}"
    # bob resumes alice's prompt no deeper than his own earlier prompts share with it (a role header,
    # a hex digit of a random tag), far short of alice's own resend
    assert all(hit <= limit for (_, hit), limit in zip(probe_hit, bound)), \
        f"bob learned alice's prompt from cached_tokens: {probe_hit}, his own prompts share {bound}"
    assert max(cached for _, cached in probe_hit) < min(cached for _, cached in own) // 8, (probe_hit, own)
    hit_s = sorted(t for t, _ in probe_hit)[2]
    fresh_s = sorted(t for t, _ in probe_fresh)[2]
    own_s = sorted(t for t, _ in own)[2]
    # a hit would answer like alice's own resend; bob's probe answers like a cold prompt
    assert hit_s > 0.5 * fresh_s, f"bob's probe of alice's prompt was fast: {hit_s:.3f}s vs cold {fresh_s:.3f}s"
    print(f"tenancy probe: alice's resend {own_s * 1e3:.0f} ms; bob's probe {hit_s * 1e3:.0f} ms vs cold "
          f"{fresh_s * 1e3:.0f} ms (medians of 5)")


def test_the_index_holds_nothing_under_another_tenants_hashes(app, tiny_model_dir):
    """The router scores a prompt by its page hashes, which the ingress roots in the tenant: the
    index (what every router mirrors) has alice's pages only under alice's chain."""
    from tokenizers import Tokenizer

    from cairn.cluster.api.chat_template import ChatTemplate
    from cairn.workers import EngineSpec

    url, _ = app
    chat = long_chat()
    with httpx.Client(base_url=url, timeout=60) as client:
        assert client.post("/v1/chat/completions", json=chat, headers=ALICE).status_code == 200
    spec = EngineSpec.from_model_dir(tiny_model_dir)  # the app's engines: default options
    text = ChatTemplate.from_dir(tiny_model_dir).render(chat["messages"])
    ids = Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json")).encode(text, add_special_tokens=False).ids
    index = ray.get_actor(INDEX, namespace="cairn")

    def scores(tenant: str) -> dict:
        return ray.get(index.score.remote(spec.page_hashes(ids, spec.hash_root(None, tenant))), timeout=30)

    deadline = time.monotonic() + 20
    while not scores("alice"):
        assert time.monotonic() < deadline, "alice's pages never reached the index"
        time.sleep(0.2)
    assert scores("bob") == {} and scores(None) == {}, "the index scores another chain of alice's prompt"


def test_a_replica_killed_mid_stream_ends_its_stream_with_an_error_event_and_nothing_hangs(app):
    url, handle = app
    with httpx.Client(base_url=url, timeout=httpx.Timeout(30), headers=ALICE) as client:
        started = time.monotonic()
        events = []
        with client.stream("POST", "/v1/chat/completions", json=body(1, max_tokens=1500, stream=True)) as r:
            assert r.status_code == 200
            victim = r.headers[REPLICA_HEADER]
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                events.append(line[6:])
                if len(events) == 3:  # streaming: kill the replica that serves it
                    ray.kill(ray.get_actor(victim, namespace="serve"), no_restart=True)
                    killed = time.monotonic()
        assert time.monotonic() - killed < 20, "the stream did not end soon after its replica died"
        assert events[-1] == "[DONE]"
        error = json.loads(events[-2])  # retryable: Serve routes a retry to a live replica
        assert error["error"]["code"] == "engine_unavailable" and "Traceback" not in events[-2], error
        assert time.monotonic() - started < 60
        # The next requests succeed: the other replica serves until Serve replaces the dead one.
        for i in range(4):
            r = client.post("/v1/chat/completions", json=body(10 + i))
            assert r.status_code == 200, r.text
            assert r.headers[REPLICA_HEADER] != victim
    deadline = time.monotonic() + 60
    while len(now := replicas(handle)) < 2 or victim in now:
        assert time.monotonic() < deadline, "Serve never replaced the killed replica"
        time.sleep(0.5)


def test_redis_down_under_load_costs_no_request_and_the_index_is_rebuilt_when_it_returns(app, redis_server):
    url, handle = app
    results, stop = [], threading.Event()

    def load(k: int) -> None:
        with httpx.Client(base_url=url, timeout=60, headers=ALICE) as client:
            i = 0
            while not stop.is_set():
                i += 1
                r = client.post("/v1/chat/completions", json=body(100 * k + i % 5))
                results.append((time.monotonic(), r.status_code))

    threads = [threading.Thread(target=load, args=(k,), daemon=True) for k in range(3)]
    for t in threads:
        t.start()
    time.sleep(2)
    redis_server.kill()
    down = time.monotonic()
    time.sleep(6)  # past the router's staleness: routing by load and memory
    redis_server.start()  # back, empty
    back = time.monotonic()
    time.sleep(2)
    stop.set()
    for t in threads:
        t.join(timeout=90)
    assert results and all(status == 200 for _, status in results), [s for _, s in results if s != 200]
    assert sum(down < at < back for at, _ in results) >= 3, "requests were served while Redis was down"
    deadline = time.monotonic() + 60
    while not index_holds_every_replica(handle):  # the replicas resync into the empty store
        assert time.monotonic() < deadline, "the index was not rebuilt after Redis came back"
        time.sleep(0.5)
