"""The index actor on a real local Ray: one per name, restarted by Ray when it dies, resuming from
Redis when it has one and asking workers to resync when it does not; and the publisher that
feeds it coalesces, retries and never blocks its caller."""

import asyncio
import os
import time
import uuid

import pytest

from cairn.cache_service.events import HOST, AllCleared, EventBatch, EventStream, PagesRemoved, PagesStored, StateStored

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
ray = pytest.importorskip("ray")

from cairn.cache_service.actor import index_actor  # noqa: E402
from cairn.cache_service.publisher import ApplyResult, EventPublisher  # noqa: E402
from cairn.cluster.routing.routing_config import RoutingConfig  # noqa: E402
from cairn.cluster.routing.index_handle import IndexHandle  # noqa: E402

H = [bytes([i]) * 16 for i in range(40)]


def chain(n: int, start: int = 0) -> PagesStored:
    return PagesStored(tuple(H[start:start + n]), H[start - 1] if start else None)


@pytest.fixture(scope="module", autouse=True)
def _ray(ray_session):
    yield


@pytest.fixture
def actor_name():
    name = f"index-{uuid.uuid4().hex[:8]}"
    yield name
    try:
        ray.kill(ray.get_actor(name, namespace="cairn"), no_restart=True)
    except ValueError:
        pass


