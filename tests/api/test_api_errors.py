"""Nothing a client sends breaks the server: a corpus of malformed and hostile requests gets the
documented status codes in OpenAI's error shape, each followed by a good request that succeeds;
a full queue is a 429, an internal fault a 500 that names only the request id; a client that
disconnects mid-stream gets its request aborted and its pages back."""

import asyncio
import json
import time

import httpx
import pytest

from cairn.cluster.api import APIOptions, build_app
from cairn.cluster.api.engine_client import LocalEngineClient
from cairn.cluster.api.server import BackgroundServer
from cairn.workers import EngineFront, EngineSpec
from cairn.workers.engine_metrics import EngineMetrics

MODEL, KEY = "tiny", "k3y"
AUTH = {"Authorization": f"Bearer {KEY}"}
LIMIT = 64 << 10  # body bytes
MSG = [{"role": "user", "content": "Hi"}]
GOOD_CHAT = {"model": MODEL, "messages": MSG, "max_tokens": 2}
GOOD_COMP = {"model": MODEL, "prompt": "Hi", "max_tokens": 2}


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    return EngineFront.from_pretrained(tiny_model_dir, num_pages=512, max_num_seqs=8)


@pytest.fixture(scope="module")
def server(tiny_model_dir, engine):
    app = build_app(LocalEngineClient(engine), tiny_model_dir,
                    APIOptions(served_model_name=MODEL, max_body_bytes=LIMIT), api_key=KEY)
    with BackgroundServer(app) as s:
        yield s


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


def chat(**fields):
    return dict(GOOD_CHAT, **fields)


def comp(**fields):
    return dict(GOOD_COMP, **fields)


def without(body, key):
    return {k: v for k, v in body.items() if k != key}


def chunked(data: bytes, size: int = 8192):
    for i in range(0, len(data), size):
        yield data[i:i + size]


