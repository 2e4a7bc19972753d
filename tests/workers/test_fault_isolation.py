"""No request can hurt another inside the engine: a fault in one sequence's sampling, logits, stop
check, admission, page or checkpoint operation ends that sequence alone, with finish_reason
"error" and a reason, while the requests running beside it produce exactly the tokens they
produce without it; degenerate sampling values behave as users expect; admission never
livelocks, however tight the cache; a reused request id never touches the running request."""

import asyncio
import random

import pytest
import torch

from cairn.workers import EngineFront, Engine, RequestRejected, SamplingParams

GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


def prompts(lengths, seed=0, vocab=200):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


@pytest.fixture(scope="module")
def clean(tiny_model_dir):
    """The tokens of three bystanders run without any fault."""
    engine = Engine.from_pretrained(tiny_model_dir, num_pages=256, max_num_seqs=8, cache_policy="all")
    bystanders = prompts([40, 23, 57], seed=1)
    return bystanders, [o.token_ids for o in engine.generate(bystanders, GREEDY)]


def run(engine: Engine, requests: list[tuple[list[int], SamplingParams]]) -> dict[str, object]:
    ids = [engine.add_request(p, sp) for p, sp in requests]
    final: dict[str, object] = {}
    for _ in range(500):
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
        if len(final) == len(ids):
            return {rid: final[rid] for rid in ids}
    raise AssertionError(f"requests never finished: {set(ids) - set(final)}")


def inject(engine: Engine, point: str, target: str) -> None:
    """Makes `point` raise (or go wrong) for the request `target` only."""
    cache, scheduler = engine.cache, engine.scheduler

    def only_for_target(obj, name, seq_of=lambda *a, **k: a[0]):
        original = getattr(obj, name)

        def faulty(*args, **kwargs):
            if seq_of(*args, **kwargs).request_id == target:
                raise RuntimeError(f"injected fault in {name}")
            return original(*args, **kwargs)
        setattr(obj, name, faulty)

    if point == "sampling":
        only_for_target(engine.sampler, "_row_params", seq_of=lambda rows, seq, *rest: seq)
    elif point == "non-finite logits":
        execute = engine.runner.execute

        def nan_rows(plan, *args, **kwargs):
            logits = execute(plan, *args, **kwargs).clone()
            rows = [i for i, s in enumerate(plan.sampling_sequences()) if s.request_id == target]
            logits[rows] = float("nan")
            return logits
        engine.runner.execute = nan_rows
    elif point == "stop handling":
        class Exploding(tuple):
            def __contains__(self, token):
                raise RuntimeError("injected fault in the stop check")
        seq = next(s for s in scheduler.waiting if s.request_id == target)
        object.__setattr__(seq.params, "stop_token_ids", Exploding())
    elif point == "admission":
        only_for_target(cache, "admit")
    elif point == "page growth":
        only_for_target(cache, "grow")
    elif point == "page registration":
        only_for_target(cache, "register_pages")
    elif point == "checkpoint slot":
        take = cache.take_checkpoint_slot
        planning = scheduler.checkpoints_or_fail

        def plan_for(plan, seg):  # the slot is taken while the victim's checkpoints are planned
            cache.take_checkpoint_slot = (lambda: (_ for _ in ()).throw(RuntimeError("injected"))) \
                if seg.seq.request_id == target else take
            try:
                planning(plan, seg)
            finally:
                cache.take_checkpoint_slot = take
        scheduler.checkpoints_or_fail = plan_for
    elif point == "checkpoint commit":
        only_for_target(cache, "commit_checkpoint")
    elif point == "finish capture":
        only_for_target(cache, "finish_capture")
    else:
        raise ValueError(point)


POINTS = ["sampling", "non-finite logits", "stop handling", "admission", "page growth", "page registration",
          "checkpoint slot", "checkpoint commit", "finish capture"]


@pytest.mark.parametrize("point", POINTS)
def test_a_fault_in_one_sequence_ends_it_alone_and_its_neighbours_run_on(tiny_model_dir, clean, point):
    bystanders, expected = clean
    policy = "cairn" if point == "finish capture" else "all"  # `all` keeps no finish captures
    engine = Engine.from_pretrained(tiny_model_dir, num_pages=256, max_num_seqs=8, cache_policy=policy,
                                    max_num_batched_tokens=48)
    victim = prompts([45], seed=9)[0]
    sampled = SamplingParams(max_tokens=24, temperature=0.8, seed=3, ignore_eos=True)
    ids = [engine.add_request(p, GREEDY) for p in bystanders[:2]]
    own = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)  # its own: faults may be put in it
    victim_id = engine.add_request(victim, sampled if point == "sampling" else own)
    ids.append(engine.add_request(bystanders[2], GREEDY))
    inject(engine, point, victim_id)
    final: dict[str, object] = {}
    for _ in range(500):
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
        if len(final) == 4:
            break
    assert final[victim_id].finish_reason == "error" and final[victim_id].error, point
    assert [final[rid].token_ids for rid in ids] == expected, "the neighbours' tokens changed"
    assert all(final[rid].finish_reason == "length" for rid in ids)
    engine.check()
    assert engine.cache.pages.num_held == 0 and not engine.cache.running_slots, "the victim's holdings leaked"
    assert not engine.has_unfinished()
    again = run(engine, [(bystanders[0], GREEDY)])  # the engine serves on
    assert next(iter(again.values())).token_ids == expected[0]


