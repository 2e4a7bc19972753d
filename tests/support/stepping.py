"""Driving an engine step by step in tests, bounded: a request the scheduler loses fails the test
in seconds, naming what is left, instead of spinning until the suite's timeout.

- `finish(engine, ids, max_steps)`: steps until every id in `ids` finished; their final outputs.
- `run_alone(engine, tokens, params, salt)`: one request (under cache salt `salt`, None: none)
  run to its end; its final output.
- `drain(engine, max_steps, each)`: steps until the engine has nothing unfinished, calling
  `each(outputs)` after every step; every output by request id.
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