C, P = "/v1/chat/completions", "/v1/completions"
CORPUS = [  # (name, path, body: dict | bytes | str | generator factory, headers, status, param)
    ("not json", C, b"{", None, 400, None),
    ("empty body", C, b"", None, 400, None),
    ("json null", C, b"null", None, 400, None),
    ("json array", C, b"[]", None, 400, None),
    ("json string", C, b'"hello"', None, 400, None),
    ("json number", C, b"123", None, 400, None),
    ("invalid utf-8", C, b'{"model": "\xff\xfe", "messages": []}', None, 400, None),
    ("truncated utf-8", C, b'{"model": "tiny", "messages": [{"role": "user", "content": "\xe6\x97"}]}', None,
     400, None),
    ("NaN literal", C, b'{"model": "tiny", "messages": [{"role": "user", "content": "x"}], "temperature": NaN}',
     None, 400, "temperature"),
    ("deep nesting", C, b'{"model": "tiny", "messages": ' + b"[" * 20000 + b"]" * 20000 + b"}", None, 400, None),
    ("lone surrogate", C, b'{"model": "tiny", "messages": [{"role": "user", "content": "\\ud800"}]}', None, 400,
     None),
    ("a 5000-digit number", C, b'{"model": "tiny", "messages": [{"role": "user", "content": "x"}], "seed": '
                               + b"9" * 5000 + b"}", None, 400, None),
    ("missing model", C, without(GOOD_CHAT, "model"), None, 400, "model"),
    ("missing messages", C, without(GOOD_CHAT, "messages"), None, 400, "messages"),
    ("empty messages", C, chat(messages=[]), None, 400, "messages"),
    ("messages not a list", C, chat(messages="hi"), None, 400, "messages"),
    ("message not an object", C, chat(messages=["hi"]), None, 400, "messages[0]"),
    ("unknown role", C, chat(messages=[{"role": "wizard", "content": "x"}]), None, 400, "messages[0].role"),
    ("missing role", C, chat(messages=[{"content": "x"}]), None, 400, "messages[0].role"),
    ("user without content", C, chat(messages=[{"role": "user"}]), None, 400, "messages[0]"),
    ("content a number", C, chat(messages=[{"role": "user", "content": 5}]), None, 400, "messages[0].content"),
    ("image part", C, chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]),
     None, 400, "messages[0].content"),
    ("temperature a string", C, chat(temperature="hot"), None, 400, "temperature"),
    ("temperature negative", C, chat(temperature=-1), None, 400, "temperature"),
    ("temperature too high", C, chat(temperature=3), None, 400, "temperature"),
    ("temperature infinite", C, b'{"model": "tiny", "messages": [{"role": "user", "content": "x"}], '
                                b'"temperature": 1e400}', None, 400, "temperature"),
    ("top_p zero", C, chat(top_p=0), None, 400, "top_p"),
    ("top_p above one", C, chat(top_p=1.5), None, 400, "top_p"),
    ("top_k negative", C, chat(top_k=-5), None, 400, "top_k"),
    ("max_tokens zero", C, chat(max_tokens=0), None, 400, "max_tokens"),
    ("max_tokens negative", C, chat(max_tokens=-1), None, 400, "max_tokens"),
    ("max_tokens huge", C, chat(max_tokens=10**30), None, 400, "max_tokens"),
    ("max_tokens fractional", C, chat(max_tokens=1.5), None, 400, "max_tokens"),
    ("max_tokens a string", C, chat(max_tokens="5"), None, 400, "max_tokens"),
    ("max_completion_tokens zero", C, chat(max_completion_tokens=0), None, 400, "max_completion_tokens"),
    ("n zero", C, chat(n=0), None, 400, "n"),
    ("n huge", C, chat(n=10**6), None, 400, "n"),
    ("seed negative", C, chat(seed=-1), None, 400, "seed"),
    ("seed past 2^63", C, chat(seed=2**64), None, 400, "seed"),
    ("seed a hundred digits", C, chat(seed=10**100), None, 400, "seed"),
    ("stop a number", C, chat(stop=5), None, 400, "stop"),
    ("too many stops", C, chat(stop=["x"] * 100), None, 400, "stop"),
    ("logprobs a string", C, chat(logprobs="yes"), None, 400, "logprobs"),
    ("top_logprobs too many", C, chat(logprobs=True, top_logprobs=21), None, 400, "top_logprobs"),
    ("top_logprobs without logprobs", C, chat(top_logprobs=2), None, 400, "top_logprobs"),
    ("presence penalty out of range", C, chat(presence_penalty=2.5), None, 400, "presence_penalty"),
    ("logit bias out of range", C, chat(logit_bias={"1": 150}), None, 400, "logit_bias"),
    ("unknown response format", C, chat(response_format={"type": "yaml"}), None, 400, "response_format.type"),
    ("forced tool call", C, chat(tool_choice="required"), None, 400, "tool_choice"),
    ("stream a string", C, chat(stream="yes"), None, 400, "stream"),
    ("include_usage a string", C, chat(stream=True, stream_options={"include_usage": "x"}), None, 400,
     "stream_options.include_usage"),
    ("cache_salt a number", C, chat(cache_salt=5), None, 400, "cache_salt"),
    ("stop token out of vocab", C, chat(stop_token_ids=[10**6]), None, 400, "stop_token_ids"),
    ("stop token negative", C, chat(stop_token_ids=[-1]), None, 400, "stop_token_ids"),
    ("template kwargs clash", C, chat(chat_template_kwargs={"messages": 1}), None, 400, "chat_template_kwargs"),
    ("continue a user message", C, chat(continue_final_message=True), None, 400, "continue_final_message"),
    ("prompt too long", C, chat(messages=[{"role": "user", "content": "stone " * 5000}]), None, 400, "messages"),
    ("unknown model", C, chat(model="gpt-4"), None, 404, "model"),
    ("body over the limit", C, chat(messages=[{"role": "user", "content": "x" * (2 * LIMIT)}]), None, 413, None),
    ("chunked body over the limit", C, lambda: chunked(json.dumps(chat(junk="y" * 4 * LIMIT)).encode()), None,
     413, None),
    ("no api key", C, GOOD_CHAT, {"Authorization": ""}, 401, None),
    ("wrong api key", C, GOOD_CHAT, {"Authorization": "Bearer nope"}, 401, None),
    ("basic auth", P, GOOD_COMP, {"Authorization": f"Basic {KEY}"}, 401, None),
    ("completion without prompt", P, without(GOOD_COMP, "prompt"), None, 400, "prompt"),
    ("completion empty prompt list", P, comp(prompt=[]), None, 400, "prompt"),
    ("completion empty prompt", P, comp(prompt=""), None, 400, "prompt"),
    ("completion token out of vocab", P, comp(prompt=[99999]), None, 400, "prompt"),
    ("completion negative token", P, comp(prompt=[-1]), None, 400, "prompt"),
    ("completion mixed prompt list", P, comp(prompt=["a", 1]), None, 400, "prompt"),
    ("completion logprobs too many", P, comp(logprobs=50), None, 400, "logprobs"),
    ("completion echo with logprobs", P, comp(echo=True, logprobs=1), None, 400, "echo"),
    ("completion suffix", P, comp(suffix="end"), None, 400, "suffix"),
    ("completion best_of", P, comp(best_of=3), None, 400, "best_of"),
    ("completion prompt too long", P, comp(prompt=list(range(1, 200)) * 25), None, 400, "prompt"),
    ("completion unknown model", P, comp(model="davinci"), None, 404, "model"),
    ("unknown route", "/v1/nope", GOOD_CHAT, None, 404, None),
]