def test_a_failed_forward_pass_fails_that_steps_requests_not_those_waiting(tiny_model_dir):
    engine = Engine.from_pretrained(tiny_model_dir, num_pages=256, max_num_seqs=1)
    first = engine.add_request(prompts([20])[0], GREEDY)
    waiting = engine.add_request(prompts([30], seed=2)[0], GREEDY)
    execute = engine.runner.execute
    engine.runner.execute = lambda plan, *a, **k: (_ for _ in ()).throw(RuntimeError("device lost"))
    outs = engine.step()
    assert [(o.request_id, o.finish_reason) for o in outs] == [(first, "error")]
    engine.runner.execute = execute
    done = [o for _ in range(100) for o in engine.step() if o.finished]
    assert [(o.request_id, o.finish_reason) for o in done] == [(waiting, "length")]
    engine.check()


def test_a_temperature_that_would_overflow_is_greedy_beside_other_requests(tiny_model_dir, clean):
    bystanders, expected = clean
    engine = Engine.from_pretrained(tiny_model_dir, num_pages=256, max_num_seqs=8, cache_policy="all")
    cold = SamplingParams(max_tokens=24, temperature=1e-40, ignore_eos=True)
    outs = engine.generate(bystanders + [bystanders[0]], [GREEDY] * 3 + [cold])
    assert [o.token_ids for o in outs[:3]] == expected and all(o.finish_reason == "length" for o in outs)
    assert outs[3].token_ids == expected[0], "1e-40 means greedy"


def test_a_resume_point_that_cannot_fit_an_idle_cache_falls_back_to_a_cold_start(tiny_model_dir):
    """A checkpoint after 5 pages (page size 2) of a cache with room for one running state, one
    checkpoint and 6 pages: resuming there needs the checkpoint kept, the running state and 9
    pages, which never fit; nothing else runs to free them. The request starts cold instead."""
    probe = Engine.from_pretrained(tiny_model_dir, page_size=2, num_pages=1).layout
    room = (2 * probe.slot_blocks + 6) * probe.block_bytes
    engine = Engine.from_pretrained(tiny_model_dir, page_size=2, cache_policy="all", max_num_seqs=2,
                                    cache_memory_bytes=room, max_num_batched_tokens=8)
    first = list(range(10, 20))
    engine.generate([first], SamplingParams(max_tokens=1, temperature=0))
    depths = [engine.cache.checkpoints.get(h).depth for h in engine.cache.checkpoints.hashes()]
    assert depths == [5], "the scene: one checkpoint, after page 5"
    out = run(engine, [(first + list(range(50, 58)), SamplingParams(max_tokens=1, temperature=0))])
    assert [(o.finish_reason, o.cached_tokens) for o in out.values()] == [("length", 0)]
    engine.check()


@pytest.mark.parametrize("policy", ["all", "cairn"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_every_accepted_request_finishes_under_tiny_caches(tiny_model_dir, policy, seed):
    """Page size 2 and room for a checkpoint or two beside a few pages: a request that extends a
    cached one must still run (it falls back to a cold start when its resume point cannot fit)."""
    rng = random.Random(seed)
    probe = Engine.from_pretrained(tiny_model_dir, page_size=2, num_pages=1).layout
    room = (2 * probe.slot_blocks + 6) * probe.block_bytes  # a running state, one checkpoint, 6 pages
    engine = Engine.from_pretrained(tiny_model_dir, page_size=2, cache_policy=policy, max_num_seqs=2,
                                    cache_memory_bytes=room, max_num_batched_tokens=8)
    history: list[list[int]] = []
    accepted = 0
    for turn in range(40):
        if history and rng.random() < 0.7:
            base = rng.choice(history)
            prompt = base[:rng.randint(1, len(base))] + [rng.randrange(200) for _ in range(rng.randint(1, 5))]
        else:
            prompt = [rng.randrange(200) for _ in range(rng.randint(1, 9))]
        params = SamplingParams(max_tokens=rng.randint(1, 4), temperature=0, ignore_eos=True)
        try:
            rid = engine.add_request(prompt, params)
        except RequestRejected:
            continue  # could never fit: refused at once, never halfway
        accepted += 1
        for _ in range(200):
            if not engine.has_unfinished():
                break
            engine.step()
        assert not engine.has_unfinished(), f"request {rid} ({len(prompt)} tokens) never finished"
        engine.check()
        history.append(prompt)
    assert accepted > 20


def test_a_reused_request_id_is_refused_and_the_running_request_finishes(tiny_model_dir):
    async def main():
        engine = EngineFront.from_pretrained(tiny_model_dir, num_pages=128)
        long = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
        first = engine.generate(prompts([30])[0], long, "same-id")
        first_out = await anext(first)
        with pytest.raises(RequestRejected) as refused:
            async for _ in engine.generate(prompts([10])[0], GREEDY, "same-id"):
                pass
        outs = [first_out] + [o async for o in first]
        await engine.close()
        return refused.value, outs

    refused, outs = asyncio.run(asyncio.wait_for(main(), 60))
    assert refused.param == "request_id"
    assert outs[-1].finish_reason == "length" and outs[-1].num_output_tokens == 40
