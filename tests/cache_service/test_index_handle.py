"""The one way to the cache index actor: looked up off the event loop, one lookup at a time, a
failed lookup retried after a delay, and a successor found once the actor died for good. Fake
actors and lookups here (no Ray session); the real actor is in tests/ray/test_index_actor.py and
tests/ray/test_cluster.py."""

import asyncio
import os
import threading
import time

import pytest

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
ray = pytest.importorskip("ray")

from ray.exceptions import ActorDiedError  # noqa: E402

from cairn.cluster.routing.routing_config import RoutingConfig  # noqa: E402
from cairn.cluster.routing.index_handle import IndexHandle  # noqa: E402
from cairn.cluster.routing.ranker import IndexUnavailable  # noqa: E402

CFG = RoutingConfig(index_actor_name="test-index")


class FakeActor:
    """An actor handle stand-in: `.score.remote(hashes)` answers its name, or raises
    ActorDiedError once `dead`."""

    def __init__(self, name: str):
        self.name, self.dead, self.dropped = name, False, []
        actor = self

        class score:
            @staticmethod
            async def remote(hashes):
                if actor.dead:
                    raise ActorDiedError()
                return actor.name

        class drop_worker:
            @staticmethod
            def remote(worker):
                actor.dropped.append(worker)
        self.score, self.drop_worker = score, drop_worker


def test_the_lookup_runs_off_the_event_loop_and_current_never_waits():
    async def main():
        on_loop = threading.get_ident()
        threads = []

        def find():  # blocking Ray work
            threads.append(threading.get_ident())
            time.sleep(0.3)
            return FakeActor("a")
        handle = IndexHandle(CFG, find=find)
        start = time.perf_counter()
        assert handle.current() is None
        assert time.perf_counter() - start < 0.05, "current() waited for the lookup"
        ticks = 0
        while handle.current() is None:
            await asyncio.sleep(0.01)
            ticks += 1
        return on_loop, threads, ticks, handle

    on_loop, threads, ticks, handle = asyncio.run(main())
    assert len(threads) == 1 and threads[0] != on_loop, "one lookup, in a thread"
    assert ticks >= 10, "the loop kept running while the lookup blocked"
    assert handle.current().name == "a"


def test_callers_waiting_at_once_share_one_lookup():
    async def main():
        finds = []

        def find():
            finds.append(1)
            time.sleep(0.1)
            return FakeActor("a")
        handle = IndexHandle(CFG, find=find)
        answers = await asyncio.gather(*(handle.call("score", []) for _ in range(5)))
        return answers, finds

    answers, finds = asyncio.run(main())
    assert answers == ["a"] * 5 and len(finds) == 1


def test_a_failed_lookup_is_retried_after_the_delay_and_calls_fail_at_once_meanwhile():
    async def main():
        finds = []

        def find():
            finds.append(time.monotonic())
            if len(finds) == 1:
                raise ConnectionError("GCS unreachable")
            return FakeActor("a")
        handle = IndexHandle(CFG, find=find, retry_s=0.3)
        with pytest.raises(IndexUnavailable, match="GCS unreachable"):
            await handle.get()
        start = time.perf_counter()
        with pytest.raises(IndexUnavailable):
            await handle.call("score", [])
        fast = time.perf_counter() - start
        assert handle.current() is None and len(finds) == 1, "no second lookup before the delay"
        await asyncio.sleep(0.35)
        return await handle.call("score", []), finds, fast

    answer, finds, fast = asyncio.run(main())
    assert answer == "a" and len(finds) == 2 and finds[1] - finds[0] >= 0.3
    assert fast < 0.05, "while a retry is pending a call fails at once"


def test_an_actor_that_died_for_good_is_replaced_by_its_successor():
    async def main():
        actors = [FakeActor("first"), FakeActor("second")]
        found = list(actors)
        handle = IndexHandle(CFG, find=lambda: found.pop(0))
        assert await handle.call("score", []) == "first"
        actors[0].dead = True
        with pytest.raises(ActorDiedError):  # the call that met the dead actor still fails
            await handle.call("score", [])
        await asyncio.sleep(0.05)  # the successor is looked up at once, in the background
        successor = handle.current()
        return successor, await handle.call("score", [])

    successor, answer = asyncio.run(main())
    assert successor is not None and successor.name == answer == "second"


def test_successors_that_die_before_answering_are_replaced_after_a_doubling_delay():
    """A successor whose creation fails (its Redis is down) dies at its first call. Replacing it
    at once would start an actor process per call; the handle waits, longer each time, and goes
    back to replacing at once after one answered."""
    async def main():
        finds = []

        def find():
            finds.append(time.monotonic())
            actor = FakeActor(f"actor-{len(finds)}")
            actor.dead = len(finds) in (2, 3, 4)  # the successors 2..4 never come up
            return actor
        handle = IndexHandle(CFG, find=find, retry_s=0.5)
        assert await handle.call("score", []) == "actor-1"
        handle.current().dead = True  # killed for good after it answered
        errors = []
        deadline = time.monotonic() + 10.0
        while time.monotonic() < deadline:
            try:
                if await handle.call("score", []) == "actor-5":
                    break
            except (ActorDiedError, IndexUnavailable) as e:
                errors.append(type(e).__name__)
            await asyncio.sleep(0.01)
        return finds, errors

    finds, errors = asyncio.run(main())
    assert len(finds) == 5, f"one lookup per successor, not one per call: {len(finds)}"
    gaps = [b - a for a, b in zip(finds, finds[1:])]
    assert gaps[0] < 0.5, "an actor that had answered is replaced at once"
    assert gaps[1] >= 0.5 and gaps[2] >= 1.0 and gaps[3] >= 2.0, \
        f"0.5, 1, 2 s after each successor that never answered: {gaps}"
    assert errors.count("ActorDiedError") == 4 and "IndexUnavailable" in errors, \
        "meanwhile a call fails at once, without a lookup"


def test_a_fire_and_forget_call_is_sent_only_to_a_known_actor():
    async def main():
        actor = FakeActor("a")
        unknown = IndexHandle(CFG, find=lambda: actor)
        sent_before_found = unknown.call_nowait("drop_worker", "w1")
        known = IndexHandle(CFG, actor=actor)
        return sent_before_found, known.call_nowait("drop_worker", "w2"), actor.dropped

    assert asyncio.run(main()) == (False, True, ["w2"])


def test_without_ray_and_without_a_lookup_there_is_no_index(monkeypatch):
    from cairn.cache_service import actor

    looked_up = []
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(actor, "index_actor", lambda *a, **k: looked_up.append(a))

    async def main():
        handle = IndexHandle(CFG)
        assert handle.current() is None
        with pytest.raises(IndexUnavailable):
            await handle.get()
        await asyncio.sleep(0.05)
        return handle.current()

    assert asyncio.run(main()) is None and looked_up == [], "nothing looks for an actor, nothing starts Ray"
