"""Fetching a resume point from a peer engine, in one process: the receiver resumes where the
holder was and computes exactly what a cold run computes; a holder that evicted meanwhile, or
one under another cache salt, gives nothing and the request recomputes, counted."""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cairn.cache_service.index import CacheIndex
from tests.support.chat import assert_same_output
from cairn.workers import Engine, SamplingParams
from cairn.workers.sequence import Sequence
from tests.support.stepping import finish, run_alone

PS = 16
GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=1)


def prompt(n, seed, vocab=400):
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def run(engine, tokens, salt=None):
    return run_alone(engine, tokens, GREEDY, salt)


def depth_on(engine, tokens, hashes):
    """How deep (pages) `engine` resumes this prompt: what the index tells the router."""
    seq = Sequence("probe", tokens, SamplingParams(max_tokens=1), hash_root=b"\0" * 16)
    engine.cache.adopt_hashes(seq, hashes)
    m = engine.cache.match(seq)
    return m.state_pages if engine.cache.recurrent else m.hit_pages


def fetch(receiver, holder, tokens, salt=None, depth=None):
    """What a receiving replica does before admitting `tokens`: plan, export on the holder,
    import. Returns the pages imported (None: nothing to fetch)."""
    hashes = receiver.spec.page_hashes(tokens, receiver.spec.hash_root(salt))
    if depth is None:
        depth = depth_on(holder, tokens, hashes)
    plan = receiver.fetches.plan(hashes, len(tokens), depth)
    if plan is None:
        return None
    export = holder.fetches.export(hashes, plan.first, plan.depth)
    if export is None:
        receiver.fetches.count_fallback("evicted")
        return 0
    return receiver.fetches.import_(export, hashes, plan.first)


@pytest.fixture(scope="module", params=["roomy", "tight"])
def pair(tiny_model_dir, request):
    """A holder, and a receiver with room to spare or with 30 blocks (importing evicts)."""
    def make(worker_id, **size):
        return Engine.from_pretrained(tiny_model_dir, cache_policy="all", max_num_seqs=4, worker_id=worker_id, **size)
    tight = dict(cache_memory_bytes=30 * 8192) if request.param == "tight" else dict(num_pages=256)
    return make("holder", num_pages=256), make("receiver", **tight)


