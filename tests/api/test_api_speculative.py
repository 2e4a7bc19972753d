"""Speculative decoding as a client sees it: the official openai client against two servers over
real HTTP, one engine with `num_speculative_tokens` 2 (exact mode) and one without, on the tiny
demo model trained for it (`cairn demo-model --mtp trained`: its head's drafts are kept at a
realistic rate, so steps do yield several tokens), gets the same answers: streamed and not,
usage with cached_tokens on a repeat, a stop string, n > 1 seeded sampling, structured outputs
and a constrained tool call (its rows draft under a grammar). Streaming sends accepted tokens
only: the streamed text equals the whole answer. (The engine-level equalities are
tests/workers/test_speculative.py.)"""

import pytest

from cairn.cluster.api import APIOptions, build_app
from cairn.cluster.api.engine_client import LocalEngineClient
from cairn.cluster.api.server import BackgroundServer
from cairn.workers import EngineFront
from tests.api.test_api_async_scheduling import MESSAGES, MODEL, NO_THINKING, both
from tests.api.test_api_async_scheduling import test_answers_usage_and_streams_are_the_same as _answers
from tests.api.test_api_async_scheduling import test_a_stop_string_cuts_alike_streamed_and_not as _stop_string
from tests.api.test_api_async_scheduling import test_n_seeded_choices_are_the_same as _n_seeded
from tests.api.test_api_async_scheduling import \
    test_structured_outputs_and_a_constrained_tool_call_are_the_same as _structured

pytestmark = pytest.mark.slow  # the trained demo model: about a minute on CPU, once a session


@pytest.fixture(scope="module")
def clients(trained_spec_model):
    engines = [EngineFront.from_pretrained(trained_spec_model, num_pages=512, max_num_seqs=8, page_size=8,
                                           num_speculative_tokens=k, speculative_exact=True, speculative_adaptive=False)
               for k in (0, 2)]
    with BackgroundServer(build_app(LocalEngineClient(engines[0]), trained_spec_model,
                                    APIOptions(served_model_name=MODEL))) as a, \
            BackgroundServer(build_app(LocalEngineClient(engines[1]), trained_spec_model,
                                       APIOptions(served_model_name=MODEL))) as b:
        import openai

        yield [openai.OpenAI(base_url=s.url + "/v1", api_key="none", max_retries=0, timeout=120) for s in (a, b)]
    spec = engines[1].engine.speculation
    assert spec.accepted_tokens > 0.5 * spec.draft_tokens / 2, "the trained head's drafts were kept"
    assert engines[0].engine.speculation.drafts == 0


def test_answers_usage_and_streams_are_the_same(clients):
    _answers(clients)


def test_logprobs_are_the_same_to_the_bit(clients):
    """The exact mode: each drafted token verified through the decode kernels, as k = 0 runs it."""
    off, on = both(clients, messages=MESSAGES, temperature=0, max_tokens=20, logprobs=True, top_logprobs=2,
                   extra_body={"ignore_eos": True, **NO_THINKING})
    assert [(t.token, t.logprob, [(a.token, a.logprob) for a in t.top_logprobs])
            for t in on.choices[0].logprobs.content] == \
        [(t.token, t.logprob, [(a.token, a.logprob) for a in t.top_logprobs]) for t in off.choices[0].logprobs.content]


def test_a_stop_string_cuts_alike_streamed_and_not(clients):
    _stop_string(clients)


def test_n_seeded_choices_are_the_same(clients):
    _n_seeded(clients)


def test_structured_outputs_and_a_constrained_tool_call_are_the_same(clients):
    _structured(clients)
