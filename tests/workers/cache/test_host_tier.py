"""The host tier as a user meets it through the engine: what a tiny device cache evicts waits in
host memory, a later turn resumes from it and computes exactly what a cold run computes,
`cached_tokens` counts it, the cost rule declines a copy slower than recomputing, and the metrics
say which tier served what."""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.support.chat import assert_same_output
from cairn.workers import Engine, SamplingParams
from cairn.workers.cache.tier_cost import TierCost
from tests.support.stepping import drain, finish, run_alone

PS = 16
GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=1)
BLOCK = 8192  # one KV page of the tiny model; a state slot takes three blocks


def prompt(n, seed, vocab=400):
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def tiered(tiny_model_dir, device_blocks=30, host_blocks=4000, **options):
    return Engine.from_pretrained(tiny_model_dir, cache_policy="all", cache_memory_bytes=device_blocks * BLOCK,
                                  host_cache_bytes=host_blocks * BLOCK, max_num_seqs=4, **options)


def run_salted(engine, tokens, salt):
    """One request under its own cache salt: it shares nothing with anything else (a cold run)."""
    return run_alone(engine, tokens, GREEDY, salt)


@pytest.fixture(scope="module")
def tiered_engine(tiny_model_dir):
    engine = tiered(tiny_model_dir)
    assert engine.layout.block_bytes == BLOCK and engine.layout.host_blocks == 4000
    return engine


