"""The engine gives the same tokens however a request is scheduled: prefilled at once or in
chunks, alone or batched, with or without preemption; sampling is seeded (and validated:
tests/workers/test_sampling_params.py)."""

import pytest
import torch

from cairn.workers import Engine, SamplingParams
from tests.support.stepping import drain

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=2)


def prompts(lengths, vocab=211, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


@pytest.fixture(scope="module")
def path(hf_checkpoint):
    return hf_checkpoint("dense")


@pytest.fixture(scope="module")
def reference(path):
    """Each prompt alone, prefilled at once, plenty of pages."""
    engine = Engine.from_pretrained(path, num_pages=64, max_num_seqs=1, max_num_batched_tokens=512)
    ps = prompts([70, 1, 33, 5, 17])
    return ps, [engine.generate([p], GREEDY)[0] for p in ps]


def assert_same(outs, refs):
    for out, ref in zip(outs, refs):
        assert out.token_ids == ref.token_ids
        torch.testing.assert_close(torch.tensor([lp.logprob for lp in out.logprobs]),
                                   torch.tensor([lp.logprob for lp in ref.logprobs]), atol=1e-4, rtol=0)


@pytest.mark.parametrize("chunk", [1, 7, 64])
def test_chunked_prefill_gives_the_same_tokens(path, reference, chunk):
    ps, refs = reference
    engine = Engine.from_pretrained(path, num_pages=64, max_num_seqs=1, max_num_batched_tokens=chunk)
    assert_same([engine.generate([p], GREEDY)[0] for p in ps], refs)
    engine.check()


def test_batched_requests_of_different_lengths_give_the_same_tokens(path, reference):
    ps, refs = reference
    engine = Engine.from_pretrained(path, num_pages=64, max_num_seqs=8, max_num_batched_tokens=40)
    assert_same(engine.generate(ps, GREEDY), refs)
    assert engine.stats.steps < sum(len(p) for p in ps)  # decodes and prefills shared steps
    engine.check()
    assert engine.cache.pages.num_held == 0


def test_preemption_under_a_tiny_page_pool_gives_the_same_tokens(path):
    # Prompts fit the pool together; their growth does not, so decodes must preempt.
    ps = prompts([10, 9, 11, 10], seed=7)
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True, logprobs=2)
    alone = Engine.from_pretrained(path, num_pages=64, page_size=4, max_num_seqs=1)
    refs = [alone.generate([p], params)[0] for p in ps]
    engine = Engine.from_pretrained(path, num_pages=16, page_size=4, max_num_seqs=4)
    outs = engine.generate(ps, params)
    assert engine.scheduler.num_preemptions > 0
    assert sum(o.num_preemptions for o in outs) == engine.scheduler.num_preemptions
    assert_same(outs, refs)
    engine.check()
    assert engine.cache.pages.num_held == 0


def test_max_num_seqs_bounds_running_sequences(path):
    engine = Engine.from_pretrained(path, num_pages=64, max_num_seqs=2)
    for p in prompts([5, 6, 7, 8]):
        engine.add_request(p, SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    running = []
    drain(engine, each=lambda _: running.append(len(engine.scheduler.running)))
    assert running and max(running) == 2, "two at a time, never more"


def test_seeded_sampling_is_reproducible_alone_batched_and_preempted(path):
    p = prompts([9])[0]
    params = SamplingParams(max_tokens=10, temperature=0.9, top_p=0.9, top_k=50, seed=1234, ignore_eos=True)
    alone = Engine.from_pretrained(path, num_pages=64).generate([p], params)[0].token_ids
    again = Engine.from_pretrained(path, num_pages=64, seed=99).generate([p], params)[0].token_ids
    batched = Engine.from_pretrained(path, num_pages=64).generate(prompts([9, 40, 3], seed=5) + [p], params)[-1]
    tight = Engine.from_pretrained(path, num_pages=3, max_num_batched_tokens=8).generate(
        prompts([30, 25], seed=6) + [p], params)
    assert alone == again == batched.token_ids == tight[-1].token_ids
    other = SamplingParams(max_tokens=10, temperature=0.9, top_p=0.9, top_k=50, seed=4321, ignore_eos=True)
    assert Engine.from_pretrained(path, num_pages=64).generate([p], other)[0].token_ids != alone


def test_top_k_one_and_temperature_zero_are_greedy(path):
    p = prompts([12])[0]
    engine = Engine.from_pretrained(path, num_pages=64)
    greedy = engine.generate([p], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))[0].token_ids
    topk1 = engine.generate([p], SamplingParams(max_tokens=8, temperature=1.5, top_k=1, ignore_eos=True))[0]
    assert topk1.token_ids == greedy


def test_top_p_keeps_only_the_nucleus(path):
    engine = Engine.from_pretrained(path, num_pages=64)
    p = prompts([10])[0]
    probs = torch.softmax(engine.prompt_logits(p)[-1], -1)
    top = int(probs.argmax())
    tiny_p = [engine.generate([p], SamplingParams(max_tokens=1, top_p=1e-6, seed=s))[0].token_ids[0]
              for s in range(20)]
    assert set(tiny_p) == {top}


