"""The kernel warm-up: after `Engine.warm_up`, no step compiles a kernel.

An engine on a GPU runs Triton kernels compiled; here the same engine runs them interpreted on
CPU tensors (`routed_as(INTERPRETED_CUDA)`), and `compile_watch` counts, per launch, the
specialisation key a compiled launch would compile under. So these tests assert, on CPU, what a GPU
would compile: nothing after warm-up, whatever mix of prefills, decodes, chunked prompts, resumes
and sampling follows; and, without the kernel warm-up, the first steps do compile, which the
engine logs and counts (`kernel_compiles_after_warm_up_total` in its metrics).
"""

from __future__ import annotations

import logging
import random

import pytest

from cairn.kernels.common import compile_watch, dispatch
from cairn.workers import kernel_warm_up
from cairn.workers.engine import Engine
from cairn.workers.sampling_params import SamplingParams


@pytest.fixture
def interpreted_cuda():
    with dispatch.routed_as(dispatch.INTERPRETED_CUDA):
        yield


def engine_of(model_dir) -> Engine:
    # decode graphs' buckets as on CUDA (eager here); a token budget that chunks longer prompts
    return Engine.from_pretrained(model_dir, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=256,
                                  enforce_eager=False)


def mixed_workload(engine: Engine, seed: int) -> None:
    """Prompts of 1 to 150 tokens (so chunked past 64), some sharing a prefix with an earlier one
    (resumes), greedy and sampled, admitted while others decode."""
    rng = random.Random(seed)
    vocab = engine.config.vocab_size
    earlier = [rng.randrange(vocab) for _ in range(40)]
    prompts = [[rng.randrange(vocab) for _ in range(n)] for n in (1, 17, 150)] + [earlier + [5, 6, 7]]
    params = [SamplingParams(max_tokens=rng.randrange(2, 6), temperature=t, seed=rng.randrange(99), ignore_eos=True)
              for t in (0.0, 0.8, 0.0, 1.0)]
    engine.generate([earlier], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    first = engine.add_request(prompts[0], params[0])
    engine.step()
    for p, sp in zip(prompts[1:], params[1:]):
        engine.add_request(p, sp)
        engine.step()
    while engine.has_unfinished():
        engine.step()
    assert first not in engine._requests


@pytest.mark.slow
def test_after_warm_up_no_step_compiles_a_kernel(demo_model, fresh_compile_watch, interpreted_cuda, caplog):
    engine = engine_of(demo_model("qwen3_5_moe"))
    with caplog.at_level(logging.INFO, logger="cairn.workers.engine"):
        engine.warm_up()
    warmed = compile_watch.compiles()
    kernels = {kernel for kernel, _ in compile_watch.seen()}
    assert {"_gate_up_kernel", "_align_count_kernel", "_prefill_kernel", "_decode_kernel", "_chunk_scan_kernel",
            "_copy_slots_kernel"} <= kernels, kernels
    assert "kernel compiles" in caplog.text  # the warm-up logs what it did
    # the engine's bookkeeping is as before: the warm-up's requests left nothing behind
    assert engine.stats.steps == 0 and engine.cache.pages.num_cached == 0 and not engine.scheduler.has_work()
    mixed_workload(engine, seed=1)
    assert compile_watch.compiles() == warmed, compile_watch.seen()[warmed:]
    metrics = engine.metrics()
    assert metrics.kernel_compiles_total == warmed and metrics.kernel_compiles_after_warm_up_total == 0


def test_a_compile_after_warm_up_is_logged_and_counted(demo_model, fresh_compile_watch, interpreted_cuda, monkeypatch,
                                                       caplog):
    engine = engine_of(demo_model("qwen3_5"))
    monkeypatch.setattr("cairn.workers.engine.runs_triton", lambda device: False)  # warm-up without the kernels
    engine.warm_up()
    with caplog.at_level(logging.WARNING, logger="cairn.workers.engine"):
        engine.generate([[1, 2, 3]], SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
    assert engine.late_compiles > 0 and engine.metrics().kernel_compiles_after_warm_up_total == engine.late_compiles
    assert "compiled" in caplog.text and "after warm-up" in caplog.text and "_prefill_kernel" in caplog.text


def test_prefill_sizes_reach_every_power_of_two_and_the_budget():
    assert kernel_warm_up.prefill_sizes(64, 254) == [1, 2, 4, 8, 16, 32, 64]
    assert kernel_warm_up.prefill_sizes(100, 254) == [1, 2, 4, 8, 16, 32, 64, 100]
    assert kernel_warm_up.prefill_sizes(8192, 50) == [1, 2, 4, 8, 16, 32, 50]


def test_scratch_bookkeeping_refuses_an_engine_with_requests(tiny_model_dir):
    engine = Engine.from_pretrained(tiny_model_dir, max_num_seqs=2, max_model_len=128)
    engine.add_request([1, 2, 3], SamplingParams(max_tokens=2))
    with pytest.raises(Exception, match="without requests"):
        with engine.scratch_bookkeeping():
            pass


@pytest.mark.slow
def test_a_speculating_engine_compiles_nothing_after_warm_up(tmp_path, fresh_compile_watch, interpreted_cuda):
    """With `num_speculative_tokens` 2 (the default mode: a verify segment is a prefill chunk
    that saves its states at each offset), requests that decode with drafts beside a prefill
    compile nothing the warm-up did not: verify steps and the MTP head's passes take the
    kernels and specialisations prompts and decodes do."""
    from cairn.workers.demo import write_demo_model

    path = write_demo_model(tmp_path / "spec", size="tiny", arch="qwen3_5_moe", mtp=True)
    engine = Engine.from_pretrained(path, max_num_seqs=2, max_num_batched_tokens=8, max_model_len=48,
                                    enforce_eager=False, num_speculative_tokens=2, speculative_adaptive=False)
    engine.warm_up()
    warmed = compile_watch.compiles()
    rng = random.Random(3)
    first = engine.add_request([rng.randrange(200) for _ in range(7)],
                               SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))
    for _ in range(3):
        engine.step()
    engine.add_request([rng.randrange(200) for _ in range(11)], SamplingParams(max_tokens=6, temperature=0.8, seed=1))
    while engine.has_unfinished():
        engine.step()
    assert first not in engine._requests and engine.speculation.drafts > 0
    assert compile_watch.compiles() == warmed, compile_watch.seen()[warmed:]
