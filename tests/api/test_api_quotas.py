"""Tenant quotas (`cairn.cluster.api.quotas`): what each tenant may hold of a shared endpoint. A tenant
over a limit gets a 429 in OpenAI's shape with Retry-After, and nothing else changes: another
tenant is served at once, the same tenant again once it has room. One request may not make more
engine requests than `max_engine_requests` (413). Every outcome is counted by tenant id, never
by key. Without keys there are no quotas. The engine's own sharing of sequence slots is
tests/workers/test_scheduler_fairness.py's."""

import asyncio
import threading

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from cairn.cluster.api import APILimits, APIOptions, build_app
from cairn.cluster.api.api_errors import APIError
from cairn.cluster.api.quotas import TenantLimits, TenantQuotas
from cairn.cluster.api.server import BackgroundServer
from cairn.cluster.api.tenants import Tenants
from tests.support.fake_clients import OneTokenClient

MODEL = "tiny"
KEYS = ["alice:key-a", "bob:key-b"]
C, P = "/v1/chat/completions", "/v1/completions"


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def refused(fn, *args):
    with pytest.raises(APIError) as e:
        fn(*args)
    return e.value


def test_requests_in_flight_and_waiting_are_bounded_per_tenant_and_come_back_as_they_end():
    quotas = TenantQuotas(TenantLimits(max_requests=4, max_waiting=3))
    first = quotas.admit("alice", 3, 10)
    e = refused(quotas.admit, "alice", 1, 10)
    assert e.status == 429 and e.code == "rate_limit_exceeded" and e.headers == {"Retry-After": "1"}
    assert "max_waiting" in e.message and "alice" in e.message
    assert quotas.admit("bob", 3, 10), "another tenant has room of its own"
    first.started(0)
    first.started(0)  # repeated: counted once
    second = quotas.admit("alice", 1, 10)
    assert quotas.held("alice") == (4, 3)
    assert "max_requests" in refused(quotas.admit, "alice", 1, 10).message
    first.ended(0)
    first.close()  # the two that never started end too
    assert quotas.held("alice") == (1, 1)
    second.ended(0)
    assert quotas.held("alice") == (0, 0)
    never = refused(quotas.admit, "alice", 5, 10)
    assert never.status == 429 and never.headers is None, "more than the limit itself: retrying cannot help"


def test_rate_limits_are_token_buckets_that_say_when_to_retry():
    clock = Clock()
    quotas = TenantQuotas(TenantLimits(requests_per_minute=2, tokens_per_minute=600), clock=clock)
    quotas.admit("alice", 1, 100).close()
    quotas.admit("alice", 1, 100).close()
    e = refused(quotas.admit, "alice", 1, 100)
    assert "requests_per_minute" in e.message and e.headers == {"Retry-After": "30"}, "a request comes back in 30 s"
    clock.now += 30
    quotas.admit("alice", 1, 100).close()
    quotas.charge_tokens("alice", 600)  # generated tokens overdraw the bucket: full again, 600 - 100 - 600 = -100
    clock.now += 30  # + 300: 200, and 250 are asked
    e = refused(quotas.admit, "alice", 1, 250)
    assert "tokens_per_minute" in e.message and e.headers == {"Retry-After": "5"}, e.message
    clock.now += 5
    quotas.admit("alice", 1, 250).close()
    assert refused(quotas.admit, "alice", 1, 601).headers is None, "more tokens than a whole minute's"
    assert quotas.admit("bob", 1, 600), "bob's buckets are his own"


def test_a_tenants_limits_from_the_keys_file_replace_the_defaults(tmp_path):
    keys = tmp_path / "keys"
    keys.write_text("alice:key-a max_requests=1\nbob:key-b\n")
    tenants = Tenants.load(keys_file=keys)
    defaults = TenantLimits(max_requests=3)
    quotas = TenantQuotas(defaults, {t: defaults.merged(v) for t, v in tenants.limits.items()})
    quotas.admit("alice", 1, 1)
    refused(quotas.admit, "alice", 1, 1)
    quotas.admit("bob", 3, 1)


