"""The index's change feed and a router's mirror of it: whenever the mirror has read the feed, it
scores every prompt exactly as the index does, media included, and holds the same digest, through
gaps, resyncs, dropped workers, a feed that forgot its start, and a restarted index (plain Python,
no Ray; the index in memory and in a real redis-server)."""

import asyncio
import random
import uuid

import pytest

from cairn.cache_service.events import DEVICE, HOST, EventStream, PagesRemoved, PagesStored, StateRemoved, StateStored
from cairn.cache_service.feed import ChangeFeed, IndexMirror
from cairn.cache_service.index import CacheIndex
from cairn.cache_service.scoring import ZERO, WorkerScore

H = [bytes([i, j]) * 8 for i in range(4) for j in range(24)]  # 4 chains of 24 pages
CHAINS = [H[24 * i:24 * (i + 1)] for i in range(4)]


@pytest.fixture(params=["memory", "redis"])
def make_index(request):
    """make_index(max_pages) -> an empty index in memory, or in a real redis-server."""
    if request.param == "memory":
        yield lambda max_pages: CacheIndex(max_pages=max_pages)
        return
    from cairn.cache_service.redis_store import RedisStore

    url, namespaces = request.getfixturevalue("redis_url"), []

    def make(max_pages: int) -> CacheIndex:
        namespaces.append(f"feed-{uuid.uuid4().hex[:8]}")
        return CacheIndex(store=RedisStore.from_url(url, namespaces[-1], max_pages))
    yield make
    for namespace in namespaces:
        RedisStore.from_url(url, namespace, writer=False).wipe()


class Worker:
    """A worker's cache as a set of pages per chain depth, the first `device[c]` of a chain on its
    device and the rest on its host (each state in its page's medium), with the batches that
    describe it."""

    def __init__(self, name: str, rng: random.Random):
        self.stream, self.rng = EventStream(name), rng
        self.depth = {c: 0 for c in range(4)}
        self.device = {c: 0 for c in range(4)}
        self.states: set[bytes] = set()

    def move(self, c: int, start: int, stop: int, medium: str) -> list:
        """Events that put chain c's pages [start, stop) and their states in `medium`."""
        chain = CHAINS[c]
        return [PagesStored(tuple(chain[start:stop]), chain[start - 1] if start else None, medium),
                *(StateStored(h, medium) for h in chain[start:stop] if h in self.states)]

    def change(self):
        c, rng = self.rng.randrange(4), self.rng
        chain, depth, device = CHAINS[c], self.depth[c], self.device[c]
        roll = rng.random()
        if roll < 0.15 and device:  # the device evicts the chain's tail to the host
            self.device[c] = cut = rng.randint(0, device - 1)
            events = self.move(c, cut, device, HOST)
        elif roll < 0.25 and device < depth:  # a request brings host pages back
            self.device[c] = up = rng.randint(device + 1, depth)
            events = self.move(c, device, up, DEVICE)
        elif roll < 0.6 and depth < 24:
            new = rng.randint(depth + 1, 24)
            events = self.move(c, device, depth, DEVICE)  # a chain grows on the device
            events += [PagesStored(tuple(chain[depth:new]), chain[depth - 1] if depth else None)]
            if rng.random() < 0.7:
                self.states.add(chain[new - 1])
                events.append(StateStored(chain[new - 1]))
            self.depth[c] = self.device[c] = new
        elif depth:
            cut = rng.randint(0, depth - 1)
            events = [PagesRemoved(tuple(chain[cut:depth]))]
            self.states -= set(chain[cut:depth])
            self.depth[c], self.device[c] = cut, min(device, cut)
        elif self.states:
            gone = rng.choice(sorted(self.states))
            self.states.discard(gone)
            events = [StateRemoved(gone)]
        else:
            events = []
        return self.stream.batch(events)

    def snapshot(self):
        def pages(c: int, ks: range) -> list:
            return [(CHAINS[c][k], CHAINS[c][k - 1] if k else None) for k in ks]
        on_host = {h for c in range(4) for h in CHAINS[c][self.device[c]:self.depth[c]]}
        return self.stream.snapshot([p for c in range(4) for p in pages(c, range(self.device[c]))],
                                    sorted(self.states - on_host),
                                    [p for c in range(4) for p in pages(c, range(self.device[c], self.depth[c]))],
                                    sorted(self.states & on_host))


def put(index: CacheIndex, feed: ChangeFeed, batch) -> bool:
    return feed.apply(index, batch, batch.encode())