def test_stop_token_ids_and_max_tokens_end_a_request(path):
    engine = Engine.from_pretrained(path, num_pages=64)
    p = prompts([10])[0]
    free = engine.generate([p], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))[0]
    assert len(free.token_ids) == 6 and free.finish_reason == "length"
    stop = free.token_ids[2]
    out = engine.generate([p], SamplingParams(max_tokens=6, temperature=0, stop_token_ids=[stop]))[0]
    assert out.token_ids == free.token_ids[:free.token_ids.index(stop) + 1]
    assert out.finish_reason == "stop"


def test_generation_stops_at_max_model_len(path):
    engine = Engine.from_pretrained(path, num_pages=64, max_model_len=20)
    out = engine.generate(prompts([15]), SamplingParams(max_tokens=100, temperature=0, ignore_eos=True))[0]
    assert len(out.token_ids) == 5 and out.finish_reason == "length"


def test_abort_frees_pages_and_slot(path):
    engine = Engine.from_pretrained(path, num_pages=64, max_num_seqs=2)
    rid = engine.add_request(prompts([40])[0], SamplingParams(max_tokens=50, ignore_eos=True))
    engine.step()
    assert engine.cache.pages.num_held > 0
    final = engine.abort(rid)
    assert final.finish_reason == "abort" and final.request_id == rid
    assert engine.cache.pages.num_held == 0 and not engine.cache.running_slots
    assert not engine.has_unfinished()
    assert engine.abort(rid) is None


def test_invalid_prompts_are_rejected_without_touching_the_engine(path):
    engine = Engine.from_pretrained(path, num_pages=4, max_model_len=100)
    for bad, match in [([], "at least one"), ([5, 211], r"\[0, 211\)"), ([5, -1], "integers"),
                       (list(range(100)), "at most 99"), ([1] * 70, "KV pages")]:
        with pytest.raises(ValueError, match=match):
            engine.add_request(bad, SamplingParams(max_tokens=1))
    with pytest.raises(ValueError, match="stop_token_ids"):
        engine.add_request([1], SamplingParams(stop_token_ids=[500]))
    assert not engine.has_unfinished()
    assert engine.generate([[1, 2, 3]], SamplingParams(max_tokens=2))[0].finished


def test_engine_options_are_checked_once_when_made_and_name_the_option_at_fault():
    import pickle

    from cairn.workers.engine_options import EngineOptionError, EngineOptions

    with pytest.raises(EngineOptionError, match=r"unknown engine option\(s\) \['page_sise'\]") as unknown:
        EngineOptions.from_config({"page_sise": 16})
    assert unknown.value.option == "page_sise"
    with pytest.raises(ValueError, match="page_size must be a positive integer") as bad:  # a ValueError too
        EngineOptions(page_size=0)
    assert bad.value.option == "page_size" and pickle.loads(pickle.dumps(bad.value)).option == "page_size"
    with pytest.raises(EngineOptionError, match="cache_policy must be one of") as policy:
        EngineOptions.from_config({"cache_policy": "lru"})
    assert policy.value.option == "cache_policy"
    with pytest.raises(EngineOptionError, match="engine_options must map option names to values"):
        EngineOptions.from_config(["page_size"])
    base = EngineOptions(warm_up=True)
    assert EngineOptions.from_config({"page_size": 8}, base) == EngineOptions(page_size=8, warm_up=True)
    assert base == EngineOptions(warm_up=True), "a new value: the base is not changed"
    with pytest.raises(TypeError, match="not both"):
        Engine.from_pretrained("unused", EngineOptions(), page_size=8)


def test_auto_dtype_is_bf16_on_a_cpu_with_native_bf16_and_the_engine_names_what_it_runs(tiny_model_dir, monkeypatch):
    """auto picks bf16 where the CPU computes it natively (faster than fp32 there), fp32
    elsewhere, the checkpoint's dtype on CUDA; the engine's options and spec name the dtype it
    runs, and agree with the spec a deploy reads from the directory."""
    from cairn.workers import EngineOptions, EngineSpec, precision
    from cairn.workers.precision import choose_dtype

    monkeypatch.delenv("CAIRN_DTYPE")
    for native, want in ((True, "bfloat16"), (False, "float32")):
        monkeypatch.setattr(precision, "native_bf16_cpu", lambda: native)
        engine = Engine.from_pretrained(tiny_model_dir, num_pages=32)
        assert str(next(engine.model.parameters()).dtype) == f"torch.{want}" and engine.options.dtype == want
        assert engine.spec == EngineSpec.from_model_dir(tiny_model_dir, EngineOptions(num_pages=32))
        out = engine.generate([[1, 2, 3, 4, 5]], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))[0]
        assert len(out.token_ids) == 4
    assert choose_dtype("auto", "bfloat16", "cuda") == "bfloat16" and choose_dtype("float16", "float32", "cpu") == "float16"
    monkeypatch.setenv("CAIRN_DTYPE", "float32")
    assert choose_dtype("auto", "bfloat16", "cuda") == "float32"
    monkeypatch.setenv("CAIRN_DTYPE", "int4")
    with pytest.raises(ValueError, match="CAIRN_DTYPE"):
        choose_dtype("auto", "float32", "cpu")
