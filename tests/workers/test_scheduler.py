"""The scheduler's contracts, on the real engine with a pool too small for its requests: a
preempted sequence goes back to the head of the waiting queue with nothing computed (it is the
next admitted, before anyone who arrived after it), and every request finishes. Engines are driven
by a step-bounded loop, so a request that is lost fails here in seconds, not at the suite's
timeout."""

import pytest
import torch

from cairn.workers import Engine, SamplingParams
from cairn.workers.sequence import Status
from tests.support.stepping import finish


def drive(engine: Engine, requests: list[tuple[list[int], SamplingParams]], max_steps: int = 2000) -> dict:
    """Adds the requests, steps until all finish; their final outputs by id. Fails (naming what is
    left) past `max_steps`."""
    return finish(engine, [engine.add_request(p, sp) for p, sp in requests], max_steps)


def test_a_preempted_sequence_heads_the_queue_with_nothing_computed_and_all_finish(demo_model):
    engine = Engine.from_pretrained(demo_model("qwen3_next"), num_pages=16, page_size=4, max_num_seqs=4)
    sched, victims = engine.scheduler, []
    preempt = sched._preempt

    def watched(seq):
        preempt(seq)
        head = next(iter(sched.waiting))
        assert head is seq and seq.num_computed == 0 and seq.status is Status.WAITING and seq not in sched.running
        victims.append(seq)

    sched._preempt = watched
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, 400, (n,), generator=g).tolist() for n in (10, 9, 11, 10, 8)]
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    outs = drive(engine, [(p, params) for p in prompts])
    assert victims and sched.num_preemptions == len(victims)
    assert all(o.finish_reason == "length" and len(o.token_ids) == 30 for o in outs.values())
    assert sum(o.num_preemptions for o in outs.values()) == len(victims)
    engine.check()


def test_a_request_the_scheduler_loses_fails_the_batch_at_once_instead_of_hanging(demo_model):
    """A preempted sequence that never comes back to the queue (the mutation that only a hang
    caught before) leaves the engine with nothing to run: `Engine.generate` says which requests
    can never finish, at once, and the step-bounded helpers fail within their bound."""
    from cairn.workers.engine_errors import EngineError

    engine = Engine.from_pretrained(demo_model("qwen3_next"), num_pages=16, page_size=4, max_num_seqs=4)
    sched = engine.scheduler

    def lose(seq):  # released, but never requeued
        sched.running.remove(seq)
        sched.cache.release(seq)
        sched.num_preemptions += 1
    sched._preempt = lose
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, 400, (n,), generator=g).tolist() for n in (10, 9, 11, 10, 8)]
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    with pytest.raises(EngineError, match="can never finish"):
        engine.generate(prompts, params)
    assert sched.num_preemptions > 0
