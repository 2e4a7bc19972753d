"""GET /metrics (`cairn.cluster.api.api_metrics`) through prometheus_client's own parser: the families the
README and dashboards name, with their types and labels, counted right for real requests; the
inter-token latency histogram counts every token after a request's first; two apps in one
process never mix; engine and router keys map to `cairn_engine_*` and `cairn_router_*`."""

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from cairn.cluster.api import APIOptions, build_app
from cairn.cluster.api.engine_client import LocalEngineClient
from cairn.cluster.api.api_metrics import engine_families
from cairn.cluster.api.server import BackgroundServer
from cairn.workers import EngineFront
from cairn.workers.engine_metrics import EngineMetrics

MODEL = "tiny"
MESSAGES = [{"role": "user", "content": "Count the stones in the old wall by the river, twice. " * 3}]


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    return EngineFront.from_pretrained(tiny_model_dir, num_pages=512, max_num_seqs=8)


def scrape(url: str) -> dict:
    r = httpx.get(url + "/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain; version=0.0.4")
    return {f.name: f for f in text_string_to_metric_families(r.text)}


def value(families: dict, sample: str, **labels) -> float:
    for family in families.values():
        for s in family.samples:
            if s.name == sample and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
    raise KeyError(f"{sample} {labels}")


def test_metrics_parse_and_count_requests_tokens_and_latencies(tiny_model_dir, engine):
    with BackgroundServer(build_app(LocalEngineClient(engine), tiny_model_dir,
                                    APIOptions(served_model_name=MODEL))) as s:
        client = openai.OpenAI(base_url=s.url + "/v1", api_key="none", max_retries=0, timeout=60)
        for _ in range(2):
            client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=12, temperature=0,
                                           extra_body={"ignore_eos": True})
        stream = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=12, temperature=0,
                                                stream=True, extra_body={"ignore_eos": True})
        assert sum(1 for _ in stream) > 1
        assert httpx.post(s.url + "/v1/chat/completions", content=b"{").status_code == 400
        families = scrape(s.url)

    types = {name: f.type for name, f in families.items()}
    assert types["cairn_requests"] == types["cairn_prompt_tokens"] == types["cairn_cached_tokens"] == "counter"
    assert types["cairn_time_to_first_token_seconds"] == types["cairn_inter_token_latency_seconds"] == \
        types["cairn_e2e_request_latency_seconds"] == "histogram"
    assert types["cairn_prefix_hit_ratio"] == types["cairn_engine_pages_held"] == "gauge"
    assert value(families, "cairn_requests_total", endpoint="/v1/chat/completions", status="200") == 3
    assert value(families, "cairn_requests_total", endpoint="/v1/chat/completions", status="400") == 1
    assert value(families, "cairn_request_errors_total", status="400") == 1
    assert value(families, "cairn_time_to_first_token_seconds_count") == 3
    assert value(families, "cairn_e2e_request_latency_seconds_count") == 3
    assert value(families, "cairn_inter_token_latency_seconds_count") == 3 * 11, "every token after the first"
    assert value(families, "cairn_generated_tokens_total") == 36
    prompt, cached = value(families, "cairn_prompt_tokens_total"), value(families, "cairn_cached_tokens_total")
    assert cached > 0 and value(families, "cairn_prefix_hit_ratio") == pytest.approx(cached / prompt)
    assert value(families, "cairn_engine_checkpoints_admitted_total", kind="tail") >= 1
    assert families["cairn_engine_checkpoints_admitted"].type == "counter"


def test_two_apps_in_one_process_count_apart(tiny_model_dir, engine):
    with BackgroundServer(build_app(LocalEngineClient(engine), tiny_model_dir,
                                    APIOptions(served_model_name=MODEL))) as a, \
            BackgroundServer(build_app(LocalEngineClient(engine), tiny_model_dir,
                                       APIOptions(served_model_name=MODEL))) as b:
        for _ in range(3):
            assert httpx.get(a.url + "/health").status_code == 200
        assert value(scrape(a.url), "cairn_requests_total", endpoint="/health", status="200") == 3
        with pytest.raises(KeyError):
            value(scrape(b.url), "cairn_requests_total", endpoint="/health")


def test_engine_and_router_keys_become_families_of_their_own():
    engine = EngineMetrics(pages_held=3, pages_evicted_total=7, checkpoint_hits_total={"tail": 2, "hint": 1},
                           worker_id="replica-1")
    families = {f.name: f for f in engine_families(engine, {"router_index_fallbacks_total": 4,
                                                            "router_index_mirror_pages": 9})}
    assert families["cairn_engine_pages_held"].type == "gauge"
    assert families["cairn_engine_pages_evicted"].type == "counter"
    assert {s.labels["kind"]: s.value for s in families["cairn_engine_checkpoint_hits"].samples} == \
        {"tail": 2, "hint": 1}
    assert families["cairn_router_index_fallbacks"].samples[0].name == "cairn_router_index_fallbacks_total"
    assert families["cairn_router_index_mirror_pages"].type == "gauge"
    assert families["cairn_engine_info"].samples[0].labels == {"worker_id": "replica-1"}
    assert "cairn_engine_host_copy_bytes_per_s" not in families, "a rate not yet measured is not reported as 0"
