"""The Ray Serve adapter (`cairn.cluster.routing.router`), driven by Serve's own fake replicas (no Ray
session), and the registry the ingress reads its routers through (`cairn.cluster.routing.router_registry`)."""

import asyncio
import random

from cairn.cluster.routing.cost import ReplicaLoad
from cairn.cluster.routing.ranker import AffinityRanker
from cairn.cluster.routing.router import replica_worker_id
from cairn.workers.request import FetchHint
from tests.support.routing_cases import CFG, H, Clock, request, routed
from tests.support.paths import REPO


def make_router(config=CFG, scores=None, delay_s=0.0, index=None):
    """A CacheAffinityRouter whose index actor is `index` (default: a fake that answers `scores`
    after `delay_s` and records dropped workers)."""
    from ray.serve._private.common import DeploymentHandleSource, DeploymentID

    from cairn.cluster.routing.index_handle import IndexHandle
    from cairn.cluster.routing.router import CacheAffinityRouter

    class FakeIndex:
        def __init__(self):
            self.dropped = []
            self.score = self.Method(self._score)
            self.drop_worker = self.Method(self.dropped.append)

        class Method:
            def __init__(self, fn):
                self.fn = fn

            def remote(self, *args):
                return self.fn(*args)

        async def _score(self, hashes):
            await asyncio.sleep(delay_s)
            return scores or {}

    router = CacheAffinityRouter(deployment_id=DeploymentID(name="engine", app_name="app"),
                                 handle_source=DeploymentHandleSource.UNKNOWN, use_replica_queue_len_cache=True)
    router.initialize_state(**config.router_kwargs())
    router.index = IndexHandle(config, actor=index if index is not None else FakeIndex())
    return router


def fake_replicas(n, stats=None):
    from ray.serve._private.test_utils import FakeRunningReplica

    class Replica(FakeRunningReplica):
        @property
        def routing_stats(self):
            return (stats or {}).get(self.replica_id.unique_id, {})

    out = [Replica(f"r{i}", max_ongoing_requests=4) for i in range(n)]
    for r in out:
        r.set_queue_len_response(0)
    return out


def pending(req, request_id="req-1"):
    from ray.serve._private.common import RequestMetadata
    from ray.serve.request_router import PendingRequest

    return PendingRequest(args=[req], kwargs={}, metadata=RequestMetadata(request_id=request_id,
                                                                          internal_request_id=request_id))


def test_with_fetch_the_serve_router_sends_the_hint_on_a_copy_and_routes_a_peers_ask_to_its_target_or_to_one_that_says_it_is_gone():
    from cairn.workers.request import ExportRequest

    async def main():
        replicas = fake_replicas(3)
        ids = [replica_worker_id(r.replica_id) for r in replicas]
        router = make_router(config=CFG.model_copy(update=dict(fetch=True)), scores={ids[2]: (60, 50)})
        router.update_replicas(replicas)
        original = request(60)
        pr = pending(original)
        await router.choose_replicas(replicas, pr)
        sent = pr.args[0]
        assert original.fetch is None, "the caller's request is not written"
        assert sent.fetch == FetchHint(ids[2], 50) and sent.prompt_token_ids == original.prompt_token_ids
        ask = ExportRequest(ids[1], original.page_hashes, 0, 50)
        ranks = await router.choose_replicas(replicas, pending(ask, "req-ask"))
        assert ranks == [[replicas[1]]], "a peer's ask goes to the replica it names, and nowhere else"
        gone = ExportRequest("no-such-replica", original.page_hashes, 0, 50)  # Serve dropped it: one that
        assert await router.choose_replicas(replicas, pending(gone, "req-gone")) == [replicas[:1]]  # says so
        assert await router.choose_replicas([], pending(gone, "req-none")) == []
    asyncio.run(main())