PROMPTS = [CHAINS[c][:n] for c in range(4) for n in (1, 7, 24)] + [CHAINS[0][:5] + CHAINS[1][5:9]]


def same_scores(mirror: IndexMirror, index: CacheIndex) -> int:
    """Asserts the mirror scores every prompt as the index does; returns how many scores had
    some of their hit on the host."""
    on_host = 0
    for prompt in PROMPTS:
        want = {w: s for w, s in index.score(prompt).items() if s.hit_pages}
        got = {w: s for w, s in mirror.score(prompt).items() if s.hit_pages}
        assert got == want, prompt
        on_host += sum(s.device_pages < s.hit_pages for s in want.values())
    return on_host


@pytest.mark.parametrize("seed", range(3))
def test_a_mirror_scores_like_the_index_through_gaps_resyncs_drops_and_a_forgetful_feed(make_index, seed):
    rng = random.Random(seed)
    max_pages = rng.choice([40, 10_000])  # 40: the bound drops pages, and both must drop the same ones
    index, feed = make_index(max_pages), ChangeFeed(max_pages, max_bytes=rng.choice([600, 4000, 1 << 20]))
    workers = {f"w{k}": Worker(f"w{k}", rng) for k in range(3)}
    mirrors = [IndexMirror()]
    reads = snapshots_seen = on_host = 0

    def deliver(batch) -> None:
        put(index, feed, batch)

    async def main():
        nonlocal reads, snapshots_seen, on_host
        for step in range(400):
            name = rng.choice(sorted(workers))
            worker, roll = workers[name], rng.random()
            if roll < 0.05:
                worker.change()  # lost on the way: the index sees a gap at the next batch
            elif roll < 0.12 or index.needs_resync(name):
                deliver(worker.snapshot())  # the worker answers the resync request
            elif roll < 0.14:
                index.drop_worker(name)
                feed.worker_dropped(name)
                workers[name] = Worker(f"{name}-{step}", rng)  # a new replica, a new id
            else:
                deliver(worker.change())
            if rng.random() < 0.02:
                mirrors.append(IndexMirror())  # a router joins late (it learns the bound from the feed)
            for mirror in mirrors:
                if rng.random() < 0.3:
                    chunk = feed.read(index, mirror.epoch, mirror.cursor, max_items=rng.choice([1, 3, 4096]))
                    snapshots_seen += chunk.snapshot
                    await mirror.apply(chunk, yield_every=2)
                    while chunk.items and not chunk.snapshot and mirror.cursor < feed.cursor:
                        chunk = feed.read(index, mirror.epoch, mirror.cursor)
                        await mirror.apply(chunk)
                    if mirror.epoch is not None and mirror.cursor == feed.cursor:
                        on_host += same_scores(mirror, index)
                        assert mirror.summary()["digest"] == index.digest()
                        reads += 1
    asyncio.run(main())
    assert reads > 100 and snapshots_seen >= len(mirrors) and on_host > 50


def test_a_reader_behind_the_feed_start_or_from_another_incarnation_gets_a_snapshot():
    index, feed = CacheIndex(), ChangeFeed(4_000_000, max_bytes=200)
    stream = EventStream("w")
    for k in range(10):
        assert put(index, feed, stream.batch([PagesStored((H[k],), H[k - 1] if k else None), StateStored(H[k])]))
    assert not feed.read(index, feed.epoch, feed.cursor).snapshot, "an up-to-date reader gets the news"
    behind = feed.read(index, feed.epoch, 0)
    assert behind.snapshot and behind.cursor == feed.cursor, "the feed no longer holds cursor 0"
    other = feed.read(index, "an-old-epoch", feed.cursor)
    assert other.snapshot and other.epoch == feed.epoch
    mirror = IndexMirror()
    asyncio.run(mirror.apply(other))
    same_scores(mirror, index)
    assert mirror.index.score(H[:10])["w"].state_pages == 10
    put(index, feed, stream.batch([PagesRemoved((H[9],))]))
    asyncio.run(mirror.apply(feed.read(index, mirror.epoch, mirror.cursor)))
    assert mirror.index.score(H[:10])["w"].hit_pages == 9 and mirror.snapshots == 1
    gauges = mirror.gauges()
    assert (gauges["index_mirror_pages"], gauges["index_mirror_states"], gauges["index_mirror_snapshots"]) == (9, 9, 1)
    assert gauges["index_mirror_bytes"] > 0 and 0 <= gauges["index_mirror_age_seconds"] < 5


