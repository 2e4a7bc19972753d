"""Async scheduling (`EngineOptions.async_scheduling`, `Engine.step`) moves when the host plans a
step and reads the last one's tokens, never what a request gets: with it on and off (seeded), the
tokens, logprobs, finish reasons, cached_tokens and preemptions are the same, and so is what the
cache holds afterwards; a sequence that stops at a step gets nothing from the step planned before
its stop was read. Each test also checks that steps were in fact planned ahead, and that rows of
stopped sequences were in fact computed and dropped, so none passes with the overlap idle. The
OpenAI API's view (streaming, stop strings, n > 1, structured outputs) is
tests/api/test_api_async_scheduling.py."""

import pytest
import torch

from cairn.workers import Engine, SamplingParams
from tests.support.stepping import drive

FAMILIES = ["dense", "q35_moe"]  # Qwen3-Next (dense MLP), Qwen3.5 (MoE)


def prompts(lengths, vocab=211, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


def pair(path, **options) -> tuple[Engine, Engine]:
    return tuple(Engine.from_pretrained(path, async_scheduling=on, **options) for on in (False, True))


def assert_same(sync: list, overlapped: list) -> None:
    for i, (a, b) in enumerate(zip(sync, overlapped)):
        assert (b.token_ids, b.finish_reason, b.cached_tokens, b.num_preemptions) == \
            (a.token_ids, a.finish_reason, a.cached_tokens, a.num_preemptions), f"request {i}"
        assert (a.logprobs is None) == (b.logprobs is None)
        if a.logprobs:
            assert [[t for t, _ in lp.top] for lp in b.logprobs] == [[t for t, _ in lp.top] for lp in a.logprobs]
            # the same rows in another batch (the dropped rows are gone): equal up to summation order
            torch.testing.assert_close(torch.tensor([lp.logprob for lp in b.logprobs]),
                                       torch.tensor([lp.logprob for lp in a.logprobs]), atol=1e-5, rtol=0)


def assert_cache_same(sync: Engine, overlapped: Engine) -> None:
    for engine in (sync, overlapped):
        engine.check()
        assert engine.cache.pages.num_held == 0
    assert overlapped.cache_contents() == sync.cache_contents()
    assert overlapped.host_contents() == sync.host_contents()


def mixed(ps: list[list[int]], stop_id: int) -> list[tuple[list[int], SamplingParams]]:
    """Greedy, seeded-sampled, penalised, min_tokens and stopping requests of different lengths."""
    params = [
        SamplingParams(max_tokens=9, temperature=0, ignore_eos=True, logprobs=2),
        SamplingParams(max_tokens=14, temperature=0.9, top_p=0.9, seed=5, ignore_eos=True,
                       repetition_penalty=1.3, presence_penalty=0.5, logprobs=1),
        SamplingParams(max_tokens=21, temperature=0, ignore_eos=True, stop_token_ids=[stop_id], min_tokens=2),
        SamplingParams(max_tokens=17, temperature=1.1, top_k=20, seed=11, ignore_eos=True, frequency_penalty=0.4),
        SamplingParams(max_tokens=3, temperature=0, ignore_eos=True, logit_bias={7: 5.0}),
    ]
    return list(zip(ps, params))


@pytest.fixture(scope="module", params=FAMILIES)
def path(request, hf_checkpoint):
    return hf_checkpoint(request.param)


def stopping_token(path, prompt) -> int:
    """A token the greedy continuation of `prompt` reaches at its fifth output, and not before."""
    out = Engine.from_pretrained(path, num_pages=64).generate(
        [prompt], SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))[0].token_ids
    assert out[4] not in out[:4], "pick another prompt: the fifth token comes earlier too"
    return out[4]


@pytest.mark.parametrize("graph_buffers", [False, True], ids=["eager", "graph-buffers"])
def test_every_request_gets_what_it_gets_without_async_scheduling(path, graph_buffers):
    """graph-buffers: decode steps run over the decode graphs' fixed buffers (`enforce_eager=False`,
    what CUDA replays), the drawn ids fed into them."""
    ps = prompts([30, 5, 17, 9, 12])
    requests = mixed(ps, stopping_token(path, ps[2]))
    sync, overlapped = pair(path, num_pages=64, page_size=8, max_num_seqs=5, enforce_eager=not graph_buffers)
    expected, got = drive(sync, requests), drive(overlapped, requests)
    assert expected[2].finish_reason == "stop" and len(expected[2].token_ids) == 5
    assert_same(expected, got)
    assert_cache_same(sync, overlapped)
    assert sync.async_steps.overlapped_steps == 0
    assert overlapped.async_steps.overlapped_steps >= sync.stats.steps // 2, "most decode steps are planned ahead"
    assert overlapped.async_steps.dropped_rows >= 3, "requests that stopped mid-batch had a row in the step after"