def test_the_serve_router_ranks_replicas_by_the_index_and_routes_to_the_best():
    async def main():
        replicas = fake_replicas(3)
        ids = [replica_worker_id(r.replica_id) for r in replicas]
        router = make_router(scores={ids[2]: (60, 50), ids[0]: (60, 10)})
        router.update_replicas(replicas)
        ranks = await router.choose_replicas(replicas, pending(request(60)))
        assert [[r.replica_id for r in rank] for rank in ranks] == [[replicas[i].replica_id] for i in (2, 0, 1)]
        pr = pending(request(60), "req-2")
        chosen = await router._choose_replica_for_request(pr)
        assert chosen is replicas[2]
        router.on_request_routed(pr, chosen.replica_id, None)
        assert router.ranker.loads[ids[2]].requests == 1
        router.on_request_completed(chosen.replica_id, "req-2")
        assert router.ranker.loads[ids[2]].requests == 0
        router.on_replica_actor_died(replicas[2].replica_id)
        assert router.index.current().dropped == [ids[2]] and replicas[2].replica_id not in router.curr_replicas
    asyncio.run(main())


def test_the_serve_router_reads_reported_routing_stats():
    async def main():
        stats = {"r0": dict(running_requests=6, waiting_requests=4, pages_in_use=10, pages_total=10)}
        replicas = fake_replicas(2, stats)
        ids = [replica_worker_id(r.replica_id) for r in replicas]
        router = make_router(scores={ids[0]: (10, 10)})
        router.update_replicas(replicas)
        ranks = await router.choose_replicas(replicas, pending(request(10)))
        return [rank[0] for rank in ranks] == [replicas[1], replicas[0]]
    assert asyncio.run(main())


def test_the_serve_router_falls_back_to_load_when_the_index_is_slow_and_counts_it():
    async def main():
        replicas = fake_replicas(2)
        ids = [replica_worker_id(r.replica_id) for r in replicas]
        router = make_router(scores={ids[1]: (60, 60)}, delay_s=1.0)
        router.update_replicas(replicas)
        router.ranker.loads[ids[1]] = ReplicaLoad(requests=1)
        ranks = await router.choose_replicas(replicas, pending(request(60)))
        return [rank[0] for rank in ranks], router.ranker.counts

    order, counts = asyncio.run(main())
    assert order[0].replica_id.unique_id == "r0" and counts["index_timeouts"] == 1


def test_the_serve_router_in_mirror_mode_scores_from_its_copy_of_the_index_feed():
    from cairn.cache_service.events import EventStream, PagesStored, StateStored
    from cairn.cache_service.feed import ChangeFeed
    from cairn.cache_service.index import CacheIndex

    index, feed = CacheIndex(), ChangeFeed(4_000_000)

    class FeedIndex:  # the actor's feed method, over a real index and feed
        class feed:
            @staticmethod
            async def remote(epoch, cursor, wait_s):
                if epoch == feed.epoch:
                    await feed.wait(cursor, wait_s)
                return feed.read(index, epoch, cursor)

    async def main():
        replicas = fake_replicas(3)
        ids = [replica_worker_id(r.replica_id) for r in replicas]
        router = make_router(config=CFG.model_copy(update=dict(index_mode="mirror")), index=FeedIndex())
        router.update_replicas(replicas)
        batch = EventStream(ids[1]).batch([PagesStored(tuple(H[:60]), None), StateStored(H[59])])
        feed.apply(index, batch, batch.encode())
        for _ in range(200):  # the long poll hands the batch over
            if router.mirror.score(H[:60]).get(ids[1]):
                break
            await asyncio.sleep(0.01)
        router.ranker.loads[ids[1]] = ReplicaLoad(requests=1)  # busier, but it holds the prompt's state
        first = [rank[0] for rank in await router.choose_replicas(replicas, pending(request(60)))][0]
        counts_fresh = dict(router.ranker.counts)
        router._mirror_sync.cancel()
        router.mirror.heard_at -= CFG.index_staleness_s + 1  # not heard from since: stale
        await router.choose_replicas(replicas, pending(request(60), "req-2"))
        return first, ids, counts_fresh, router.ranker.counts

    first, ids, fresh, stale = asyncio.run(main())
    assert replica_worker_id(first.replica_id) == ids[1] and fresh["index_fallbacks"] == 0
    assert stale["index_fallbacks"] == stale["index_unavailable"] == 1


