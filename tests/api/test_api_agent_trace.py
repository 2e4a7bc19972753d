"""An agent loop as OpenAI's clients send it, on the Qwen3.5 demo model (its template, thinking on):
queries, each followed by tool rounds whose replies are short (`max_tokens` 1 to 8, so most end
inside the page their prompt ended in). Every request resumes within 2 tokens of its oracle, the
longest prefix it shares with a prompt sent before it: during tool rounds the whole previous
prompt (`cairn.workers.cache.partial_pages` keeps the page a short reply ended inside), after a
new query where the template drops the rounds' thinking. With the host tier off and on (a device
cache too small for the trace, so pages and states move to host memory and back)."""

import json

import openai
import pytest

from cairn.cluster.api import APIOptions, build_app
from cairn.cluster.api.engine_client import LocalEngineClient
from cairn.cluster.api.server import BackgroundServer
from cairn.workers import EngineFront

MODEL = "tiny"
LOOK_UP = {"type": "function", "function": {"name": "look_up", "description": "Looks a cairn up by name.",
                                            "parameters": {"type": "object", "properties": {"name": {"type": "string"}},
                                                           "required": ["name"]}}}
QUERIES = ["Which cairns stand on the northern ridge?", "And which of them are older than the chapel?",
           "Plan a walk past the three oldest."]
ROUNDS = 4


class Recording(LocalEngineClient):
    """The engine's client, keeping each prompt the server rendered (its token ids)."""

    def __init__(self, engine):
        super().__init__(engine)
        self.prompts: list[list[int]] = []

    async def generate(self, request):
        self.prompts.append(list(request.prompt_token_ids))
        async for out in super().generate(request):
            yield out


def common_prefix(a: list[int], b: list[int]) -> int:
    k = 0
    while k < min(len(a), len(b)) and a[k] == b[k]:
        k += 1
    return k


@pytest.mark.parametrize("tiers", [dict(num_pages=2048), dict(cache_memory_bytes=1 << 20, host_cache_bytes=64 << 20)],
                         ids=["device", "host tier under pressure"])
def test_every_request_of_an_agent_trace_with_short_replies_resumes_within_2_tokens_of_its_oracle(demo_model, tiers):
    model_dir = demo_model("qwen3_5")
    engine = EngineFront.from_pretrained(model_dir, **tiers)
    recording = Recording(engine)
    rows = []  # (oracle, cached, prompt tokens, max_tokens)
    with BackgroundServer(build_app(recording, model_dir,
                                    APIOptions(served_model_name=MODEL))) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60)
        messages = [{"role": "system", "content": "You keep the register of stone cairns in the valley. " * 4}]
        for q, query in enumerate(QUERIES):
            messages.append({"role": "user", "content": query})
            for r in range(ROUNDS + 1):
                max_tokens = 1 + (3 * q + r) % 8
                out = client.chat.completions.create(model=MODEL, messages=messages, tools=[LOOK_UP], temperature=0,
                                                     max_tokens=max_tokens, extra_body={"ignore_eos": True})
                *sent, ids = recording.prompts  # the oracle is from outside the cache: the prompts themselves
                assert len(ids) == out.usage.prompt_tokens
                oracle = min(max((common_prefix(ids, p) for p in sent), default=0), len(ids) - 1)
                rows.append((oracle, out.usage.prompt_tokens_details.cached_tokens, len(ids), max_tokens))
                if r == ROUNDS:
                    messages.append({"role": "assistant", "content": "The register says so."})
                    break
                call = f"call_{q}_{r}"
                messages.append({"role": "assistant", "content": "", "reasoning_content": f"Look up stop {r}.",
                                 "tool_calls": [{"id": call, "type": "function", "function": {
                                     "name": "look_up", "arguments": json.dumps({"name": f"cairn {q}.{r}"})}}]})
                messages.append({"role": "tool", "tool_call_id": call, "content": f"Cairn {q}.{r}: {r + 3} stones."})
    short = [(i, row) for i, row in enumerate(rows) if not row[0] - 2 <= row[1] <= row[2] - 1]
    assert not short, f"(request, (oracle, cached, prompt tokens, max_tokens)) off by more than 2: {short}"
    assert sum(1 for oracle, _, _, _ in rows if oracle) >= len(rows) - 1
    if "host_cache_bytes" in tiers:
        stats = engine.engine.cache.stats
        assert stats.pages_demoted > 0, "the device cache was under pressure"