def restarted(actor, timeout_s: float = 30.0) -> dict:
    """Waits until the killed actor answers again; its stats."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            stats = ray.get(actor.stats.remote(), timeout=5)
            if stats["restarted"]:
                return stats
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            pass
        assert time.monotonic() < deadline, "Ray did not restart the index actor"
        time.sleep(0.1)


# ---- the actor ---------------------------------------------------------------------------------

def test_the_actor_is_created_once_by_name_and_scores_what_it_was_sent(actor_name):
    first = index_actor(actor_name, num_cpus=0.01)
    again = index_actor(actor_name, redis_url="redis://ignored:1", num_cpus=0.01)
    assert first._actor_id == again._actor_id, "get_if_exists: the second caller gets the first actor"
    a = EventStream("a")
    assert ray.get(first.apply.remote(a.batch([chain(4), StateStored(H[1])]).encode())) == ApplyResult(True, False)
    assert ray.get(again.score.remote(H[:5])) == {"a": (4, 2, 4, False)}, "(hit, state, device pages, state on host)"
    assert ray.get(first.apply.remote(a.batch([PagesStored((H[1], H[2], H[3]), H[0], HOST),
                                                StateStored(H[1], HOST)]).encode())) == ApplyResult(True, False)
    assert ray.get(again.score.remote(H[:5])) == {"a": (4, 2, 1, True)}
    assert ray.get(again.host_contents.remote("a")) == (frozenset(H[1:4]), frozenset([H[1]]))
    assert ray.get(again.contents.remote("a")) == (frozenset(H[:4]), frozenset([H[1]]))
    assert ray.get(again.host_contents.remote("nobody")) is None
    assert ray.get(first.score.remote(H[10:12])) == {}, "workers without a hit are left out"
    assert ray.get(first.apply.remote(b"garbage")) == ApplyResult(False, True)
    stats = ray.get(first.stats.remote())
    assert stats["backend"] == "memory" and stats["pages"] == 4 and stats["decode_errors"] == 1


def test_killed_without_redis_it_restarts_empty_and_asks_workers_to_resync(actor_name):
    actor, a = index_actor(actor_name, num_cpus=0.01), EventStream("a")
    ray.get(actor.apply.remote(a.batch([chain(3), StateStored(H[2])]).encode()))
    assert not ray.get(actor.needs_resync.remote("a"))
    ray.kill(actor, no_restart=False)
    stats = restarted(actor)
    assert stats["pages"] == 0 and stats["resync_unknown_workers"]
    assert ray.get(actor.needs_resync.remote("a")), "a worker it no longer knows must resync"
    assert ray.get(actor.apply.remote(a.batch([chain(1, start=3)]).encode())) == ApplyResult(False, True)
    assert ray.get(actor.workers_needing_resync.remote()) == {"a"}
    assert ray.get(actor.apply.remote(a.snapshot([(H[0], None), (H[1], H[0])], [H[1]]).encode())).applied
    assert ray.get(actor.score.remote(H[:3])) == {"a": (2, 2, 2, False)}
    assert not ray.get(actor.needs_resync.remote("a"))


def test_killed_with_redis_it_restarts_with_the_same_scores_and_seq_numbers(actor_name, redis_url):
    actor = index_actor(actor_name, redis_url=redis_url, namespace=f"t{uuid.uuid4().hex[:6]}", num_cpus=0.01)
    a, b = EventStream("a"), EventStream("b")
    ray.get(actor.apply.remote(a.batch([chain(6), StateStored(H[3])]).encode()))
    ray.get(actor.apply.remote(b.batch([chain(2)]).encode()))
    ray.get(actor.apply.remote(a.batch([PagesRemoved((H[5],))]).encode()))
    before = ray.get(actor.score.remote(H[:8]))
    ray.kill(actor, no_restart=False)
    stats = restarted(actor)
    assert stats["backend"] == "redis" and not stats["resync_unknown_workers"]
    assert ray.get(actor.score.remote(H[:8])) == before == {"a": (5, 4, 5, False), "b": (2, 0, 2, False)}
    assert ray.get(actor.apply.remote(a.batch([StateStored(H[4])]).encode())) == ApplyResult(True, False), \
        "a's stream continues at the next seq: nothing to resync"
    assert ray.get(actor.workers_needing_resync.remote()) == set()
    assert ray.get(actor.score.remote(H[:8]))["a"] == (5, 5, 5, False)


# ---- the publisher -----------------------------------------------------------------------------

class FakeIndex:
    """The index as the publisher reaches it (`call`): `apply(bytes)` awaits `gate`, then applies
    to a CacheIndex."""

    def __init__(self):
        from cairn.cache_service.index import CacheIndex

        self.index, self.calls, self.gate, self.fail = CacheIndex(), [], asyncio.Event(), 0
        self.gate.set()

    async def call(self, method, *args):
        return await getattr(self, method)(*args)

    async def apply(self, data):
        self.calls.append(data)
        await self.gate.wait()
        if self.fail:
            self.fail -= 1
            raise ConnectionError("actor restarting")
        applied = self.index.apply(data)
        return ApplyResult(applied, not applied and self.index.needs_resync(EventBatch.decode(data).worker_id))

    async def needs_resync(self, worker):
        return self.index.needs_resync(worker)


class FakeEngine:
    """What a replica's engine reports: numbered batches, and a snapshot on demand."""

    def __init__(self):
        self.stream, self.pages, self.snapshots = EventStream("w"), [], 0

    def store(self, n: int):
        batch = self.stream.batch([PagesStored(tuple(H[len(self.pages):len(self.pages) + n]),
                                               H[len(self.pages) - 1] if self.pages else None)])
        self.pages += H[len(self.pages):len(self.pages) + n]
        return batch

    async def snapshot(self):
        self.snapshots += 1
        await asyncio.sleep(0)
        prev = [None, *self.pages[:-1]]
        return self.stream.snapshot(list(zip(self.pages, prev)), [])


def test_the_publisher_never_blocks_and_coalesces_what_queued_while_the_index_was_busy():
    async def main():
        index, engine = FakeIndex(), FakeEngine()
        publisher = EventPublisher("w", index, engine.snapshot, timeout_s=5.0)
        index.gate.clear()  # the index hangs
        publisher.publish(engine.stream.snapshot([], []))
        await asyncio.sleep(0.01)  # the opening snapshot is in flight, stuck
        start = time.perf_counter()
        for _ in range(30):
            publisher.publish(engine.store(1))
        elapsed = time.perf_counter() - start
        index.gate.set()
        assert await publisher.flush(5.0)
        await publisher.close()
        return elapsed, index, engine, publisher.stats

    elapsed, index, engine, stats = asyncio.run(main())
    assert elapsed < 0.05, f"publish() blocked for {elapsed:.3f}s"
    assert len(index.calls) == 2, "the opening snapshot, then all 30 batches as one"
    assert stats["coalesced"] == 29 and engine.snapshots == 0
    assert index.index.contents("w") == (frozenset(H[:30]), frozenset())


