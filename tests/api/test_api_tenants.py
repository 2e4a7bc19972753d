"""Tenants at the API edge (`cairn.cluster.api.tenants`): each API key names a tenant, and a tenant's
pages are rooted in its id, so two tenants never share a cached page unless the server is told
to share; keys come from flags, a keys file or CAIRN_API_KEY and never show up in a message or a
log; /metrics and /openapi.json need a key (the metrics key, when set, for /metrics), /health
never does."""

import logging

import httpx
import openai
import pytest

from cairn.cluster.api import APIOptions, build_app
from cairn.cluster.api.engine_client import LocalEngineClient
from cairn.cluster.api.server import BackgroundServer
from cairn.cluster.api.tenants import Tenants, bare_tenant_id, read_keys_file
from cairn.workers import EngineFront
from tests.support.fake_clients import OneTokenClient

MODEL = "tiny"
KEYS = ["alice:key-a", "bob:key-b", "bob:key-b2", "carol:key-c"]
MESSAGES = [{"role": "user", "content": "Which stones last longest in a cairn on a windy ridge? " * 4}]


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    return EngineFront.from_pretrained(tiny_model_dir, num_pages=512, max_num_seqs=8)


@pytest.fixture(scope="module")
def servers(tiny_model_dir, engine):
    client = LocalEngineClient(engine)
    apart = build_app(client, tiny_model_dir, APIOptions(served_model_name=MODEL), tenants=Tenants.load(KEYS))
    shared = build_app(client, tiny_model_dir, APIOptions(served_model_name=MODEL, shared_cache_tenants=True),
                       tenants=Tenants.load(KEYS))
    operated = build_app(client, tiny_model_dir, APIOptions(served_model_name=MODEL), tenants=Tenants.load(KEYS),
                         metrics_key="ops-key")
    with BackgroundServer(apart) as a, BackgroundServer(shared) as s, BackgroundServer(operated) as o:
        yield a, s, o


def cached(server, key: str, salt: str) -> int:
    c = openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0, timeout=60)
    out = c.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2, temperature=0,
                                    extra_body={"ignore_eos": True, "cache_salt": salt})
    return out.usage.prompt_tokens_details.cached_tokens


def test_each_key_is_its_tenant_and_tenants_never_share_a_cached_page(servers):
    apart, _, _ = servers
    assert cached(apart, "key-a", "apart") == 0
    assert cached(apart, "key-b", "apart") == 0, "the same prompt from another tenant: nothing shared"
    assert cached(apart, "key-a", "apart") > 0, "its own pages: a hit"
    assert cached(apart, "key-b2", "apart") > 0, "bob's second key is bob"


def test_shared_cache_tenants_roots_every_tenant_together(servers):
    _, shared, _ = servers
    assert cached(shared, "key-a", "shared") == 0
    assert cached(shared, "key-b", "shared") > 0, "deliberate sharing: bob hits alice's pages"


def test_a_wrong_or_missing_key_is_401_and_health_stays_open(servers):
    apart, _, _ = servers
    for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": "Basic key-a"}):
        r = httpx.get(apart.url + "/v1/models", headers=headers)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(apart.url + "/health").status_code == 200


def test_metrics_and_openapi_need_a_tenants_key(servers):
    apart, _, _ = servers
    for path in ("/metrics", "/openapi.json"):
        assert httpx.get(apart.url + path).status_code == 401, path
        assert httpx.get(apart.url + path, headers={"Authorization": "Bearer nope"}).status_code == 401, path
        assert httpx.get(apart.url + path, headers={"Authorization": "Bearer key-b"}).status_code == 200, path
    schema = httpx.get(apart.url + "/openapi.json", headers={"Authorization": "Bearer key-a"}).json()
    assert "/v1/chat/completions" in schema["paths"]


def test_a_metrics_key_is_the_only_key_to_metrics_and_also_opens_openapi(servers):
    _, _, operated = servers
    ops, tenant = {"Authorization": "Bearer ops-key"}, {"Authorization": "Bearer key-a"}
    assert httpx.get(operated.url + "/metrics", headers=tenant).status_code == 401, "tenants don't see each other"
    r = httpx.get(operated.url + "/metrics", headers=ops)
    assert r.status_code == 200 and "cairn_requests_total" in r.text
    assert httpx.get(operated.url + "/openapi.json", headers=ops).status_code == 200
    assert httpx.get(operated.url + "/openapi.json", headers=tenant).status_code == 200
    assert httpx.get(operated.url + "/v1/models", headers=ops).status_code == 401, "the metrics key is no tenant"


