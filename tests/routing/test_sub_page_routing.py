"""A request routed by its prompt-end state: two engines hold the same pages of a conversation up
to a page floor, one of them also the state at the previous prompt's end inside the next page
(its reply ended there: `cairn.workers.cache.partial_pages`). The index hears of that state by a
key of its own (`Checkpoint.index_key`); the ranker names every position of the page after the
hit run (`AffinityRanker.sub_states`) and ranks the holder first, with its resume point; the
request then resumes there."""

import asyncio
import random

import pytest
import torch

from cairn.cache_service.index import CacheIndex
from cairn.cluster.routing.ranker import AffinityRanker
from cairn.cluster.routing.routing_config import RoutingConfig
from cairn.workers import Engine, SamplingParams
from cairn.workers.request import GenerateRequest
from tests.support.stepping import finish

PS = 16
SHORT = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)


def tokens(n: int, seed: int) -> list[int]:
    return torch.randint(3, 200, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def engines(demo_model):
    return {w: Engine.from_pretrained(demo_model("qwen3_5"), num_pages=256, dtype="float32", worker_id=w)
            for w in ("a", "b")}


def feed(index: CacheIndex, engine: Engine) -> None:
    while (batch := engine.drain_events()) is not None:
        assert index.apply(batch.encode())


def run(engine: Engine, prompt: list[int]):
    rid = engine.add_request(prompt, SHORT)
    return finish(engine, [rid])[rid]


def test_the_replica_holding_the_prompt_end_state_ranks_first_and_resumes_there(engines):
    a, b = engines["a"], engines["b"]
    index = CacheIndex()
    for e in engines.values():  # each opens its stream with a snapshot: what follows are its events
        feed(index, e)
    first = tokens(3 * PS + 5, seed=1)  # ends 5 tokens into page 3; a 4-token reply ends inside it too
    run(a, first)
    run(b, first[:3 * PS])  # the same 3 pages, and a state at their end
    for e in engines.values():
        feed(index, e)
    spec = a.spec
    nxt = first + tokens(20, seed=2)
    root = spec.hash_root()
    request = GenerateRequest("r", nxt, SHORT, hash_root=root, page_hashes=spec.page_hashes(nxt, root))
    pages = index.score(request.page_hashes)
    assert (pages["a"].hit_pages, pages["a"].state_pages) == (pages["b"].hit_pages, pages["b"].state_pages) == (3, 3)

    config = RoutingConfig(load_weight=0.0).for_engines(spec)

    async def rank(probe):
        ranker = AffinityRanker(config, rng=random.Random(0))
        firsts = set()
        for i in range(8):  # ties break at random
            firsts.add((await ranker.rank(f"r{i}", request, {"a": {}, "b": {}}, index.score, probe)).order[0])
        return firsts, await ranker.sub_states(request, {w: s for w, s in pages.items()}, probe)
    found, scored = asyncio.run(rank(index.states_at))
    assert found == {"a"} and scored["a"].sub_tokens == len(first) and scored["b"].sub_tokens == 0
    assert asyncio.run(rank(None))[0] == {"a", "b"}, "by pages alone the two tie"
    assert run(a, nxt).cached_tokens == len(first), "the holder resumes at the prompt's end"


def test_a_router_that_sent_the_prompt_finds_its_end_before_the_index_hears_of_it(engines):
    a = engines["a"]
    spec = a.spec
    root = spec.hash_root("fresh")
    first = tokens(2 * PS + 9, seed=3)
    config = RoutingConfig(load_weight=0.0).for_engines(spec)
    ranker = AffinityRanker(config, rng=random.Random(0))

    def req(rid, prompt):
        return GenerateRequest(rid, prompt, SHORT, hash_root=root, page_hashes=spec.page_hashes(prompt, root))
    ranker.on_routed("r1", "a", req("r1", first))  # what this router sent where

    async def index(hashes):  # the index has not heard of it yet
        return {}
    nxt = req("r2", first + tokens(10, seed=4))

    async def main():
        return await ranker.sub_states(nxt, {"a": (await ranker._scores(nxt.page_hashes, index))["a"]}, None)
    assert asyncio.run(main())["a"].sub_tokens == len(first)


def test_with_fetch_the_hint_names_the_holders_sub_page_resume_point():
    from cairn.cache_service.scoring import WorkerScore
    from cairn.cluster.routing.cost import deepest_holder, fetch_hint
    from cairn.workers.request import FetchHint

    config = RoutingConfig(fetch=True, page_size=PS, recurrent=True, page_bytes=4096, state_bytes=14592)
    scores = {"a": WorkerScore(3, 3, sub_tokens=3 * PS + 5), "b": WorkerScore(3, 3), "c": WorkerScore(2, 2)}
    holder = deepest_holder(scores, config)
    assert holder[0] == "a" and fetch_hint(holder, config) == FetchHint("a", 3, 5)
    assert fetch_hint(("b", scores["b"]), config) == FetchHint("b", 3)



def test_a_turn_sent_as_the_last_one_ends_finds_its_end_however_long_that_one_ran(engines):
    """The index hears of a prompt-end state only after the request ends (events drained, fed,
    mirrored), and an agent sends its next turn at once: the router's own record of what it sent,
    refreshed as the request completes, stands in for the index meanwhile."""
    from tests.support.routing_cases import Clock

    spec = engines["a"].spec
    root = spec.hash_root("long")
    first = tokens(2 * PS + 9, seed=5)
    clock = Clock()
    ranker = AffinityRanker(RoutingConfig(load_weight=0.0).for_engines(spec), clock=clock, rng=random.Random(0))

    def req(rid, prompt):
        return GenerateRequest(rid, prompt, SHORT, hash_root=root, page_hashes=spec.page_hashes(prompt, root))

    async def index(hashes):  # the index has not heard of it yet
        return {}
    nxt = req("r2", first + tokens(10, seed=6))

    async def depth():  # how deep the router thinks "a" resumes the next turn (None: not at all)
        scores = await ranker._scores(nxt.page_hashes, index)
        return (await ranker.sub_states(nxt, scores, None))["a"].sub_tokens if "a" in scores else None
    ranker.on_routed("r1", "a", req("r1", first))
    clock.now += 10 * ranker.config.predicted_holder_ttl_s  # a long reply: its routing's record is stale
    ranker.on_completed("r1", "a")
    assert asyncio.run(depth()) == len(first)
    clock.now += 10 * ranker.config.predicted_holder_ttl_s
    assert asyncio.run(depth()) is None, "long after it, the index is the one to ask"