class HeldClient(OneTokenClient):
    """Answers each request's first token at once and its last only when `release` is set."""

    def __init__(self):
        super().__init__()
        self.release = threading.Event()

    async def generate(self, request):
        from cairn.workers import RequestOutput

        self.requests.append(request)
        yield RequestOutput(request.request_id, [5], None, 1, 0, queue_s=0.25)
        while not self.release.is_set():
            await asyncio.sleep(0.01)
        yield RequestOutput(request.request_id, [6], None, 2, 0, token_ids=[5, 6], finish_reason="length")


def metric(text: str, name: str) -> dict:
    return {tuple(sorted(s.labels.items())): s.value for f in text_string_to_metric_families(text)
            for s in f.samples if s.name == name}


def test_a_tenant_over_its_quota_gets_a_429_and_the_other_tenant_is_served(tiny_model_dir):
    client = HeldClient()
    app = build_app(client, tiny_model_dir,
                    APIOptions(served_model_name=MODEL, tenant_limits=TenantLimits(max_requests=4),
                               api_limits=APILimits(max_engine_requests=8)),
                    tenants=Tenants.load(KEYS), metrics_key="ops")
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "stream": True}
    alice, bob = ({"Authorization": f"Bearer {k}"} for k in ("key-a", "key-b"))
    with BackgroundServer(app) as server, httpx.Client(base_url=server.url, timeout=30) as http:
        held = [http.send(http.build_request("POST", C, json={**body, "n": 2}, headers=alice), stream=True)
                for _ in range(2)]
        assert all(r.status_code == 200 for r in held)
        r = http.post(C, json=body, headers=alice)
        assert r.status_code == 429 and r.headers["retry-after"] == "1"
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}
        assert r.json()["error"]["code"] == "rate_limit_exceeded" and r.json()["error"]["type"] == "rate_limit_error"
        r = http.post(P, json={"model": MODEL, "prompt": ["a", "b", "c"], "n": 3, "max_tokens": 2}, headers=bob)
        assert r.status_code == 413 and r.json()["error"]["param"] == "prompt", "9 engine requests, 8 allowed"
        assert "max_engine_requests" in r.json()["error"]["message"]
        with http.stream("POST", C, json=body, headers=bob) as r:
            assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
            client.release.set()
            assert r.read().rstrip().endswith(b"data: [DONE]"), "bob is served while alice is held"
        for r in held:
            assert r.read().rstrip().endswith(b"data: [DONE]")
            r.close()
        assert http.post(C, json={**body, "stream": False}, headers=alice).status_code == 200, "alice has room again"
        text = http.get("/metrics", headers={"Authorization": "Bearer ops"}).text
    assert metric(text, "cairn_tenant_rejections_total") == {
        (("limit", "max_requests"), ("tenant", "alice")): 1.0, (("limit", "limit_exceeded"), ("tenant", "bob")): 1.0}
    assert metric(text, "cairn_tenant_requests_total") == {(("tenant", "alice"),): 3.0, (("tenant", "bob"),): 1.0}
    tokens = metric(text, "cairn_tenant_tokens_total")
    assert tokens[(("kind", "generated"), ("tenant", "alice"))] == 10.0 and tokens[(("kind", "generated"),
                                                                                     ("tenant", "bob"))] == 2.0
    queued = metric(text, "cairn_tenant_queue_seconds_count")
    assert queued == {(("tenant", "alice"),): 5.0, (("tenant", "bob"),): 1.0}, "one per engine request"
    assert "key-a" not in text and "key-b" not in text


def test_without_keys_everyone_is_one_tenant_bounded_by_the_queue_alone(tiny_model_dir, monkeypatch):
    monkeypatch.delenv("CAIRN_API_KEY", raising=False)
    client = HeldClient()
    app = build_app(client, tiny_model_dir,
                    APIOptions(served_model_name=MODEL, tenant_limits=TenantLimits(max_requests=1)))
    assert app.state.serving.quotas is None
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "stream": True, "n": 3}
    with BackgroundServer(app) as server, httpx.Client(base_url=server.url, timeout=30) as http:
        with http.stream("POST", C, json=body) as first, http.stream("POST", C, json=body) as second:
            assert (first.status_code, second.status_code) == (200, 200)
            client.release.set()
            assert first.read().rstrip().endswith(b"data: [DONE]") and second.read().rstrip().endswith(b"[DONE]")
        text = http.get("/metrics").text
    assert metric(text, "cairn_tenant_requests_total") == {(("tenant", "default"),): 2.0}