def test_without_keys_everything_is_open(tiny_model_dir, engine, monkeypatch):
    monkeypatch.delenv("CAIRN_API_KEY", raising=False)
    with BackgroundServer(build_app(LocalEngineClient(engine), tiny_model_dir,
                                    APIOptions(served_model_name=MODEL))) as s:
        for path in ("/metrics", "/openapi.json", "/v1/models", "/health"):
            assert httpx.get(s.url + path).status_code == 200, path


def test_cairn_api_key_is_one_key_of_the_tenant_default_even_with_a_colon(tiny_model_dir, engine, monkeypatch):
    from fastapi.testclient import TestClient

    monkeypatch.setenv("CAIRN_API_KEY", "env:key")
    assert Tenants.load().tenant_of("env:key") == "default"
    with TestClient(build_app(LocalEngineClient(engine), tiny_model_dir, APIOptions(served_model_name=MODEL))) as c:
        assert c.get("/v1/models").status_code == 401
        assert c.get("/v1/models", headers={"Authorization": "Bearer env:key"}).status_code == 200
    assert Tenants.load(["x:y"]).tenant_of("env:key") is None, "keys given otherwise replace the environment's"


def test_keys_come_from_values_a_keys_file_with_limits_and_digests(tmp_path):
    path = tmp_path / "keys"
    path.write_text("# tenant:key [limits]\nalice:a-1 requests_per_minute=60  tokens_per_minute=9000\n\n"
                    "  bob : b:with:colons  \ncarol:c-1\n")
    assert read_keys_file(path) == [("alice", "a-1", {"requests_per_minute": 60, "tokens_per_minute": 9000}),
                                    ("bob", "b:with:colons", {}), ("carol", "c-1", {})]
    tenants = Tenants.load(["bare-key", "dave:d-1"], keys_file=path)
    bare = bare_tenant_id("bare-key")
    assert {tenants.tenant_of(k) for k in ("bare-key", "dave:d-1", "d-1", "a-1", "b:with:colons")} == \
        {bare, None, "dave", "alice", "bob"}
    assert tenants.ids == {bare, "dave", "alice", "bob", "carol"}
    assert tenants.limits == {"alice": {"requests_per_minute": 60, "tokens_per_minute": 9000}}
    travelled = Tenants.load(api_key_digests=tenants.digests())  # how keys cross Ray Serve's logged arguments
    assert [travelled.tenant_of(k) for k in ("bare-key", "d-1", "a-1", "b:with:colons", "c-1", "nope")] == \
        [bare, "dave", "alice", "bob", "carol", None]
    assert not any(k in d for d in tenants.digests() for k in ("bare-key", "d-1", "a-1", "c-1"))


def test_each_bare_key_is_a_tenant_of_its_own_named_without_the_key(tiny_model_dir, engine):
    """`--api-key K1 --api-key K2`: two tenants, which share no cache, and neither id shows its key."""
    tenants = Tenants.load(["first-secret-key", "second-secret-key"])
    assert len(tenants.ids) == 2 and not any("secret" in t for t in tenants.ids)
    assert all(t.startswith("key-") and len(t) == 16 for t in tenants.ids)
    assert bare_tenant_id("first-secret-key") == bare_tenant_id("first-secret-key"), "stable across restarts"
    with BackgroundServer(build_app(LocalEngineClient(engine), tiny_model_dir, APIOptions(served_model_name=MODEL),
                                    tenants=tenants)) as s:
        assert cached(s, "first-secret-key", "bare") == 0
        assert cached(s, "second-secret-key", "bare") == 0, "the other bare key is another tenant"
        assert cached(s, "first-secret-key", "bare") > 0


def test_bad_keys_are_refused_naming_the_place_never_the_key(tmp_path):
    path = tmp_path / "keys"
    path.write_text("alice:secret-a\nno-colon-secret\n")
    with pytest.raises(ValueError, match=r"keys:2: expected TENANT:KEY") as e:
        read_keys_file(path)
    assert "no-colon-secret" not in str(e.value)
    for line in ("alice:secret-a rpm=5", "alice:secret-a requests_per_minute=five", "alice:secret a"):
        path.write_text(line + "\n")
        with pytest.raises(ValueError, match=r"keys:1: after TENANT:KEY, expected limits NAME=VALUE") as e:
            read_keys_file(path)
        assert "secret" not in str(e.value)
    for pairs, where in (([("alice", "secret-x"), ("bob", "secret-x")], "the same key is given to tenants"),
                         ([("al ice", "secret-y")], "tenant id"), ([("alice", " secret-z")], "whitespace")):
        with pytest.raises(ValueError, match=where) as e:
            Tenants(pairs)
        assert "secret" not in str(e.value)
    assert "secret" not in repr(Tenants([("alice", "secret-a")]))


