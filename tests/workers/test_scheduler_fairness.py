"""Tenants share one engine (`cairn.workers.scheduler`, `cairn.workers.tenant_queue`): a tenant holding every
sequence slot with long streams, or filling every step with long prefills, cannot keep another
tenant's short request waiting; the preempted sequences still compute what they compute alone;
with one tenant the schedule is first come, first served. Counted in engine steps, not seconds."""

import pytest

from cairn.workers import Engine, SamplingParams
from cairn.workers.tenant_queue import TenantQueue, fair_shares, slot_share
from tests.support.stepping import drain

LONG = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
SHORT = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def path(hf_checkpoint):
    return hf_checkpoint("dense")


def prompt(i: int, n: int) -> list[int]:
    return [(7 * i + 3 * k) % 200 + 1 for k in range(n)]


def steps_until_done(engine: Engine, request_id: str, limit: int = 400) -> tuple[int, dict]:
    """Steps until `request_id` finishes (and every output on the way, by request)."""
    outs: dict[str, list] = {}
    for step in range(1, limit + 1):
        for out in engine.step():
            outs.setdefault(out.request_id, []).append(out)
        if outs.get(request_id) and outs[request_id][-1].finished:
            return step, outs
    raise AssertionError(f"{request_id} did not finish in {limit} steps")


def run_to_end(engine: Engine, outs: dict) -> dict:
    for rid, got in drain(engine).items():
        outs.setdefault(rid, []).extend(got)
    return {rid: [t for o in got for t in o.new_token_ids] for rid, got in outs.items()}


def test_a_tenant_holding_every_slot_gives_one_to_another_tenants_short_request(path):
    """Four long streams of alice's fill max_num_seqs 4; bob's 2-token request runs within a few
    steps (her newest stream is preempted for it), where with one tenant it waits for a stream to
    end. Her streams still produce exactly what they produce without bob."""
    def flood(tenants: bool) -> tuple[int, dict, Engine]:
        engine = Engine.from_pretrained(path, num_pages=128, max_num_seqs=4, max_num_batched_tokens=64)
        for i in range(4):
            engine.add_request(prompt(i, 20), LONG, f"alice-{i}", tenant="alice" if tenants else None)
        early: dict[str, list] = {}
        for _ in range(3):
            for out in engine.step():
                early.setdefault(out.request_id, []).append(out)
        engine.add_request(prompt(9, 16), SHORT, "bob", tenant="bob" if tenants else None)
        steps, outs = steps_until_done(engine, "bob")
        return steps, {r: early.get(r, []) + outs.get(r, []) for r in {*early, *outs}}, engine

    fifo_steps, fifo_outs, fifo = flood(tenants=False)
    fair_steps, fair_outs, engine = flood(tenants=True)
    assert fifo_steps >= 35, "one tenant: bob waits for a slot to free, first come first served"
    assert fair_steps <= 3, f"two tenants: bob ran at once ({fair_steps} steps, against {fifo_steps})"
    assert engine.scheduler.num_fair_preemptions == 1
    tokens = run_to_end(engine, fair_outs)
    preempted = [rid for rid, outs in fair_outs.items() if outs[-1].num_preemptions]
    assert preempted == ["alice-3"], "the newest stream of the tenant above its share"
    assert tokens == run_to_end(fifo, fifo_outs), "the preempted stream computes the same tokens"
    engine.check()


def test_another_tenants_long_prefills_share_each_step_with_a_short_prompt(path):
    """Alice's long prompts would take every step's 64 tokens for 20 steps; bob's prompt of 48
    tokens gets half of each step (max-min fair) and its first token in 2 steps."""
    def first_token(tenants: bool) -> int:
        engine = Engine.from_pretrained(path, num_pages=256, max_num_seqs=8, max_num_batched_tokens=64)
        for i in range(4):
            engine.add_request(prompt(i, 320), SHORT, f"alice-{i}", tenant="alice" if tenants else None)
        engine.step()
        engine.add_request(prompt(9, 48), SamplingParams(max_tokens=1, temperature=0), "bob",
                           tenant="bob" if tenants else None)
        steps, _ = steps_until_done(engine, "bob")
        run_to_end(engine, {})
        engine.check()
        return steps

    fifo, fair = first_token(False), first_token(True)
    assert fifo >= 19 and fair == 2, (fifo, fair)


def test_the_queue_admits_the_oldest_of_the_tenant_running_the_fewest():
    from cairn.workers.sequence import Sequence

    queue = TenantQueue()
    seqs = {name: Sequence(name, [1], SHORT, tenant=name[0]) for name in ("a1", "a2", "b1", "c1", "b2")}
    for name in ("a1", "a2", "b1", "c1", "b2"):
        queue.append(seqs[name])
    assert queue.head({}) is seqs["a1"], "equal: the earliest arrival"
    assert queue.head({"a": 2, "b": 1, "c": 1}) is seqs["b1"]
    assert queue.head({"a": 2, "b": 1, "c": 1}, budgets={"a": 5, "b": 0, "c": 3}) is seqs["c1"]
    assert queue.head({}, budgets={}) is None
    queue.remove(seqs["a1"])
    queue.appendleft(seqs["a1"])  # preempted: back at the head of its own tenant's queue
    assert [s.request_id for s in queue] == ["a1", "a2", "b1", "b2", "c1"] and len(queue) == 5
    for s in list(queue):
        queue.remove(s)
    assert not queue and list(queue.tenants()) == []
    with pytest.raises(ValueError):
        queue.remove(seqs["a1"])


@pytest.mark.parametrize("demands,budget,shares", [
    ({"a": 1000, "b": 10}, 64, {"a": 54, "b": 10}),
    ({"a": 1000, "b": 1000}, 64, {"a": 32, "b": 32}),
    ({"a": 5, "b": 7, "c": 1000}, 64, {"a": 5, "b": 7, "c": 52}),
    ({"a": 100, "b": 100, "c": 100}, 64, {"a": 22, "b": 21, "c": 21}),
    ({"a": 3, "b": 4}, 64, {"a": 3, "b": 4}),
])
def test_the_step_is_split_max_min_fairly(demands, budget, shares):
    assert fair_shares(demands, budget) == shares
    assert sum(shares.values()) <= budget


def test_each_tenant_with_work_is_owed_an_equal_share_of_the_slots():
    assert [slot_share(n, 64) for n in (1, 2, 3, 64, 100)] == [64, 32, 21, 1, 1]