@settings(max_examples=30, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(data=st.data())
def test_a_request_resumed_from_a_fetched_resume_point_computes_what_a_cold_one_computes(pair, data):
    holder, receiver = pair
    base_len = data.draw(st.integers(PS + 2, 6 * PS), label="base")
    base = data.draw(st.lists(st.integers(0, 500), min_size=base_len, max_size=base_len), label="tokens")
    keep = data.draw(st.integers(1, base_len), label="shared")
    tail = data.draw(st.lists(st.integers(0, 500), min_size=1, max_size=2 * PS), label="tail")
    local = data.draw(st.integers(0, base_len), label="the receiver's own prefix")
    second = base[:keep] + tail
    run(holder, base)
    if local:
        run(receiver, base[:local] + [1])
    fetch(receiver, holder, second)
    warm = run(receiver, second)
    cold = run(receiver, second, salt=f"cold-{receiver.stats.steps}")
    assert cold.cached_tokens == 0
    assert_same_output(warm, cold)
    receiver.check()
    holder.check()


def test_the_randomized_test_above_did_fetch(pair):
    _, receiver = pair
    m = receiver.metrics()
    assert m.fetches_total > 0 and m.fetched_pages_total > 0 and m.fetched_bytes_total > 0


def test_a_fetched_resume_point_counts_as_cached_and_the_index_learns_it(tiny_model_dir):
    holder = Engine.from_pretrained(tiny_model_dir, cache_policy="all", num_pages=256, worker_id="h")
    receiver = Engine.from_pretrained(tiny_model_dir, cache_policy="all", num_pages=256, worker_id="r")
    index = CacheIndex()
    index.apply(receiver.drain_events())
    conversation = prompt(6 * PS + 3, seed=4)
    first = run(holder, conversation)
    turn2 = conversation + first.token_ids + prompt(7, seed=5)
    assert fetch(receiver, holder, turn2) == (len(conversation) + len(first.token_ids)) // PS
    index.apply(receiver.drain_events())
    assert index.contents("r") == receiver.cache_contents()
    got = run(receiver, turn2)
    want = run(holder, turn2)
    assert got.cached_tokens == want.cached_tokens >= 6 * PS
    assert_same_output(got, want)
    assert receiver.metrics().fetches_total == 1


def test_a_fetched_checkpoint_no_slot_can_be_had_for_is_counted_and_the_request_computes_what_cold_computes(
        tiny_model_dir, monkeypatch):
    """The pages arrive but the resume point's state has nowhere to go (every state slot held by
    running sequences): the request cannot resume there, and the fallback says why."""
    holder = Engine.from_pretrained(tiny_model_dir, cache_policy="all", num_pages=256)
    receiver = Engine.from_pretrained(tiny_model_dir, cache_policy="all", num_pages=256)
    tokens = prompt(5 * PS + 2, seed=8)
    run(holder, tokens)
    monkeypatch.setattr(receiver.cache, "take_checkpoint_slot", lambda: None)
    assert fetch(receiver, holder, tokens + [3]) > 0, "the pages came"
    monkeypatch.undo()
    assert receiver.metrics().fetch_fallbacks_total["no_checkpoint_slot"] == 1
    assert receiver.metrics().fetches_total == 0, "a fallback, not a fetch"
    out = run(receiver, tokens + [3])
    assert out.cached_tokens == 0
    assert_same_output(out, run(holder, tokens + [3], salt="cold"))


def test_a_holder_that_evicted_meanwhile_gives_nothing_and_the_request_recomputes(tiny_model_dir):
    holder = Engine.from_pretrained(tiny_model_dir, cache_policy="all", num_pages=256)
    receiver = Engine.from_pretrained(tiny_model_dir, cache_policy="all", num_pages=256)
    tokens = prompt(5 * PS + 2, seed=6)
    run(holder, tokens)
    hashes = receiver.spec.page_hashes(tokens + [3], receiver.spec.hash_root())
    depth = depth_on(holder, tokens + [3], hashes)
    holder.clear_cache()  # between the router's look and the fetch
    assert fetch(receiver, holder, tokens + [3], depth=depth) == 0
    out = run(receiver, tokens + [3])
    assert out.cached_tokens == 0
    assert_same_output(out, run(holder, tokens + [3], salt="cold"))
    assert receiver.metrics().fetch_fallbacks_total["evicted"] == 1


def test_a_fetch_never_crosses_a_cache_salt(tiny_model_dir):
    holder = Engine.from_pretrained(tiny_model_dir, cache_policy="all", num_pages=256)
    receiver = Engine.from_pretrained(tiny_model_dir, cache_policy="all", num_pages=256)
    tokens = prompt(5 * PS + 2, seed=7)
    run(holder, tokens, salt="tenant-a")
    hashes_a = holder.spec.page_hashes(tokens, holder.spec.hash_root("tenant-a"))
    depth = depth_on(holder, tokens, hashes_a)
    assert depth > 0
    # tenant b asks for its own chain at the depth the router saw for tenant a's: nothing matches
    assert fetch(receiver, holder, tokens, salt="tenant-b", depth=depth) == 0
    assert run(receiver, tokens, salt="tenant-b").cached_tokens == 0
    assert receiver.metrics().fetch_fallbacks_total["evicted"] == 1


def test_a_holder_exports_what_its_host_tier_keeps(tiny_model_dir):
    holder = Engine.from_pretrained(tiny_model_dir, cache_policy="all", cache_memory_bytes=30 * 8192,
                                    host_cache_bytes=2000 * 8192, max_num_seqs=4)
    receiver = Engine.from_pretrained(tiny_model_dir, cache_policy="all", num_pages=256)
    conversation = prompt(6 * PS + 3, seed=11)
    first = run(holder, conversation)
    for i in range(4):  # other conversations push it out to the holder's host tier
        run(holder, prompt(6 * PS, seed=40 + i))
    turn2 = conversation + first.token_ids + prompt(7, seed=12)
    hashes = receiver.spec.page_hashes(turn2, receiver.spec.hash_root())
    assert any(h in holder.cache.host.pages for h in hashes) and any(h in holder.cache.host.checkpoints for h in hashes)
    assert fetch(receiver, holder, turn2) > 0
    got = run(receiver, turn2)
    assert got.cached_tokens >= 6 * PS
    assert_same_output(got, run(receiver, turn2, salt="cold"))


def no_device_room(monkeypatch, engine):
    """Every block and state slot of `engine`'s device held by running sequences: an import can
    take none."""
    monkeypatch.setattr(engine.cache.placement, "room_for_pages", lambda n: n == 0)
    monkeypatch.setattr(engine.cache, "take_checkpoint_slot", lambda: None)


def test_a_receiver_without_device_room_keeps_the_fetched_resume_point_in_its_host_tier(tiny_model_dir, monkeypatch):
    holder = Engine.from_pretrained(tiny_model_dir, cache_policy="all", num_pages=256, worker_id="h")
    receiver = Engine.from_pretrained(tiny_model_dir, cache_policy="all", num_pages=256,
                                      host_cache_bytes=400 * 8192, worker_id="r")
    index = CacheIndex()
    index.apply(receiver.drain_events())
    conversation = prompt(6 * PS + 3, seed=31)
    first = run(holder, conversation)
    run(receiver, conversation[:2 * PS] + [1])  # its own device run: the first two pages
    turn2 = conversation + first.token_ids + prompt(7, seed=32)
    hashes = receiver.spec.page_hashes(turn2, receiver.spec.hash_root())
    no_device_room(monkeypatch, receiver)
    assert fetch(receiver, holder, turn2) == (len(conversation) + len(first.token_ids)) // PS - 2
    monkeypatch.undo()
    assert all(h in receiver.cache.host.pages for h in hashes[2:6]) and receiver.cache.host.checkpoints
    assert receiver.metrics().fetches_total == 1 and not receiver.metrics().fetch_fallbacks_total
    index.apply(receiver.drain_events())
    assert index.contents("r") == receiver.cache_contents(), "the index hears of them, on the host"
    receiver.check()
    got = run(receiver, turn2)
    assert got.cached_tokens == run(holder, turn2).cached_tokens >= 6 * PS
    assert_same_output(got, run(receiver, turn2, salt="cold"))
    receiver.check()


def test_with_room_on_neither_tier_the_import_is_refused_and_the_request_recomputes(tiny_model_dir, monkeypatch):
    holder = Engine.from_pretrained(tiny_model_dir, cache_policy="all", num_pages=256)
    receiver = Engine.from_pretrained(tiny_model_dir, cache_policy="all", num_pages=256)  # no host tier
    tokens = prompt(5 * PS + 2, seed=33)
    run(holder, tokens)
    no_device_room(monkeypatch, receiver)
    assert fetch(receiver, holder, tokens + [3]) == 0
    monkeypatch.undo()
    assert receiver.metrics().fetch_fallbacks_total["refused"] == 1
    out = run(receiver, tokens + [3])
    assert out.cached_tokens == 0
    assert_same_output(out, run(holder, tokens + [3], salt="cold"))
    receiver.check()


@pytest.mark.parametrize("host", [False, True, "receiver"],
                         ids=["device", "holder's host tier", "receiver's host tier"])
def test_a_prompt_end_inside_a_page_is_fetched_with_its_head_and_resumed_there(demo_model, host, monkeypatch):
    """The holder's reply ended inside the page its prompt ended in: it keeps that page's head
    and the state at the prompt's end (`cairn.workers.cache.partial_pages`). A fetch of that
    sub-page resume point (the router's hint: `FetchHint.tail`) brings both, and the receiver
    resumes at the prompt's end, computing what a cold engine computes, and tells the index."""
    model = demo_model("qwen3_5")
    tiers = dict(cache_memory_bytes=80 * 4096, host_cache_bytes=4000 * 4096) if host is True else dict(num_pages=256)
    holder = Engine.from_pretrained(model, dtype="float32", worker_id="h", **(tiers if host is True else {}))
    receiver = Engine.from_pretrained(model, dtype="float32", num_pages=256, worker_id="r",
                                      **(dict(host_cache_bytes=400 * 4096) if host == "receiver" else {}))
    index = CacheIndex()
    index.apply(receiver.drain_events())
    short = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    first = prompt(4 * PS + 6, seed=21)
    run_alone(holder, first, short)
    if host is True:  # other conversations push it out to the holder's host tier
        for i in range(6):
            run_alone(holder, prompt(8 * PS, seed=60 + i), short)
        assert holder.cache.stats.pages_demoted > 0
    nxt = first + prompt(9, seed=22)
    root = receiver.spec.hash_root()
    hashes = receiver.spec.page_hashes(nxt, root)
    if host is True:
        assert any(h in holder.cache.host.pages for h in hashes[:4]) and holder.cache.host.checkpoints
    plan = receiver.fetches.plan(hashes, len(nxt), 4, tuple(first[4 * PS:]), root)
    assert (plan.first, plan.depth, plan.tail) == (0, 4, tuple(first[4 * PS:]))
    export = holder.fetches.export(hashes, plan.first, plan.depth, plan.tail, root)
    assert export is not None and export.head is not None and export.sub_checkpoint is not None
    if host == "receiver":  # its device full: the pages, the head and the states go to its host tier
        no_device_room(monkeypatch, receiver)
    assert receiver.fetches.import_(export, hashes, plan.first, root) == 4
    monkeypatch.undo()
    if host == "receiver":
        assert all(h in receiver.cache.host.pages for h in hashes[:4]) and len(receiver.cache.host.checkpoints) >= 1
    index.apply(receiver.drain_events())
    assert index.contents("r") == receiver.cache_contents()
    assert receiver.fetches.plan(hashes, len(nxt), 4, tuple(first[4 * PS:]), root) is None, "held here now"
    got = run(receiver, nxt)
    assert got.cached_tokens == len(first)
    cold = run(receiver, nxt, salt="cold")
    assert cold.cached_tokens == 0
    assert_same_output(got, cold)
    receiver.check()
    holder.check()


@pytest.mark.parametrize("asked", ["deeper in its page", "in the next page"])
def test_a_holder_without_the_asked_state_exports_the_deepest_it_has_within_a_page_before(demo_model, asked):
    """The router predicts a state at a prompt's end; the holder's policy may have put it up to
    `tail_guard` tokens earlier (folded into a hint), or kept only a shallower one. The holder
    then exports the deepest resume point it has at or before the asked one, down to the page
    before it (the plan's `before`: that page's tokens), instead of nothing: the receiver resumes
    there and computes what a cold engine computes."""
    model = demo_model("qwen3_5")
    holder = Engine.from_pretrained(model, dtype="float32", num_pages=256, worker_id="h")
    receiver = Engine.from_pretrained(model, dtype="float32", num_pages=256, worker_id="r")
    short = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    if asked == "deeper in its page":  # the holder's prompt ended 6 tokens into page 4; asked: 9
        first = prompt(4 * PS + 6, seed=31)
        run_alone(holder, first, short)
        nxt = first + prompt(12, seed=32)
        depth, tail = 4, tuple(nxt[4 * PS:4 * PS + 9])
    else:  # it ended 1 token into page 4, a hint 2 tokens before: the engine folds its end into the hint
        first = prompt(4 * PS + 1, seed=33)
        finish(holder, [holder.add_request(first, short, checkpoint_hints=[4 * PS - 1])])
        nxt = first + prompt(12, seed=34)
        depth, tail = 4, tuple(nxt[4 * PS:4 * PS + 1])
        page_4 = holder.spec.page_hashes(nxt, holder.spec.hash_root())[3]
        holder.cache.placement.evict_checkpoint(page_4)  # and the state at page 4's start went since
    root = receiver.spec.hash_root()
    hashes = receiver.spec.page_hashes(nxt, root)
    plan = receiver.fetches.plan(hashes, len(nxt), depth, tail, root, tuple(nxt[(depth - 1) * PS:depth * PS]))
    assert plan is not None and plan.tail == tail
    assert holder.fetches.export(hashes, plan.first, plan.depth, plan.tail, root) is None or asked != "in the next page", \
        "without the page before's tokens the holder cannot look there"
    export = holder.fetches.export(hashes, plan.first, plan.depth, plan.tail, root, plan.before)
    assert export is not None, "the holder answers with what it has"
    receiver.fetches.import_(export, hashes, plan.first, root)
    got = run(receiver, nxt)
    assert got.cached_tokens == (len(first) if asked == "deeper in its page" else 4 * PS - 1), \
        "resumed where the holder's state was"
    cold = run(receiver, nxt, salt="cold")
    assert_same_output(got, cold)
    receiver.check()
    holder.check()