def test_a_worker_awaiting_a_resync_is_mirrored_as_holding_nothing_until_its_snapshot():
    index, feed = CacheIndex(), ChangeFeed(4_000_000)
    stream = EventStream("w")
    put(index, feed, stream.batch([PagesStored(tuple(H[:5]), None), StateStored(H[4])]))
    early = IndexMirror()  # mirrored while the worker was trusted
    asyncio.run(early.apply(feed.read(index, None, 0)))
    assert early.score(H[:5])["w"].state_pages == 5
    stream.batch([PagesStored((H[5],), H[4])])  # lost
    assert not put(index, feed, stream.batch([StateStored(H[5])])) and index.needs_resync("w")
    asyncio.run(early.apply(feed.read(index, early.epoch, early.cursor)))
    mirror = IndexMirror()  # mirrored while it was not
    asyncio.run(mirror.apply(feed.read(index, None, 0)))
    for m in (early, mirror):
        assert m.score(H[:5]).get("w", ZERO) == ZERO == index.score(H[:5]).get("w", ZERO) and m.epoch is not None
    put(index, feed, stream.snapshot([(H[k], H[k - 1] if k else None) for k in range(6)], [H[5]]))
    for m in (early, mirror):
        asyncio.run(m.apply(feed.read(index, m.epoch, m.cursor)))
        assert m.score(H[:6])["w"].state_pages == 6 == index.score(H[:6])["w"].state_pages


def test_a_gap_in_the_mirror_itself_makes_it_ask_for_a_snapshot():
    index, feed = CacheIndex(), ChangeFeed(4_000_000)
    stream = EventStream("w")
    batches = [stream.batch([PagesStored((H[k],), H[k - 1] if k else None)]) for k in range(3)]
    for batch in batches:
        put(index, feed, batch)
    mirror = IndexMirror()
    chunk = feed.read(index, None, 0)
    asyncio.run(mirror.apply(chunk))
    chunk = chunk._replace(snapshot=False, cursor=feed.cursor)
    assert mirror.epoch is not None
    broken = IndexMirror()
    broken.epoch = feed.epoch
    asyncio.run(broken.apply(chunk._replace(items=[("batch", batches[2].encode())])))  # seq 2 first: a gap
    assert broken.epoch is None, "next read asks for a snapshot"
    assert feed.read(index, broken.epoch, broken.cursor).snapshot


def test_the_feed_wait_returns_when_something_arrives_or_when_time_is_up():
    async def main():
        feed = ChangeFeed(4_000_000)
        loop = asyncio.get_running_loop()
        start = loop.time()
        await feed.wait(feed.cursor, 0.05)
        idle = loop.time() - start
        loop.call_later(0.02, feed.worker_dropped, "w")
        start = loop.time()
        await feed.wait(feed.cursor, 5.0)
        return idle, loop.time() - start

    idle, woken = asyncio.run(main())
    assert 0.04 <= idle < 1.0 and woken < 1.0


def test_a_mirror_is_fresh_only_while_it_hears_from_the_feed():
    now = [0.0]
    mirror = IndexMirror(clock=lambda: now[0])
    assert not mirror.fresh(2.0), "never synced"
    feed = ChangeFeed(4_000_000)
    asyncio.run(mirror.apply(feed.read(CacheIndex(), None, 0)))
    assert mirror.fresh(2.0)
    now[0] = 2.5
    assert not mirror.fresh(2.0)


def test_with_the_page_bound_full_an_untrusted_workers_pages_count_in_the_mirror_as_in_the_index(make_index):
    index, feed = make_index(100), ChangeFeed(100)
    a, b = EventStream("a"), EventStream("b")
    mirror = IndexMirror()

    async def catch_up():
        await mirror.apply(feed.read(index, mirror.epoch, mirror.cursor))

    put(index, feed, a.batch([PagesStored(tuple(H[:60]), None)]))
    asyncio.run(catch_up())
    a.batch([PagesRemoved((H[59],))])  # lost: a's next batch is a gap
    put(index, feed, a.batch([StateStored(H[10])]))
    late = IndexMirror()  # joins while a is untrusted: its snapshot carries a's pages, then a RESET
    asyncio.run(late.apply(feed.read(index, None, 0)))
    put(index, feed, b.batch([PagesStored(tuple(H[24:84]), None)]))  # only 40 fit beside a's 60
    put(index, feed, a.snapshot([(h, None) for h in H[:30]], []))
    for m in (mirror, late):
        asyncio.run(m.apply(feed.read(index, m.epoch, m.cursor)))
        assert m.epoch is not None
        same_scores(m, index)
        for prompt in (H[:30], H[24:84]):
            assert m.score(prompt) == index.score(prompt)


