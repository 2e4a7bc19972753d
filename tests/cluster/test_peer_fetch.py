"""A replica's fetch from the holder its request names (cairn.cluster.replica_peer_fetch), with two real
engines and the holder's side reached as the deployment handle would reach it: a request resumes
from the fetched pages and computes what a cold one computes; a holder that died, hangs or
evicted meanwhile costs a recomputation, counted by reason, and the request is neither lost nor
run twice."""

import asyncio
import time

import pytest
import torch
from ray.exceptions import ActorDiedError

from cairn.cluster.replica_peer_fetch import ReplicaPeerFetch
from tests.support.chat import assert_same_output
from cairn.workers import EngineFront, SamplingParams
from cairn.workers.request import FetchHint, GenerateRequest

PS = 16
GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=1)


class Peers:
    """The deployment handle as a receiving replica uses it: `export_resume.remote(ask)`, routed to
    the replica the ask names (here: the holder's ReplicaPeerFetch), or a fault."""

    def __init__(self, holder: ReplicaPeerFetch, fault: str | None = None):
        self.holder, self.fault, self.asked = holder, fault, 0
        self.export_resume = self

    def remote(self, ask):
        self.asked += 1
        return self._answer(ask)

    async def _answer(self, ask):
        if self.fault == "died":
            raise ActorDiedError()
        if self.fault == "hangs":
            await asyncio.sleep(30)
        if self.fault == "deaf":  # a call to a dead node's actor: cancelling it takes until Ray gives up
            for _ in range(5):
                try:
                    await asyncio.sleep(1)
                except asyncio.CancelledError:
                    pass
        if self.fault == "evicted":
            await self.holder.engine.call(lambda engine: engine.clear_cache())
        return await self.holder.export(ask)


def prompt(n, seed, vocab=400):
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


async def run(engine, tokens, salt=None, fetch=None, hint=None):
    root = engine.spec.hash_root(salt)
    request = GenerateRequest("r", tokens, GREEDY, hash_root=root, page_hashes=engine.spec.page_hashes(tokens, root),
                              fetch=None if hint is None else FetchHint(*hint))
    outs = [out async for out in engine.stream(request, fetch)]
    return outs[-1]


async def scenario(tiny_model_dir, fault):
    holder = EngineFront.from_pretrained(tiny_model_dir, cache_policy="all", num_pages=256, worker_id="holder")
    receiver = EngineFront.from_pretrained(tiny_model_dir, cache_policy="all", num_pages=256, worker_id="receiver")
    try:
        held, mine = ReplicaPeerFetch("holder", holder, 1.0), ReplicaPeerFetch("receiver", receiver, 1.0)
        mine._handle = peers = Peers(held, fault)
        turn1 = prompt(6 * PS + 3, seed=8)
        first = await run(holder, turn1)
        turn2 = turn1 + first.token_ids + prompt(5, seed=9)
        depth = (len(turn1) + len(first.token_ids)) // PS
        began = time.monotonic()
        got = await run(receiver, turn2, fetch=mine, hint=("holder", depth))
        took = time.monotonic() - began
        cold = await run(receiver, turn2, salt="cold")
        assert cold.cached_tokens == 0
        assert_same_output(got, cold)
        assert peers.asked == 1, "asked once, never retried: the request ran once"
        return got, depth, await receiver.metrics(), await holder.metrics(), took
    finally:
        await holder.close()
        await receiver.close()


def test_a_fetched_resume_point_is_used_and_counted(tiny_model_dir):
    got, depth, metrics, holder, _ = asyncio.run(scenario(tiny_model_dir, None))
    assert got.cached_tokens == depth * PS, "resumed exactly where the holder's checkpoint is"
    assert metrics.fetches_total == 1 and metrics.fetched_pages_total >= 6
    assert holder.exported_bytes_total == metrics.fetched_bytes_total > 0


@pytest.mark.parametrize("fault, reason", [("died", "holder_failed"), ("hangs", "timeout"), ("deaf", "timeout"),
                                           ("evicted", "evicted")])
def test_a_holder_that_fails_mid_fetch_costs_a_recomputation_counted_by_reason(tiny_model_dir, fault, reason):
    got, _, metrics, _, took = asyncio.run(scenario(tiny_model_dir, fault))
    assert got.cached_tokens == 0
    assert took < 4, "the fetch's timeout (1 s) bounds the wait, however long cancelling the call takes"
    assert metrics.fetch_fallbacks_total[reason] == 1 and metrics.fetches_total == 0


def test_no_fetch_for_a_hint_naming_this_replica_or_a_shallower_holder(tiny_model_dir):
    async def go():
        engine = EngineFront.from_pretrained(tiny_model_dir, cache_policy="all", num_pages=256, worker_id="me")
        try:
            fetch = ReplicaPeerFetch("me", engine, 1.0)
            fetch._handle = peers = Peers(fetch)
            tokens = prompt(4 * PS + 1, seed=3)
            await run(engine, tokens, fetch=fetch, hint=("me", 4))
            await run(engine, tokens + [7], fetch=fetch, hint=("other", 2))  # it holds 4 pages itself
            return peers.asked
        finally:
            await engine.close()
    assert asyncio.run(go()) == 0


def test_a_request_waits_outside_the_scheduler_while_its_fetch_runs_and_a_cancel_frees_it(tiny_model_dir):
    async def go():
        engine = EngineFront.from_pretrained(tiny_model_dir, cache_policy="all", num_pages=256, worker_id="me")
        try:
            started = asyncio.Event()

            async def hangs(request, plan):
                started.set()
                await asyncio.sleep(30)
            tokens = prompt(4 * PS + 1, seed=5)
            root = engine.spec.hash_root()
            request = GenerateRequest("held", tokens, GREEDY, hash_root=root,
                                      page_hashes=engine.spec.page_hashes(tokens, root), fetch=FetchHint("other", 4))
            task = asyncio.create_task(anext(engine.stream(request, hangs)))
            await asyncio.wait_for(started.wait(), 5)
            held = await engine.call(lambda e: (e.has_unfinished(), e.has_runnable(), e.scheduler.has_work()))
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            after = await engine.call(lambda e: e.has_unfinished())
            out = await run(engine, tokens)  # the engine goes on serving
            return held, after, out
        finally:
            await engine.close()
    held, after, out = asyncio.run(go())
    assert held == (True, False, False), "held by the engine, outside the scheduler, nothing to step"
    assert after is False, "a cancel while fetching leaves nothing behind"
    assert out.finished and len(out.token_ids) == GREEDY.max_tokens