def test_a_router_left_without_replicas_stops_following_the_index_until_replicas_come_back():
    """The app deleted or scaled to zero (Serve sends an empty replica set): a handle kept in a
    long-lived process must not poll, or re-create, an index no one uses any more; scaled up
    again, the router follows the index before the first request, as the ingress's does."""
    calls = []

    class CountingFeed:
        class feed:
            @staticmethod
            async def remote(epoch, cursor, wait_s):
                calls.append(epoch)
                await asyncio.sleep(0.01)
                raise TimeoutError("no answer")

    async def main():
        replicas = fake_replicas(2)
        router = make_router(config=CFG.model_copy(update=dict(index_mode="mirror")), index=CountingFeed())
        router.update_replicas(replicas)
        await asyncio.sleep(0.3)
        following = len(calls)
        sync = router._mirror_sync
        router.update_replicas([])
        await asyncio.sleep(0)
        stopped = sync.cancelled() or sync.done()
        before = len(calls)
        await asyncio.sleep(0.5)
        idle = len(calls) - before
        router.update_replicas(replicas)  # scaled up from zero
        await asyncio.sleep(0.3)
        return following, stopped, idle, len(calls) - before, router.ranker.counts["ranked"]
    following, stopped, idle, resumed, ranked = asyncio.run(main())
    assert following >= 1 and stopped, "with no replica left the feed's task ends"
    assert idle == 0, "no index call while the router has no replica"
    assert resumed >= 1 and ranked == 0, "replicas back: it follows the index again, before any request"


def test_an_index_actor_without_a_change_feed_turns_the_router_to_asking_it_per_request():
    async def main():
        replicas = fake_replicas(2)
        ids = [replica_worker_id(r.replica_id) for r in replicas]
        # an actor from an older cairn: score, no feed
        router = make_router(config=CFG.model_copy(update=dict(index_mode="mirror")), scores={ids[1]: (60, 60)})
        await asyncio.wait_for(router._mirror_sync, 5)
        router.update_replicas(replicas)
        router.ranker.loads[ids[1]] = ReplicaLoad(requests=1)
        ranks = await router.choose_replicas(replicas, pending(request(60)))
        return router._feed_missing, replica_worker_id(ranks[0][0].replica_id), ids, router.ranker.counts

    missing, first, ids, counts = asyncio.run(main())
    assert missing and first == ids[1] and counts["index_fallbacks"] == 0


def test_the_replica_worker_id_is_the_full_serve_replica_id():
    from ray.serve._private.common import DeploymentID, ReplicaID

    rid = ReplicaID("abc123", DeploymentID(name="engine", app_name="app"))
    assert replica_worker_id(rid) == rid.to_full_id_str() == "SERVE_REPLICA::app#engine#abc123"
    assert ReplicaID.from_full_id_str(replica_worker_id(rid)) == rid


def test_the_ray_prefix_router_reads_the_prompt_when_messages_is_none():
    from ray.serve._private.common import DeploymentHandleSource, DeploymentID

    from cairn.cluster.routing.router import RayPrefixRouter

    async def texts():  # a PendingRequest makes a future: it needs a running loop
        router = RayPrefixRouter(deployment_id=DeploymentID(name="engine", app_name="app"),
                                 handle_source=DeploymentHandleSource.UNKNOWN)
        completion = routed(H[:1], 20, prompt="once upon a time", messages=None)
        chat = routed(H[:1], 20, prompt="rendered", messages=[{"role": "user", "content": "hi there"}])
        nothing = routed(None, 0, prompt=None)
        return [router._extract_text_from_request(pending(r)) for r in (completion, chat, nothing)]

    assert asyncio.run(texts()) == ["once upon a time", "hi there", None]


def test_a_failing_index_is_skipped_for_a_while_then_tried_again():
    async def main():
        clock, calls = Clock(), []
        ranker = AffinityRanker(CFG, clock=clock, rng=random.Random(0))

        async def index(hashes):
            calls.append(clock.now)
            raise ConnectionError("down")
        replicas = {"a": {}, "b": {}}
        for _ in range(5):
            await ranker.rank("r", request(4), replicas, index)
        assert len(calls) == AffinityRanker.BREAKER_FAILURES, "then it stops asking"
        clock.now += AffinityRanker.BREAKER_COOLDOWN_S + 0.1
        await ranker.rank("r", request(4), replicas, index)
        await ranker.rank("r", request(4), replicas, index)
        assert len(calls) == AffinityRanker.BREAKER_FAILURES + 1, "one try after the cooldown, failed: skipping again"
        return ranker.counts

    counts = asyncio.run(main())
    assert counts["index_fallbacks"] == 7 and counts["index_skipped"] == 3 and counts["index_errors"] == 4