def test_a_read_returns_the_next_items_in_order_from_either_end_of_a_long_feed():
    index, feed = CacheIndex(), ChangeFeed(4_000_000)
    names = [f"w{k}" for k in range(10)]
    for name in names:
        feed.worker_dropped(name)
    for cursor in range(11):
        for max_items in (1, 3, 4096):
            chunk = feed.read(index, feed.epoch, cursor, max_items)
            assert not chunk.snapshot and [p for _, p in chunk.items] == names[cursor:cursor + max_items]
            assert chunk.cursor == cursor + len(chunk.items)


def test_a_mirror_follows_a_page_to_the_host_and_back_and_a_late_one_gets_the_media_in_its_snapshot(make_index):
    index, feed = make_index(4_000_000), ChangeFeed(4_000_000)
    stream, mirror = EventStream("w"), IndexMirror()

    def step(*events) -> tuple[WorkerScore, WorkerScore, WorkerScore]:
        assert put(index, feed, stream.batch(list(events)))
        asyncio.run(mirror.apply(feed.read(index, mirror.epoch, mirror.cursor)))
        late = IndexMirror()
        asyncio.run(late.apply(feed.read(index, None, 0)))
        return index.score(H[:4])["w"], mirror.score(H[:4])["w"], late.score(H[:4])["w"]

    assert step(PagesStored(tuple(H[:4]), None), StateStored(H[3])) == (WorkerScore(4, 4),) * 3
    assert step(PagesStored(tuple(H[2:4]), H[1], HOST), StateStored(H[3], HOST)) == (WorkerScore(4, 4, 2, True),) * 3
    assert mirror.index.host_contents("w") == index.host_contents("w") == (frozenset(H[2:4]), frozenset([H[3]]))
    assert step(PagesStored((H[2],), H[1])) == (WorkerScore(4, 4, 3, True),) * 3
    assert step(PagesStored((H[3],), H[2]), StateStored(H[3])) == (WorkerScore(4, 4),) * 3
    assert mirror.index.host_contents("w") == (frozenset(), frozenset())
    assert mirror.index.stats()["pages"] == index.stats()["pages"] == 4


def test_mirrors_fed_the_same_feed_hold_the_index_s_digest_and_the_next_batch_changes_it(make_index):
    """The digest is how mirrors in different processes (every ingress's routers) are compared
    with each other and with the index actor: equal when they hold the same, on either backend,
    whether a mirror followed the feed or joined late by a snapshot; different after a batch
    one of them has not read yet, or after a page moved to the host."""
    index, feed, alike = make_index(4_000_000), ChangeFeed(4_000_000), CacheIndex()
    streams = {w: EventStream(w) for w in ("a", "b")}
    following, late = IndexMirror(), IndexMirror()

    def put_both(worker: str, events: list) -> None:
        batch = streams[worker].batch(events)
        assert put(index, feed, batch) and alike.apply(batch)

    def read(mirror: IndexMirror) -> dict:
        asyncio.run(mirror.apply(feed.read(index, mirror.epoch, mirror.cursor)))
        return mirror.summary()

    put_both("a", [PagesStored(tuple(CHAINS[0][:6]), None), StateStored(CHAINS[0][5])])
    read(following)
    put_both("b", [PagesStored(tuple(CHAINS[1][:4]), None)])
    first, joined = read(following), read(late)
    assert late.snapshots == 1 and following.snapshots == 1  # the late one's only read was a snapshot
    assert {k: first[k] for k in ("epoch", "cursor", "workers", "pages", "digest")} == \
        {k: joined[k] for k in ("epoch", "cursor", "workers", "pages", "digest")}
    assert first["digest"] == index.digest() == alike.digest(), "the same contents in memory and in Redis"
    assert first["workers"] == ["a", "b"] and first["pages"] == 10 and first["cursor"] == feed.cursor

    put_both("b", [PagesStored((CHAINS[1][4],), CHAINS[1][3])])
    assert index.digest() != first["digest"] == following.summary()["digest"], "not read yet"
    assert read(following)["digest"] == read(late)["digest"] == index.digest() == alike.digest()

    before = index.digest()
    put_both("a", [PagesStored((CHAINS[0][5],), CHAINS[0][4], HOST), StateStored(CHAINS[0][5], HOST)])
    assert index.digest() != before, "the same pages, one of them on the host"
    assert read(following)["digest"] == index.digest() == alike.digest()