def test_the_publisher_retries_the_same_bytes_and_resyncs_when_the_index_forgot():
    async def main():
        index, engine = FakeIndex(), FakeEngine()
        publisher = EventPublisher("w", index, engine.snapshot, timeout_s=1.0, backoff_s=(0.01, 0.05))
        publisher.publish(engine.store(2))  # not a snapshot: the publisher opens with one anyway
        assert await publisher.flush(5.0)
        assert engine.snapshots == 1
        index.fail = 2
        publisher.publish(engine.store(1))
        assert await publisher.flush(5.0)
        retried = index.calls[-3:]
        index.index = type(index.index)()  # the index restarted empty
        publisher.publish(engine.store(1))
        assert await publisher.flush(5.0)
        await publisher.close()
        return index, engine, publisher.stats, retried

    index, engine, stats, retried = asyncio.run(main())
    assert retried[0] == retried[1] == retried[2] and stats["send_failures"] == 2
    assert engine.snapshots == 2, "the forgetful index refused the gap and got a snapshot"
    assert index.index.contents("w") == (frozenset(H[:4]), frozenset())


def test_a_snapshot_drops_the_queued_batches_it_supersedes_and_keeps_later_ones():
    async def main():
        index, engine = FakeIndex(), FakeEngine()
        publisher = EventPublisher("w", index, engine.snapshot, max_queued=4)
        index.gate.clear()
        publisher.publish(engine.stream.snapshot([], []))
        await asyncio.sleep(0.01)
        for _ in range(6):  # overflows the queue: it is dropped and a snapshot is due
            publisher.publish(engine.store(1))
        index.gate.set()
        assert await publisher.flush(5.0)
        publisher.publish(engine.store(1))
        publisher.publish(engine.stream.batch([AllCleared()]))
        publisher.publish(engine.store(1))
        assert await publisher.flush(5.0)
        await publisher.close()
        return index, engine, publisher.stats

    index, engine, stats = asyncio.run(main())
    assert stats["overflows"] == 1 and engine.snapshots == 1
    assert index.index.contents("w") == (frozenset([H[7]]), frozenset()), "AllCleared, then page 7"


def test_a_publisher_feeds_the_real_actor_through_its_restart(actor_name):
    actor = index_actor(actor_name, num_cpus=0.01)

    async def main():
        engine = FakeEngine()
        handle = IndexHandle(RoutingConfig(index_actor_name=actor_name), actor=actor)  # as a replica has it
        publisher = EventPublisher("w", handle, engine.snapshot, timeout_s=2.0, poll_interval_s=0.2,
                                   backoff_s=(0.05, 0.2))
        publisher.publish(engine.stream.snapshot([], []))
        for _ in range(5):
            publisher.publish(engine.store(2))
        assert await publisher.flush(10.0)
        ray.kill(actor, no_restart=False)
        await asyncio.sleep(0.5)
        publisher.publish(engine.store(2))  # sent into the restart: retried, refused as a gap, resynced
        deadline = time.monotonic() + 30
        while True:
            try:
                if (await actor.score.remote(H[:12])).get("w") == (12, 0, 12, False):
                    break
            except ray.exceptions.RayActorError:  # still restarting
                pass
            assert time.monotonic() < deadline, "the restarted index never got the worker back"
            await asyncio.sleep(0.1)
        await publisher.close(drop_worker=True)
        return engine, publisher.stats

    engine, stats = asyncio.run(main())
    assert engine.snapshots >= 1
    assert ray.get(actor.stats.remote())["workers"] == 0, "close(drop_worker=True) made the index forget it"