def send(http, path, body, headers=None):
    headers = {**AUTH, **(headers or {})}
    if isinstance(body, dict):
        return http.post(path, json=body, headers=headers)
    content = body() if callable(body) else body
    return http.post(path, content=content, headers={"Content-Type": "application/json", **headers})


def test_the_corpus_is_big_enough():
    assert len(CORPUS) >= 40


@pytest.mark.parametrize("name,path,body,headers,status,param", CORPUS, ids=[c[0] for c in CORPUS])
def test_a_hostile_request_gets_its_status_and_the_next_good_one_succeeds(http, name, path, body, headers,
                                                                         status, param):
    r = send(http, path, body, headers)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if param is not None:
        assert error["param"] == param, error
    assert r.headers["x-request-id"].startswith("req-")
    good = send(http, C, GOOD_CHAT)
    assert good.status_code == 200 and good.json()["usage"]["completion_tokens"] == 2


def test_a_prompt_too_long_names_both_numbers(http):
    error = send(http, C, chat(messages=[{"role": "user", "content": "stone " * 5000}])).json()["error"]
    numbers = [int(w) for w in error["message"].replace("(", " ").split() if w.isdigit()]
    assert any(n > 4096 for n in numbers) and 4095 in numbers, error["message"]


def test_an_image_part_to_a_text_only_model_and_an_audio_part_are_refused_naming_them(http):
    parts = [{"type": "text", "text": "What is this?"}, {"type": "image_url", "image_url": {"url": "data:,"}}]
    r = http.post("/v1/chat/completions", headers=AUTH, json={**GOOD_CHAT, "messages": [
        {"role": "user", "content": parts}]})
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["param"] == "messages[0].content[1]" and "takes no images" in error["message"]
    audio = [{"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}]
    r = http.post("/v1/chat/completions", headers=AUTH, json={**GOOD_CHAT, "messages": [
        {"role": "user", "content": audio}]})
    error = r.json()["error"]
    assert r.status_code == 400 and error["param"] == "messages[0].content" and "'input_audio' part" in error["message"]


def test_a_method_that_is_not_allowed_is_405_in_openai_shape(http):
    r = http.get(C, headers=AUTH)
    assert r.status_code == 405 and "error" in r.json()


def test_a_client_that_disconnects_mid_stream_frees_its_pages(server, http, engine):
    body = chat(max_tokens=3000, stream=True, ignore_eos=True,
                messages=[{"role": "user", "content": "Tell a long story about stones. " * 8}])
    generated = engine.engine.stats.generated_tokens
    with http.stream("POST", C, json=body, headers=AUTH) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")
        assert engine.engine.cache.pages.num_held > 0
    deadline = time.monotonic() + 10
    while engine.engine.cache.pages.num_held and time.monotonic() < deadline:
        time.sleep(0.05)
    assert engine.engine.cache.pages.num_held == 0 and not engine.engine.has_unfinished()
    assert engine.engine.stats.generated_tokens - generated < 2000  # aborted, not run to its end
    assert send(http, C, GOOD_CHAT).status_code == 200


def test_a_client_that_gives_up_on_a_non_streamed_answer_frees_its_pages(server, engine):
    body = chat(max_tokens=3000, ignore_eos=True, messages=[{"role": "user", "content": "Stones. " * 30}])
    generated = engine.engine.stats.generated_tokens
    with httpx.Client(base_url=server.url, timeout=httpx.Timeout(60, read=0.5)) as impatient:
        with pytest.raises(httpx.ReadTimeout):
            impatient.post(C, json=body, headers=AUTH)
    deadline = time.monotonic() + 10
    while (engine.engine.cache.pages.num_held or engine.engine.has_unfinished()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert engine.engine.cache.pages.num_held == 0 and not engine.engine.has_unfinished()
    assert engine.engine.stats.generated_tokens - generated < 2000  # aborted, not run to its end


# ---- queue full and internal faults, through a scripted client ---------------------------------
class FaultyClient:
    spec = EngineSpec(fingerprint="scripted", page_size=16, max_model_len=4096, recurrent=True, vocab_size=512)

    def __init__(self):
        self.waiting, self.fail_after, self.broken, self.engines_up = 0, None, False, True

    async def generate(self, request):
        from cairn.workers import EngineError, RequestOutput
        from cairn.workers.engine_errors import EngineBroken

        for i in range(3):
            if self.fail_after == i:
                kind = EngineBroken if self.broken else RuntimeError if i == 0 else EngineError
                raise kind("secret internal detail /srv/model.py:42")
            yield RequestOutput(request.request_id, [5], None, i + 1, 0, token_ids=[5] * 3 if i == 2 else None,
                                finish_reason="length" if i == 2 else None)
            await asyncio.sleep(0)

    async def abort(self, request_id):
        return False

    async def metrics(self):
        return EngineMetrics()

    def num_waiting(self):
        return self.waiting

    async def ready(self):
        return self.engines_up


@pytest.fixture(scope="module")
def faulty(tiny_model_dir):
    fake = FaultyClient()
    with BackgroundServer(build_app(fake, tiny_model_dir, APIOptions(served_model_name=MODEL, max_waiting=10))) as s, \
            httpx.Client(base_url=s.url, timeout=30) as c:
        yield fake, c


def test_ready_is_503_until_an_engine_takes_requests_while_health_answers_all_along(faulty):
    # A load balancer probes /ready: the HTTP server (health) is up before its engines are.
    fake, c = faulty
    fake.engines_up = False
    r = c.get("/ready")
    assert r.status_code == 503 and r.json()["status"] == "starting"
    assert c.get("/health").status_code == 200
    fake.engines_up = True
    assert c.get("/ready").json() == {"status": "ready"}


def test_a_full_queue_is_429_and_clears(faulty):
    fake, c = faulty
    fake.waiting = 10
    r = c.post(C, json=GOOD_CHAT)
    assert r.status_code == 429 and r.json()["error"]["code"] == "queue_full" and r.headers["retry-after"]
    fake.waiting = 0
    assert c.post(C, json=GOOD_CHAT).status_code == 200


def test_an_internal_fault_is_a_500_naming_only_the_request_id(faulty, caplog):
    fake, c = faulty
    fake.fail_after = 0
    r = c.post(C, json=GOOD_CHAT)
    assert r.status_code == 500
    error = r.json()["error"]
    assert "secret" not in r.text and r.headers["x-request-id"] in error["message"]
    assert any(r.headers["x-request-id"] in rec.getMessage() for rec in caplog.records)
    fake.fail_after = 0
    given = c.post(C, json=GOOD_CHAT, headers={"X-Request-Id": "trace-7f3a.1"})  # a client's (or a proxy's) id
    assert given.headers.get_list("x-request-id") == ["trace-7f3a.1"] and "trace-7f3a.1" in given.json()["error"]["message"]
    for hostile in ("x" * 200, "a b", "<script>"):
        r = c.post(C, json=GOOD_CHAT, headers={"X-Request-Id": hostile})
        assert r.headers["x-request-id"].startswith("req-"), "an id that is not a plain token is replaced"
    fake.fail_after = 1  # after the stream started: an error event, then [DONE]
    with c.stream("POST", C, json=chat(stream=True)) as s:
        events = [line for line in s.iter_lines() if line]
    assert events[-1] == "data: [DONE]" and '"error"' in events[-2] and "secret" not in "".join(events)
    fake.fail_after = None
    assert c.post(C, json=GOOD_CHAT).status_code == 200


def test_a_broken_engine_is_a_503_to_retry_before_the_stream_and_an_error_event_in_it(faulty):
    """An engine that lost a tensor-parallel rank (EngineBroken): not the client's doing, and
    its replica is being replaced, so the client is told to retry."""
    fake, c = faulty
    fake.broken, fake.fail_after = True, 0
    try:
        r = c.post(C, json=GOOD_CHAT)
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        error = r.json()["error"]
        assert error["code"] == "engine_unavailable" and "retry" in error["message"] and "secret" not in r.text
        fake.fail_after = 1
        with c.stream("POST", C, json=chat(stream=True)) as s:
            events = [line for line in s.iter_lines() if line]
        assert events[-1] == "data: [DONE]" and '"engine_unavailable"' in events[-2]
    finally:
        fake.broken, fake.fail_after = False, None
    assert c.post(C, json=GOOD_CHAT).status_code == 200


async def sse_events(client: httpx.AsyncClient, path: str, body: dict, headers: dict,
                     echoed_id: str | None = None) -> list[str]:
    """The data lines of one streamed response (after a 200, echoing `echoed_id` if given)."""
    events = []
    async with client.stream("POST", path, json=body, headers=headers) as r:
        assert r.status_code == 200
        assert echoed_id is None or r.headers["x-request-id"] == echoed_id
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
    return events


def test_a_reused_request_id_is_only_a_label_and_touches_no_other_request(server):
    """Two requests with one X-Request-Id at once: both answer in full, each echoing the label."""
    body = chat(max_tokens=40, ignore_eos=True, stream=True, messages=[{"role": "user", "content": "Stones. " * 10}])
    headers = dict(AUTH, **{"X-Request-Id": "retry-42"})

    async def one(client):
        return await sse_events(client, C, body, headers, echoed_id="retry-42")

    async def main():
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
            return await asyncio.wait_for(asyncio.gather(one(client), one(client)), 60)

    for events in asyncio.run(main()):
        assert events[-1] == "[DONE]" and not any('"error"' in e for e in events)
        finishes = [c["finish_reason"] for e in events[:-1] for c in json.loads(e)["choices"] if c["finish_reason"]]
        assert finishes == ["length"]


def test_a_detokenization_fault_ends_that_stream_alone(server, engine, monkeypatch):
    """A fault turning one request's tokens into text fails that request (an error event, then
    [DONE]) while a stream beside it runs to its end; the engine gets the pages back."""
    from cairn.cluster.api import text_tokenizer as tokenizer_module

    victim_prompt = "Stones and zebras " * 4 + "quagga"
    push = tokenizer_module.Detokenizer.push

    def faulty(self, token_ids):
        if getattr(self, "victim", None) is None:
            self.victim = self._tok.decode(self._ids).endswith("agga")  # the last prompt tokens it keeps
        if self.victim:
            raise RuntimeError("injected detokenizer fault")
        return push(self, token_ids)

    monkeypatch.setattr(tokenizer_module.Detokenizer, "push", faulty)

    async def stream(client, prompt):
        return await sse_events(client, "/v1/completions", comp(prompt=prompt, max_tokens=30, stream=True,
                                                                ignore_eos=True), AUTH)

    async def main():
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
            return await asyncio.wait_for(asyncio.gather(stream(client, victim_prompt),
                                                         stream(client, "Stones and ridges " * 4)), 60)

    victim, bystander = asyncio.run(main())
    assert victim[-1] == "[DONE]" and "error" in json.loads(victim[-2]), victim[-2:]
    assert bystander[-1] == "[DONE]" and not any('"error"' in e for e in bystander)
    finishes = [c["finish_reason"] for e in bystander[:-1] for c in json.loads(e)["choices"] if c["finish_reason"]]
    assert finishes == ["length"]
    deadline = time.monotonic() + 10
    while (engine.engine.cache.pages.num_held or engine.engine.has_unfinished()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert engine.engine.cache.pages.num_held == 0 and not engine.engine.has_unfinished()
