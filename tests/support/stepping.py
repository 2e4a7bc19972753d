"""Driving an engine step by step in tests, bounded: a request the scheduler loses fails the test
in seconds, naming what is left, instead of spinning until the suite's timeout.

- `finish(engine, ids, max_steps)`: steps until every id in `ids` finished; their final outputs.
- `run_alone(engine, tokens, params, salt)`: one request (under cache salt `salt`, None: none)
  run to its end; its final output.
- `drain(engine, max_steps, each)`: steps until the engine has nothing unfinished, calling
  `each(outputs)` after every step; every output by request id.
- `drive(engine, requests, abort_after, max_steps)`: (prompt, params) requests run to their ends,
  request i aborted once its caller has seen `abort_after[i]` tokens; each one's final output.
  Fails if a request gets an output after its final one, or its outputs' counts and tokens do
  not add up to its final output's.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

MAX_STEPS = 2000


def finish(engine, ids: Iterable[str], max_steps: int = MAX_STEPS) -> dict:
    wanted, done = set(ids), {}
    for _ in range(max_steps):
        for out in engine.step():
            if out.finished and out.request_id in wanted:
                done[out.request_id] = out
        if len(done) == len(wanted):
            return done
    raise AssertionError(f"requests never finished in {max_steps} steps: {sorted(wanted - set(done))} "
                         f"(running {[s.request_id for s in engine.scheduler.running]}, "
                         f"waiting {len(engine.scheduler.waiting)})")


def run_alone(engine, tokens: list[int], params, salt: str | None = None, max_steps: int = MAX_STEPS):
    rid = engine.add_request(tokens, params, hash_root=engine.spec.hash_root(salt) if salt is not None else None)
    return finish(engine, [rid], max_steps)[rid]


def drain(engine, max_steps: int = MAX_STEPS, each: Callable[[list], None] | None = None) -> dict[str, list]:
    outs: dict[str, list] = {}
    for _ in range(max_steps):
        if not engine.has_unfinished():
            return outs
        step = engine.step()
        for out in step:
            outs.setdefault(out.request_id, []).append(out)
        if each is not None:
            each(step)
    raise AssertionError(f"the engine did not finish in {max_steps} steps: "
                         f"{[s.request_id for s in engine.scheduler.running]} running, "
                         f"{len(engine.scheduler.waiting)} waiting")


def drive(engine, requests, abort_after: dict[int, int] | None = None, max_steps: int = MAX_STEPS) -> list:
    abort_after = abort_after or {}
    ids = [engine.add_request(p, sp) for p, sp in requests]
    index = {rid: i for i, rid in enumerate(ids)}
    seen, final = [[] for _ in ids], [None] * len(ids)
    for _ in range(max_steps):
        if not engine.has_unfinished():
            break
        for out in engine.step():
            i = index[out.request_id]
            assert final[i] is None, f"request {i} got {out.new_token_ids} after its final output"
            seen[i] += out.new_token_ids
            assert out.num_output_tokens == len(seen[i])
            if out.finished:
                final[i] = out
                assert out.token_ids == seen[i]
        for i, n in abort_after.items():
            if final[i] is None and len(seen[i]) >= n:
                final[i] = engine.abort(ids[i])
    assert all(f is not None for f in final), "requests never finished"
    return final