SHIPPED_ROUTER = """
import asyncio, json, sys
from ray import cloudpickle
from ray.serve._private.common import DeploymentHandleSource, DeploymentID, RequestMetadata
from ray.serve._private.test_utils import FakeRunningReplica
from ray.serve.request_router import PendingRequest
from cairn.cluster.routing.router_registry import mirror_summaries, router_counts

cls = cloudpickle.loads(sys.stdin.buffer.read())

class Replica(FakeRunningReplica):
    routing_stats = {}

async def main():
    router = cls(deployment_id=DeploymentID(name="engine", app_name="app"),
                 handle_source=DeploymentHandleSource.UNKNOWN, use_replica_queue_len_cache=True)
    router.initialize_state(**json.loads(sys.argv[1]))
    replica = Replica("r0", max_ongoing_requests=4)
    replica.set_queue_len_response(0)
    router.update_replicas([replica])
    meta = RequestMetadata(request_id="q", internal_request_id="q")
    await router.choose_replicas([replica], PendingRequest(args=[None], kwargs={}, metadata=meta))
    print(json.dumps(await mirror_summaries()))
    print(router_counts().get("router_ranked_total", 0))

asyncio.run(main())
"""


def test_the_router_class_as_serve_ships_it_reports_to_the_registry_the_ingress_reads():
    """Serve pickles the router's module by value and unpickles the class in the calling process
    (RequestRouterConfig): there the module's globals are copies. The ranker must still reach the
    one registry the ingress reads (cairn.cluster.routing.router_registry)."""
    import json
    import os
    import subprocess
    import sys

    root = REPO
    cfg = CFG.model_copy(update={"index_mode": "mirror"})
    shipped = cfg.request_router_config().get_serialized_request_router_cls()
    out = subprocess.run([sys.executable, "-c", SHIPPED_ROUTER, json.dumps(cfg.router_kwargs())], input=shipped,
                         capture_output=True, cwd=root, env={**os.environ, "PYTHONPATH": str(root)}, timeout=120)
    assert out.returncode == 0, out.stderr.decode()[-3000:]
    *_, mirrors, ranked = out.stdout.decode().splitlines()
    assert ranked == "1", "the router ranked a request: the ingress's registry counts it"
    (mirror,) = json.loads(mirrors)  # and reads its mirror (no index actor here: it never heard from one)
    assert mirror["deployment"] == "engine" and mirror["index"] == CFG.index_actor_name
    assert (mirror["epoch"], mirror["cursor"], mirror["workers"], mirror["pages"]) == (None, 0, [], 0)


def test_the_registry_reads_each_router_s_mirror_on_that_router_s_own_loop():
    """Serve runs a handle's router on a loop of its own thread; the ingress asks from its loop."""
    import threading

    from cairn.cache_service.events import EventStream, PagesStored
    from cairn.cache_service.feed import ChangeFeed, IndexMirror
    from cairn.cache_service.index import CacheIndex
    from cairn.cluster.routing.router_registry import mirror_summaries, register_router

    index, feed, mirror = CacheIndex(), ChangeFeed(1000), IndexMirror()
    feed.apply(index, batch := EventStream("w").batch([PagesStored((b"p" * 16,), None)]), batch.encode())
    ranker, loop, read_on = AffinityRanker(CFG), asyncio.new_event_loop(), []
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        summary = mirror.summary
        mirror.summary = lambda: (read_on.append(threading.current_thread()), summary())[1]
        asyncio.run_coroutine_threadsafe(mirror.apply(feed.read(index, None, 0)), loop).result(10)
        # a name of its own: routers of earlier tests in this process may still be registered
        register_router(ranker, loop, mirror, "EngineOfTheRegistryTest")
        states = [s for s in asyncio.run(mirror_summaries()) if s.get("deployment") == "EngineOfTheRegistryTest"]
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
    assert read_on == [thread]
    assert [(s["index"], s["workers"], s["pages"], s["digest"]) for s in states] == \
        [(CFG.index_actor_name, ["w"], 1, index.digest())]