def test_a_publisher_feeds_the_successor_of_an_actor_killed_for_good(actor_name):
    actor = index_actor(actor_name, num_cpus=0.01)

    async def main():
        engine = FakeEngine()
        handle = IndexHandle(RoutingConfig(index_actor_name=actor_name), actor=actor)
        publisher = EventPublisher("w", handle, engine.snapshot, timeout_s=2.0, poll_interval_s=0.2,
                                   backoff_s=(0.05, 0.2))
        publisher.publish(engine.stream.snapshot([], []))
        publisher.publish(engine.store(4))
        assert await publisher.flush(10.0)
        ray.kill(actor, no_restart=True)  # gone: the handle looks the name up again, which creates a new one
        publisher.publish(engine.store(2))
        deadline = time.monotonic() + 30
        while True:
            successor = handle.current()
            if successor is not None and successor._actor_id != actor._actor_id:
                try:
                    if (await successor.score.remote(H[:6])).get("w") == (6, 0, 6, False):
                        break
                except ray.exceptions.RayActorError:  # still starting
                    pass
            assert time.monotonic() < deadline, "the publisher never reached a successor with all its pages"
            await asyncio.sleep(0.1)
        await publisher.close()
        return successor, engine

    successor, engine = asyncio.run(main())
    assert ray.get_actor(actor_name, namespace="cairn")._actor_id == successor._actor_id, "the one registered now"
    assert engine.snapshots >= 1, "the new actor did not know the worker: it resynced"


# ---- the router in a real Serve deployment -------------------------------------------------------

@pytest.mark.parametrize("index_mode", ["mirror", "remote"])
def test_a_serve_deployment_routes_to_the_replica_the_index_names(actor_name, index_mode):
    from ray import serve

    from cairn.cluster.routing.router import replica_worker_id
    from cairn.workers.request import GenerateRequest

    def request_of(page_hashes: list, num_prompt_tokens: int) -> GenerateRequest:
        return GenerateRequest("r", [0] * num_prompt_tokens, prompt="hi", page_hashes=page_hashes)

    config = RoutingConfig(index_actor_name=actor_name, index_mode=index_mode, index_timeout_ms=2000,
                           predicted_holder_ttl_s=0, routing_stats_period_s=0.5, page_size=16, recurrent=True,
                           page_bytes=8192, state_bytes=16896, fetch=False)  # the index's choice, not a move
    index = index_actor(actor_name, num_cpus=0.01)

    @serve.deployment(num_replicas=2, ray_actor_options={"num_cpus": 0},
                      request_router_config=config.request_router_config())
    class Engine:
        def __init__(self):  # the replica names itself the way the router names it
            self.worker_id = replica_worker_id(serve.get_replica_context().replica_id)

        async def __call__(self, request) -> str:
            return self.worker_id

        def record_routing_stats(self) -> dict:
            return dict(running_requests=0, waiting_requests=0, pages_in_use=1, pages_total=10)

    serve.start(proxy_location="Disabled")
    try:
        handle = serve.run(Engine.bind(), name="routing-app", route_prefix=None)
        replicas, deadline = set(), time.monotonic() + 30
        while len(replicas) < 2:  # the handle may learn of the second replica a moment after the first
            replicas.add(handle.remote(request_of([], 8)).result(timeout_s=30))
            assert time.monotonic() < deadline, f"routed by load, requests never reached a second replica: {replicas}"
        assert all(r.startswith("SERVE_REPLICA::routing-app#Engine#") for r in replicas)
        target = sorted(replicas)[0]
        events = EventStream(target)
        ray.get(index.apply.remote(events.batch([PagesStored(tuple(H[:30]), None), StateStored(H[29])]).encode()))
        hot = request_of(H[:30], 30 * 16 + 3)
        streak, deadline = 0, time.monotonic() + 30
        while streak < 3:  # the first requests may beat the router's lookup of the index: routed by load
            streak = streak + 1 if handle.remote(hot).result(timeout_s=30) == target else 0
            assert time.monotonic() < deadline, "the router never followed the index"
        assert [handle.remote(hot).result(timeout_s=30) for _ in range(8)] == [target] * 8
    finally:
        serve.shutdown()


def test_ray_head_in_a_redis_url_is_the_head_nodes_address(ray_session):
    from cairn.cache_service.actor import resolve_head

    head = next(n["NodeManagerAddress"] for n in ray_session.nodes() if "node:__internal_head__" in n["Resources"])
    assert resolve_head("redis://ray-head:6380/0") == f"redis://{head}:6380/0"
    assert resolve_head("redis://:secret@ray-head:6380/2") == f"redis://:secret@{head}:6380/2"
    assert resolve_head("redis://10.0.0.7:6380/0") == "redis://10.0.0.7:6380/0"
    assert resolve_head(None) is None