def test_a_sequence_that_stops_at_a_step_gets_no_token_from_the_next(path):
    ps = prompts([11, 6], seed=3)
    stop = stopping_token(path, ps[0])
    requests = [(ps[0], SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, stop_token_ids=[stop])),
                (ps[1], SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)),
                (ps[1], SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))]
    sync, overlapped = pair(path, num_pages=64, page_size=16, max_num_seqs=4)
    expected, got = drive(sync, requests), drive(overlapped, requests)  # (drive fails on a late output)
    assert [len(o.token_ids) for o in got] == [5, 2, 30] and got[0].token_ids[-1] == stop
    assert_same(expected, got)
    assert overlapped.async_steps.dropped_rows == 3  # each of the three ends was read after a step planned past it
    m = overlapped.metrics()  # /metrics: cairn_engine_steps_planned_ahead_total, cairn_engine_rows_dropped_total
    assert (m.steps_planned_ahead_total, m.rows_dropped_total) == (overlapped.async_steps.overlapped_steps, 3)
    assert m.steps_planned_ahead_total > 0 and sync.metrics().steps_planned_ahead_total == 0
    assert_cache_same(sync, overlapped)


def test_preemption_under_a_tiny_page_pool_is_the_same(path):
    ps = prompts([10, 9, 11, 10], seed=7)
    requests = [(p, SamplingParams(max_tokens=m, temperature=0, ignore_eos=True, logprobs=1))
                for p, m in zip(ps, (30, 22, 26, 18))]
    sync, overlapped = pair(path, num_pages=16, page_size=4, max_num_seqs=4)
    expected, got = drive(sync, requests), drive(overlapped, requests)
    assert sync.scheduler.num_preemptions > 0
    assert overlapped.scheduler.num_preemptions == sync.scheduler.num_preemptions
    assert_same(expected, got)
    assert overlapped.async_steps.overlapped_steps > 0
    assert_cache_same(sync, overlapped)


def test_an_abort_gives_the_tokens_its_caller_saw_and_the_next_turn_resumes_alike(path):
    ps = prompts([21, 13, 18], seed=9)
    requests = [(p, SamplingParams(max_tokens=25, temperature=0, ignore_eos=True)) for p in ps]
    sync, overlapped = pair(path, num_pages=64, page_size=4, max_num_seqs=3)
    expected = drive(sync, requests, abort_after={0: 7, 2: 12})
    got = drive(overlapped, requests, abort_after={0: 7, 2: 12})
    assert [o.finish_reason for o in got] == ["abort", "length", "abort"]
    assert [len(o.token_ids) for o in got] == [7, 25, 12]
    assert_same(expected, got)
    assert_cache_same(sync, overlapped)
    # the next turn of each aborted conversation resumes as deep on both
    turn = [(p + o.token_ids + [5, 6, 7], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
            for p, o in zip(ps, expected)]
    again_sync, again = drive(sync, turn), drive(overlapped, turn)
    assert [o.cached_tokens for o in again] == [o.cached_tokens for o in again_sync]
    assert min(o.cached_tokens for o in again) > 0
    assert_same(again_sync, again)


@pytest.mark.parametrize("host_tier", [False, True], ids=["tier-off", "tier-on"])
def test_multi_turn_conversations_under_memory_pressure_resume_alike(path, host_tier):
    """Three conversations of three turns in a cache that cannot hold them: evictions (and, with
    the host tier, demotions and promotions) happen, and every turn resumes as deep, with the same
    tokens, on both."""
    from cairn.workers import EngineOptions, EngineSpec

    block = EngineSpec.from_model_dir(path, EngineOptions(page_size=4)).page_bytes
    options = dict(page_size=4, max_num_seqs=3, cache_memory_bytes=48 * block,
                   host_cache_bytes=200 * block if host_tier else 0)
    sync, overlapped = pair(path, **options)
    histories = prompts([23, 17, 29], seed=13)
    results = {False: [], True: []}
    for turn in range(3):
        for engine, key in ((sync, False), (overlapped, True)):
            requests = [(h, SamplingParams(max_tokens=6 + 3 * i, temperature=0, ignore_eos=True, logprobs=1))
                        for i, h in enumerate(histories)]
            results[key].append(drive(engine, requests))
        assert_same(results[False][-1], results[True][-1])
        histories = [h + o.token_ids + prompts([5], seed=turn * 10 + i)[0]
                     for i, (h, o) in enumerate(zip(histories, results[False][-1]))]
    assert any(o.cached_tokens for turn in results[True][1:] for o in turn), "later turns resume"
    m_sync, m = sync.metrics(), overlapped.metrics()
    assert m.pages_evicted_total == m_sync.pages_evicted_total > 0
    if host_tier:
        assert m.pages_promoted_total == m_sync.pages_promoted_total > 0
    assert overlapped.async_steps.overlapped_steps > 0 and overlapped.async_steps.dropped_rows > 0
    assert_cache_same(sync, overlapped)