@settings(max_examples=50, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(data=st.data())
def test_a_request_resumed_from_the_host_tier_computes_what_a_cold_one_computes(tiered_engine, data):
    engine = tiered_engine
    base_len = data.draw(st.integers(PS + 2, 6 * PS), label="base")
    base = data.draw(st.lists(st.integers(0, 500), min_size=base_len, max_size=base_len), label="tokens")
    keep = data.draw(st.integers(1, base_len), label="shared")
    tail = data.draw(st.lists(st.integers(0, 500), min_size=1, max_size=2 * PS), label="tail")
    flushes = data.draw(st.integers(0, 3), label="flushes")
    second = base[:keep] + tail
    engine.generate([base], GREEDY)
    for i in range(flushes):  # other conversations push base's pages and states out to the host
        run_salted(engine, prompt(5 * PS, seed=engine.stats.steps + i), salt=f"flush-{engine.stats.steps}")
    warm = engine.generate([second], GREEDY)[0]
    cold = run_salted(engine, second, salt=f"cold-{engine.stats.steps}")
    assert cold.cached_tokens == 0
    assert_same_output(warm, cold)
    engine.check()


@pytest.fixture(scope="module")
def exact_tiered_engine(tiny_model_dir):
    """The `cairn` policy (sub-page checkpoints at hints and prompt ends) on a device that keeps
    about one conversation, beside a host tier that keeps them all."""
    return Engine.from_pretrained(tiny_model_dir, cache_policy="cairn", cache_memory_bytes=30 * BLOCK,
                                  host_cache_bytes=4000 * BLOCK, max_num_seqs=4)


@settings(max_examples=30, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(data=st.data())
def test_a_rewritten_turn_resumed_at_its_divergence_from_the_host_computes_what_a_cold_one_computes(
        exact_tiered_engine, data):
    """Issue 38: a turn whose template rewrote history parts from the last one inside a page, at
    one of its hints. Its sub-page checkpoint there and the pages under it were pushed to the host
    by other conversations; the next turn resumes exactly at the divergence from there, and
    computes what a cold run computes."""
    engine = exact_tiered_engine
    base_len = data.draw(st.integers(2 * PS + 2, 6 * PS), label="base")
    base = data.draw(st.lists(st.integers(0, 500), min_size=base_len, max_size=base_len), label="tokens")
    # inside a page the first turn filled (its K/V a whole page: its prompt and answer's 7 computed tokens)
    part = data.draw(st.integers(PS + 1, base_len - 1).filter(lambda k: k % PS and (k // PS + 1) * PS <= base_len + 7),
                     label="parts at")
    tail = data.draw(st.lists(st.integers(0, 500), min_size=1, max_size=2 * PS), label="rewritten")
    tail[0] = (base[part] + 1) % 500  # it parts exactly there
    root = engine.spec.hash_root(f"conv-{engine.stats.steps}")  # this example's own conversation
    engine.add_request(base, GREEDY, hash_root=root, checkpoint_hints=(part,))
    drain(engine)
    for i in range(4):  # other conversations push base's pages and states out to the host
        run_salted(engine, prompt(5 * PS, seed=engine.stats.steps + i), salt=f"flush-{engine.stats.steps}")
    rid = engine.add_request(base[:part] + tail, GREEDY, hash_root=root)
    warm = finish(engine, [rid])[rid]
    cold = run_salted(engine, base[:part] + tail, salt=f"cold-{engine.stats.steps}")
    assert warm.cached_tokens == part, "resumed exactly at the divergence"
    assert_same_output(warm, cold)
    engine.check()


def conversation(engine_factory, flush=4):
    """Turn one, `flush` other conversations, then turn two (turn one's prompt and answer, and
    a new question): turn two's output and cached_tokens."""
    engine = engine_factory()
    turn1 = prompt(6 * PS + 5, seed=1)
    out1 = engine.generate([turn1], GREEDY)[0]
    for i in range(flush):
        engine.generate([prompt(6 * PS, seed=100 + i)], GREEDY)
    out2 = engine.generate([turn1 + out1.token_ids + prompt(9, seed=2)], GREEDY)[0]
    engine.check()
    return engine, out2


def test_a_later_turn_resumes_from_the_host_where_a_device_only_cache_lost_it(tiny_model_dir):
    roomy, want = conversation(lambda: Engine.from_pretrained(tiny_model_dir, cache_policy="all", num_pages=512))
    small, lost = conversation(lambda: Engine.from_pretrained(tiny_model_dir, cache_policy="all",
                                                              cache_memory_bytes=30 * BLOCK, max_num_seqs=4))
    engine, got = conversation(lambda: tiered(tiny_model_dir))
    assert lost.cached_tokens < want.cached_tokens, "the device alone cannot keep turn one"
    assert got.cached_tokens == want.cached_tokens > 0, "the host tier kept it"
    assert_same_output(got, want)
    m = engine.metrics()
    assert m.pages_demoted_total > 0 and m.pages_promoted_total > 0
    assert m.checkpoints_demoted_total > 0 and m.checkpoints_from_host_total > 0
    assert m.tier_hit_tokens_total["host"] == got.cached_tokens
    assert m.bytes_to_device_total == (m.pages_promoted_total + 3 * m.checkpoints_from_host_total) * BLOCK
    assert m.bytes_to_host_total >= m.pages_demoted_total * BLOCK
    assert 0 < m.host_cache_used_bytes <= m.host_cache_budget_bytes == 4000 * BLOCK


def test_a_copy_slower_than_recomputing_is_declined(tiny_model_dir):
    def slow_bus():
        engine = tiered(tiny_model_dir)
        engine.cache.tier_cost = TierCost(bandwidth=1.0, prefill_rate=1e6)  # 1 byte/s against a fast prefill
        engine._observe_rates = lambda plan, seconds: None  # keep the rates as set
        return engine
    engine, out = conversation(slow_bus)
    assert engine.metrics().pages_promoted_total == 0 and engine.metrics().checkpoints_from_host_total == 0
    _, fast = conversation(lambda: tiered(tiny_model_dir))
    assert out.cached_tokens < fast.cached_tokens
    assert_same_output(out, fast)


def test_the_cost_rule_weighs_copy_time_against_prefill_time():
    cost = TierCost()
    assert cost.seconds(10**9, 0) == 0.0, "an unknown bandwidth: a copy is assumed free"
    cost.observe_copy(10**9, 0.1)  # 10 GB/s
    cost.observe_prefill(5000, 1.0)
    assert cost.seconds(10**9, 1000) == pytest.approx(0.1 + 0.2)
    cost.observe_copy(10**9, 1.0)  # averaged, not replaced
    assert 1e9 < cost.bandwidth < 1e10


def test_clearing_the_cache_empties_the_host_tier_too(tiny_model_dir):
    engine, _ = conversation(lambda: tiered(tiny_model_dir))
    assert engine.metrics().host_cache_used_bytes > 0
    engine.clear_cache()
    engine.check()
    assert engine.metrics().host_cache_used_bytes == 0 and engine.host_contents() == (frozenset(), frozenset())


@pytest.mark.parametrize("value", [-1, 1.5, "1", True])
def test_host_cache_bytes_must_be_a_byte_count(tiny_model_dir, value):
    with pytest.raises(ValueError, match="host_cache_bytes"):
        Engine.from_pretrained(tiny_model_dir, host_cache_bytes=value)


def test_the_randomized_tests_above_did_resume_from_the_host(tiered_engine, exact_tiered_engine):
    stats = tiered_engine.cache.stats
    assert stats.pages_promoted > 0 and stats.checkpoints_from_host > 0 and stats.pages_demoted > 0
    stats = exact_tiered_engine.cache.stats  # sub-page checkpoints: demoted, then resumed from
    assert stats.by_kind["hint"].get("used", 0) > 0 and stats.checkpoints_from_host >= 8 and stats.pages_promoted > 0


def test_the_index_replaying_the_engines_events_knows_the_medium_of_everything_at_every_step(tiny_model_dir):
    from cairn.cache_service.index import CacheIndex

    engine = tiered(tiny_model_dir, worker_id="w")
    index = CacheIndex()
    turn1 = prompt(6 * PS + 5, seed=1)
    prompts = [turn1] + [prompt(6 * PS, seed=100 + i) for i in range(4)] + [turn1 + prompt(9, seed=2)]
    seen_host = []

    def apply_events(_):  # after every step: the index holds what the engine holds, on both tiers
        batch = engine.drain_events()
        if batch is not None:
            assert index.apply(batch.encode())
        assert index.contents("w") == engine.cache_contents()
        assert index.host_contents("w") == engine.host_contents()
        seen_host.append(len(engine.host_contents()[0]))
    for tokens in prompts:
        engine.add_request(tokens, GREEDY)
        drain(engine, each=apply_events)
    seen_back = engine.metrics().pages_promoted_total
    assert max(seen_host) > 0 and seen_back > 0


def test_a_checkpoint_that_finds_no_device_slot_goes_straight_to_the_host(tiny_model_dir):
    """14 blocks: three running sequences hold every group, so no checkpoint slot can be had on
    the device; with a host tier, the states go there after their step, and the next turns
    resume from them."""
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    turns = [prompt(90, seed=s) for s in range(6)]

    def two_turns(**options):
        engine = Engine.from_pretrained(tiny_model_dir, cache_policy="cairn", max_num_seqs=3,
                                        max_num_batched_tokens=512, **options)
        first = engine.generate(turns, params)
        second = engine.generate([t + o.token_ids + [5, 6, 7] for t, o in zip(turns, first)], GREEDY)
        engine.check()
        return engine, second
    alone, lost = two_turns(cache_memory_bytes=14 * BLOCK)
    tiered_engine, got = two_turns(cache_memory_bytes=14 * BLOCK, host_cache_bytes=400 * BLOCK)
    _, want = two_turns(num_pages=512)
    assert alone.cache.stats.checkpoints_without_slot > 0 and sum(o.cached_tokens for o in lost) == 0
    assert tiered_engine.cache.stats.checkpoints_to_host > 0
    assert [o.cached_tokens for o in got] == [o.cached_tokens for o in want] and got[0].cached_tokens > 0
    for a, b in zip(got, want):
        assert_same_output(a, b)


def test_a_request_resumed_from_the_host_while_others_run_starts_a_step_later_and_computes_the_same(tiny_model_dir):
    """What CUDA does to overlap a promotion with other sequences' step (cairn.workers.execution.runner's copy
    stream), on the CPU path: the request's first segment waits one step; nothing else changes."""
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    start = [prompt(100 + 9 * i, seed=20 + i) for i in range(4)]

    def run(overlap: bool, **options):
        engine = Engine.from_pretrained(tiny_model_dir, cache_policy="all", max_num_seqs=2, **options)
        engine.scheduler.overlap_promotions = overlap
        convs, seen = start, []
        for _ in range(3):  # four conversations, two at a time
            outs = engine.generate(convs, params)
            seen += [(o.token_ids, o.cached_tokens) for o in outs]
            convs = [c + o.token_ids + [7, 8] for c, o in zip(convs, outs)]
        engine.check()
        return engine, seen
    overlapped, got = run(True, cache_memory_bytes=30 * BLOCK, host_cache_bytes=2000 * BLOCK)
    _, in_step = run(False, cache_memory_bytes=30 * BLOCK, host_cache_bytes=2000 * BLOCK)
    _, roomy = run(False, num_pages=512)
    assert overlapped.metrics().promotions_overlapped_total > 0
    assert [t for t, _ in got] == [t for t, _ in in_step] == [t for t, _ in roomy]
    assert [c for _, c in got] == [c for _, c in in_step] and sum(c for _, c in got) > 0


def test_a_host_checkpoint_a_conversation_moved_past_goes_to_the_host_tiers_cold_end(tiny_model_dir):
    """A turn that resumed from a checkpoint on the host and stored a deeper one leaves the old one
    colder than anything on the host (rule 7, as on the device): under pressure it goes before the
    states other conversations have yet to resume from. Restoring it made it the hottest."""
    engine = tiered(tiny_model_dir)
    first = prompt(4 * PS + 5, seed=70)
    reply = run_alone(engine, first, GREEDY).token_ids
    for i in range(3):  # other conversations push its pages and states out to the host
        run_salted(engine, prompt(5 * PS, seed=71 + i), salt=f"other-{i}")
    second = first + reply + prompt(2 * PS, seed=75)
    got = run_alone(engine, second, GREEDY)
    host = engine.cache.host
    resumed = [k for k, c in host.checkpoints.items() if c.position(PS) == got.cached_tokens]
    assert got.cached_tokens >= 4 * PS and resumed, "resumed from a host checkpoint"
    run_salted(engine, prompt(PS, seed=76), salt="next")  # a scheduling pass ends after the deeper store
    coldest = next(key for kind, key in host._lru if key in host.checkpoints)
    assert coldest == resumed[0]
    engine.check()