def test_a_refused_key_is_never_logged(servers, caplog):
    apart, _, _ = servers
    with caplog.at_level(logging.DEBUG):
        httpx.get(apart.url + "/v1/models", headers={"Authorization": "Bearer guess-4711"})
        httpx.get(apart.url + "/v1/models", headers={"Authorization": "Bearer key-a"})
    assert not any("guess-4711" in r.getMessage() or "key-a" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("shared", [False, True])
def test_the_tenant_roots_the_page_hashes_the_engine_receives(tiny_model_dir, shared):
    from fastapi.testclient import TestClient

    fake = OneTokenClient(max_model_len=4096)
    app = build_app(fake, tiny_model_dir, APIOptions(served_model_name=MODEL, shared_cache_tenants=shared),
                    tenants=Tenants.load(KEYS))
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 1, "cache_salt": "s"}
    with TestClient(app) as c:
        for key in ("key-a", "key-b"):
            assert c.post("/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"}).status_code == 200
    alice, bob = fake.requests
    if shared:
        assert alice.hash_root == bob.hash_root == fake.spec.hash_root("s", None)
    else:
        assert (alice.hash_root, bob.hash_root) == (fake.spec.hash_root("s", "alice"), fake.spec.hash_root("s", "bob"))
        assert alice.page_hashes and not set(alice.page_hashes) & set(bob.page_hashes)


PUBLIC = "You are the trail guide of the Ridge Cairn Society. Answer about stones, weather and paths. " * 6


def test_a_public_system_prompt_is_shared_by_every_tenant_and_nothing_after_it_is(tiny_model_dir, engine):
    """With `public_system_prompts`, the whole pages of that system message are hashed under the
    shared root: bob's chat opening with it resumes from alice's pages of it, but not one token
    further, even where his next words are alice's; another system prompt shares nothing."""
    app = build_app(LocalEngineClient(engine), tiny_model_dir,
                    APIOptions(served_model_name=MODEL, public_system_prompts=[PUBLIC]), tenants=Tenants.load(KEYS))
    spec = engine.spec

    def chat(server, key, system, user, salt=None):
        c = openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0, timeout=60)
        out = c.chat.completions.create(
            model=MODEL, max_tokens=2, temperature=0,
            messages=[{"role": "system", "content": system}, {"role": "user", "content": user}],
            extra_body={"ignore_eos": True, **({"cache_salt": salt} if salt else {})})
        return out.usage.prompt_tokens_details.cached_tokens, out.usage.prompt_tokens

    with BackgroundServer(app) as server:
        question = "Which stones last longest in a cairn on a windy ridge? " * 3
        assert chat(server, "key-a", PUBLIC, question)[0] == 0
        bob, n = chat(server, "key-b", PUBLIC, question)  # alice's very prompt, from bob
        as_parts = [{"type": "text", "text": PUBLIC[:40]}, {"type": "text", "text": PUBLIC[40:]}]
        assert chat(server, "key-c", as_parts, question) == (bob, n), \
            "the public prompt sent as text parts (the SDK's shape) is shared like the string"
        public_pages = len(app.state.serving.prompts.tokenizer.encode(
            app.state.serving.prompts.template.render([{"role": "system", "content": PUBLIC}],
                                                      add_generation_prompt=False))) // spec.page_size
        assert public_pages >= 2 and 0 < bob <= public_pages * spec.page_size < n, \
            f"bob resumed from the public pages and no further ({bob} of {n} tokens)"
        assert chat(server, "key-a", PUBLIC, question)[0] > public_pages * spec.page_size, "alice: all of hers"
        private = "Alice's own assistant, you are. " * 12
        header = len(app.state.serving.prompts.tokenizer.encode("<|im_start|>system\n"))
        assert chat(server, "key-a", private, question)[0] == header, \
            "alice's new conversation shares her earlier ones' role header (a state keyed by her root), no more"
        assert chat(server, "key-b", private, question)[0] == 0, "a system prompt not made public is not shared"
        assert chat(server, "key-b", PUBLIC, "And in the rain? " * 3, salt="mine")[0] == 0, \
            "a salted chat shares nothing, the public prompt included"
