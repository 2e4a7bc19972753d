"""Move and fetch on a real local Ray (routing `fetch: true`): under load, requests sharing a hot
prompt spread over the replicas, and those landing away from its holder pull the resume point
from it and resume there, computing what a cold request computes; another cache salt fetches
nothing. Through the official openai client and Serve's proxy."""

import os
import uuid

import pytest

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
ray = pytest.importorskip("ray")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from tests.support.chat import open_chat_stream  # noqa: E402
from tests.support.ray_checks import free_port, mirrors_agree, wait_until  # noqa: E402

from cairn.cluster.app import build_application  # noqa: E402
from cairn.cluster.ingress import REPLICA_HEADER  # noqa: E402
from cairn.cluster.routing.routing_config import RoutingConfig  # noqa: E402

MODEL = "tiny"
INDEX = f"cairn-fetch-index-{uuid.uuid4().hex[:6]}"
# staleness: a feed answer slowed by a busy 2-core machine must not turn routing to load alone mid-test
ROUTING = RoutingConfig(index_actor_name=INDEX, spill_limit=2, fetch=True, index_staleness_s=30.0)
HOT = "You are the shared assistant of the cairn club; answer briefly about stone piles. " * 60


@pytest.fixture(scope="module")
def app(ray_session, tiny_model_dir):
    from ray import serve

    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(build_application(tiny_model_dir, replicas=2, num_cpus=0.25, routing=ROUTING,
                                api=dict(served_model_name=MODEL)),
              name="cairn-fetch", route_prefix="/")
    yield (f"http://127.0.0.1:{port}", serve.get_deployment_handle("Engine", app_name="cairn-fetch"),
           serve.get_deployment_handle("Ingress", app_name="cairn-fetch"))
    serve.shutdown()
    ray.kill(ray.get_actor(INDEX, namespace=ROUTING.index_actor_namespace), no_restart=True)


def ask(client, content: str, salt: str | None = None):
    extra = {"cache_salt": salt} if salt else None
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, temperature=0, max_tokens=8, extra_body=extra,
        messages=[{"role": "system", "content": HOT}, {"role": "user", "content": content}])
    completion = raw.parse()
    return completion, raw.headers.get(REPLICA_HEADER)


def test_load_spreads_a_hot_prompt_over_replicas_which_fetch_its_resume_point_and_compute_what_cold_computes(app):
    url, engine, ingress = app
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)
    _, holder = ask(client, "warm up")
    index = ray.get_actor(INDEX, namespace=ROUTING.index_actor_namespace)
    replicas = [w for w, _, _ in engine.broadcast("cache_contents").results(timeout_s=30)]
    wait_until(lambda: mirrors_agree(ingress, index, replicas), 30, "the ingress's mirror holds the warm-up", 0.2)
    streams, http, placed = [], httpx.Client(base_url=url, timeout=60), []
    try:
        for i in range(2 * ROUTING.spill_limit):  # long streams in flight: load the router balances
            response = open_chat_stream(http, MODEL, [{"role": "system", "content": HOT},
                                                      {"role": "user", "content": f"busy {i}"}])
            streams.append(response)
            assert response.status_code == 200
            placed.append(response.headers[REPLICA_HEADER])
        got, receiver = ask(client, "How tall should a cairn be?")
        cached = got.usage.prompt_tokens_details.cached_tokens
        assert cached >= got.usage.prompt_tokens - 48, "it resumed at the shared prompt, wherever it ran"
        other, _ = ask(client, "How tall should a cairn be?", salt="another-tenant")
        assert other.usage.prompt_tokens_details.cached_tokens == 0, "a fetch never crosses a cache salt"
        assert other.choices[0].message.content == got.choices[0].message.content, "resumed == cold"
    finally:
        for response in streams:
            response.close()
        http.close()
    assert set(placed + [receiver]) - {holder}, f"the load spread past the holder: {placed}"
    metrics = {m.worker_id: m for m in engine.broadcast("metrics").results(timeout_s=30)}
    others = [w for w in metrics if w != holder]
    assert sum(metrics[w].fetches_total for w in others) >= 1
    assert sum(metrics[w].fetched_pages_total for w in others) > 0
    assert metrics[holder].exported_bytes_total > 0
    assert not any(m.fetch_fallbacks_total for m in metrics.values()), "no fetch fell back"
