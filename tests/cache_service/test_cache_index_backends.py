"""One suite, every backend: the index in memory and the index in a real redis-server behave
identically, and the Redis one survives its process (a new CacheIndex on the namespace resumes
with the same contents, media, scores and seq numbers)."""

import random
import uuid

import pytest

from cairn.cache_service.events import (DEVICE, HOST, AllCleared, EventBatch, EventDecodeError, EventStream,
                                  PagesRemoved, PagesStored, StateRemoved, StateStored)
from cairn.cache_service.hashing import next_page_hash, root_hash
from cairn.cache_service.index import CacheIndex
from cairn.cache_service.scoring import WorkerScore, walk_scores

H = [bytes([i]) * 16 for i in range(20)]


def chain(n: int, start: int = 0) -> PagesStored:
    return PagesStored(tuple(H[start:start + n]), H[start - 1] if start else None)


# ---- backends --------------------------------------------------------------------------------

class MemoryBackend:
    name = "memory"

    def make(self, max_pages: int = 4_000_000) -> CacheIndex:
        return CacheIndex(max_pages)


class RedisBackend:
    """Each instance is its own namespace; reopen() is a restarted owner on the same one."""
    name = "redis"

    def __init__(self, url: str):
        self.url, self.namespace, self.max_pages = url, f"test-{uuid.uuid4().hex[:8]}", 4_000_000

    def make(self, max_pages: int = 4_000_000) -> CacheIndex:
        self.max_pages = max_pages
        return self.reopen()

    def reopen(self) -> CacheIndex:
        from cairn.cache_service.redis_store import RedisStore

        return CacheIndex(store=RedisStore.from_url(self.url, self.namespace, self.max_pages))

    def wipe(self) -> None:
        from cairn.cache_service.redis_store import RedisStore

        RedisStore.from_url(self.url, self.namespace, writer=False).wipe()


@pytest.fixture
def redis_backend(redis_url):
    made = RedisBackend(redis_url)
    yield made
    made.wipe()


@pytest.fixture(params=["memory", "redis"])
def backend(request):
    """make(max_pages=...) -> a fresh, empty index on that backend."""
    return MemoryBackend() if request.param == "memory" else request.getfixturevalue("redis_backend")


# ---- the randomized replay against a brute-force model ---------------------------------------

class ReferenceWorker:
    """What a worker holds, as plain sets, and the events it emits for each change. Storing what
    it holds in the other medium moves it there (a demotion to the host, a promotion back)."""

    def __init__(self, worker_id: str):
        self.stream = EventStream(worker_id, clock=lambda: 0.0)
        self.pages: dict[bytes, bytes | None] = {}  # hash -> parent, every medium
        self.states: set[bytes] = set()
        self.host_pages: set[bytes] = set()  # the part of pages / states in host memory
        self.host_states: set[bytes] = set()
        self.pending: list = []

    def store(self, hashes: list[bytes], parent: bytes | None, medium: str = DEVICE) -> None:
        prev = parent
        for h in hashes:
            self.pages.setdefault(h, prev)
            _place(self.host_pages, h, medium)
            prev = h
        self.pending.append(PagesStored(tuple(hashes), parent, medium))

    def remove(self, hashes: list[bytes]) -> None:
        for h in hashes:
            self.pages.pop(h, None)
            self.states.discard(h)
            self.host_pages.discard(h)
            self.host_states.discard(h)
        self.pending.append(PagesRemoved(tuple(hashes)))

    def store_state(self, h: bytes, medium: str = DEVICE) -> None:
        if h in self.pages:
            self.states.add(h)
            _place(self.host_states, h, medium)
        self.pending.append(StateStored(h, medium))

    def remove_state(self, h: bytes) -> None:
        self.states.discard(h)
        self.host_states.discard(h)
        self.pending.append(StateRemoved(h))

    def clear(self) -> None:
        for held in (self.pages, self.states, self.host_pages, self.host_states):
            held.clear()
        self.pending.append(AllCleared())

    def flush(self) -> EventBatch:
        batch, self.pending = self.stream.batch(self.pending), []
        return batch

    def snapshot(self) -> EventBatch:
        on_device = [(h, p) for h, p in self.pages.items() if h not in self.host_pages]
        on_host = [(h, p) for h, p in self.pages.items() if h in self.host_pages]
        return self.stream.snapshot(on_device, sorted(self.states - self.host_states), on_host,
                                    sorted(self.host_states))


def _place(host: set[bytes], h: bytes, medium: str) -> None:
    if medium == HOST:
        host.add(h)
    else:
        host.discard(h)


def brute_force_score(prompt: list[bytes], worker: ReferenceWorker) -> WorkerScore:
    hit = 0
    while hit < len(prompt) and prompt[hit] in worker.pages:
        hit += 1
    device = 0
    while device < hit and prompt[device] not in worker.host_pages:
        device += 1
    state = max((j for j in range(1, hit + 1) if prompt[j - 1] in worker.states), default=0)
    return WorkerScore(hit, state, device, state > 0 and prompt[state - 1] in worker.host_states)


def test_replaying_random_worker_streams_reproduces_their_contents_and_scores(backend):
    rng = random.Random(1234)
    roots = [root_hash("model", 16, salt) for salt in (None, "tenant-b")]
    known: dict[bytes, bytes | None] = {}

    def extend(prev: bytes, n: int) -> list[bytes]:
        out = []
        for _ in range(n):  # a 3-token alphabet: workers independently build the same chains
            h = next_page_hash(prev, [rng.randrange(3)])
            known.setdefault(h, None if prev in roots else prev)
            out.append(prev := h)
        return out

    def chain_to(h: bytes) -> list[bytes]:
        out = [h]
        while known[out[-1]] is not None:
            out.append(known[out[-1]])
        return out[::-1]

    def random_prompt() -> list[bytes]:
        if not known or rng.random() < 0.1:
            return extend(rng.choice(roots), rng.randrange(6))
        held = list(rng.choice(workers).pages)
        prompt = chain_to(rng.choice(held if held and rng.random() < 0.7 else list(known)))
        prompt = prompt[:rng.randrange(len(prompt) + 1)] if rng.random() < 0.3 else prompt
        return prompt + extend(prompt[-1] if prompt else rng.choice(roots), rng.randrange(3))

    workers = [ReferenceWorker(f"w{i}") for i in range(4)]
    index, sent = backend.make(), []
    partly_on_host = states_on_host = 0  # scores the host tier shaped
    steps = 3000
    for step in range(steps):
        w = rng.choice(workers)
        if rng.random() < 0.02:
            batch = w.snapshot()
        else:
            for _ in range(rng.randint(1, 4)):
                op, held = rng.random(), list(w.pages)
                medium = HOST if rng.random() < 0.15 else DEVICE
                if op < 0.3:
                    start = rng.random()
                    if held and start < 0.55:
                        parent, hashes = (p := rng.choice(held)), extend(p, rng.randint(1, 8))
                    elif known and start < 0.85:
                        hashes = chain_to(rng.choice(list(known)))
                        parent, hashes = None, hashes + extend(hashes[-1], rng.randint(0, 4))
                    else:
                        parent, hashes = None, extend(rng.choice(roots), rng.randint(1, 8))
                    w.store(hashes, parent, medium)
                elif op < 0.45 and held:  # demote a chain's tail to the host, or promote it back
                    tail = chain_to(rng.choice(held))
                    tail = tail[rng.randrange(len(tail)):]
                    medium = HOST if rng.random() < 0.6 else DEVICE
                    w.store(tail, w.pages.get(tail[0]), medium)
                    for h in tail:
                        if h in w.states and rng.random() < 0.7:
                            w.store_state(h, medium)
                elif op < 0.55 and held:
                    leaves = list(w.pages.keys() - set(w.pages.values()))
                    victims = leaves if rng.random() < 0.7 else held
                    w.remove(rng.sample(victims, min(len(victims), rng.randint(1, 3))))
                elif op < 0.85:
                    pool = held if held and rng.random() < 0.8 else list(known) or H
                    w.store_state(rng.choice(pool), medium)
                elif op < 0.97:
                    w.remove_state(rng.choice(sorted(w.states) or H))
                else:
                    w.clear()
            batch = w.flush()
        assert index.apply(batch.encode() if step % 2 else batch)
        sent.append(batch)
        redeliverable = [b for b in sent if not b.is_snapshot] if rng.random() < 0.05 else []
        if redeliverable:
            assert not index.apply(rng.choice(redeliverable))
        for r in (workers if step % 100 == 0 else [w]):
            if r.stream.next_seq:
                assert index.contents(r.stream.worker_id) == (frozenset(r.pages), frozenset(r.states))
                assert index.host_contents(r.stream.worker_id) == (frozenset(r.host_pages), frozenset(r.host_states))
        if step % 5 == 0:
            for _ in range(3):
                prompt = random_prompt()
                scores = index.score(prompt)
                assert scores == {r.stream.worker_id: brute_force_score(prompt, r)
                                  for r in workers if r.stream.next_seq > 0}
                partly_on_host += sum(s.device_pages < s.hit_pages for s in scores.values())
                states_on_host += sum(s.state_on_host for s in scores.values())
    stats = index.stats()
    assert partly_on_host > 100 and states_on_host > 20
    assert index.workers_needing_resync() == set()
    assert stats["batches_applied"] == steps and stats["gaps_detected"] == 0
    assert stats["pages"] == sum(len(w.pages) for w in workers)
    assert stats["states"] == sum(len(w.states) for w in workers)
    assert {w.stream.worker_id: index.last_seq(w.stream.worker_id) for w in workers} == \
        {w.stream.worker_id: w.stream.next_seq - 1 for w in workers}


# ---- ordering: gaps, redelivery, snapshots ---------------------------------------------------

def test_a_gap_stops_trusting_the_worker_until_a_snapshot_restores_it(backend):
    index, a, b = backend.make(), EventStream("a"), EventStream("b")
    assert index.apply(a.batch([chain(2), StateStored(H[1])]))
    assert index.apply(b.batch([chain(3)]))
    lost = a.batch([PagesStored((H[2],), H[1])])
    assert not index.apply(a.batch([StateStored(H[2])]))

    assert index.workers_needing_resync() == {"a"}
    assert index.score(H[:3]) == {"a": WorkerScore(0, 0), "b": WorkerScore(3, 0)}
    assert not index.apply(lost), "a late batch is refused too: the worker stays untrusted"
    assert not index.apply(a.batch([PagesRemoved((H[0],))]))
    assert index.score(H[:3])["a"] == WorkerScore(0, 0)

    assert index.apply(a.snapshot([(H[0], None), (H[1], H[0]), (H[2], H[1])], [H[2]]))
    assert index.workers_needing_resync() == set()
    assert index.contents("a") == (frozenset(H[:3]), frozenset([H[2]]))
    assert index.score(H[:4]) == {"a": WorkerScore(3, 3), "b": WorkerScore(3, 0)}
    assert index.apply(a.batch([StateRemoved(H[2])])), "after the snapshot, the next seq applies"
    assert index.stats()["gaps_detected"] == 1


def test_a_redelivered_old_batch_is_ignored_and_cannot_resurrect_removed_pages(backend):
    index, a = backend.make(), EventStream("a")
    first = a.batch([chain(3), StateStored(H[2])])
    assert index.apply(first)
    assert index.apply(a.batch([PagesRemoved((H[2],))]))
    assert not index.apply(first)
    assert not index.apply(first.encode())
    assert index.workers_needing_resync() == set()
    assert index.contents("a") == (frozenset(H[:2]), frozenset())
    assert index.score(H[:3])["a"] == WorkerScore(2, 0)
    assert index.stats()["batches_ignored"] == 2
    assert index.apply(a.batch([StateStored(H[1])]))


def test_a_first_batch_that_is_not_seq_zero_or_a_snapshot_asks_for_a_resync(backend):
    index, a = backend.make(), EventStream("a")
    a.batch([chain(1)])  # the index never saw seq 0
    assert not index.apply(a.batch([chain(1, start=1)]))
    assert index.workers() == {"a"} and index.workers_needing_resync() == {"a"}
    assert index.last_seq("a") is None
    assert index.score(H[:2]) == {"a": WorkerScore(0, 0)}
    assert index.apply(a.snapshot([(H[0], None), (H[1], H[0])], []))
    assert index.score(H[:2]) == {"a": WorkerScore(2, 0)}


def test_a_snapshot_resets_the_worker_to_exactly_its_contents_at_any_seq(backend):
    index, a = backend.make(), EventStream("a")
    assert index.apply(a.batch([chain(5), StateStored(H[4])]))
    restarted = EventStream("a")
    assert index.apply(restarted.snapshot([(H[7], None)], [H[7]]))
    assert index.contents("a") == (frozenset([H[7]]), frozenset([H[7]]))
    assert index.score(H[:5])["a"] == WorkerScore(0, 0)
    assert index.apply(restarted.batch([chain(1)]))


def test_one_workers_gap_leaves_another_workers_stream_alone(backend):
    index, a, b = backend.make(), EventStream("a"), EventStream("b")
    index.apply(a.batch([chain(2)]))
    a.batch([])  # lost
    assert not index.apply(a.batch([]))
    for i in range(3):
        assert index.apply(b.batch([chain(1, start=i)]))
    assert index.workers_needing_resync() == {"a"}
    assert index.score(H[:4]) == {"a": WorkerScore(0, 0), "b": WorkerScore(3, 0)}


def test_undecodable_bytes_raise_and_change_nothing(backend):
    index = backend.make()
    with pytest.raises(EventDecodeError):
        index.apply(b"\x95\x01")
    assert index.workers() == set() and index.stats()["batches_applied"] == 0


# ---- event semantics ---------------------------------------------------------------------------

def test_a_state_at_a_page_the_worker_does_not_hold_is_ignored(backend):
    index, a = backend.make(), EventStream("a")
    index.apply(a.batch([StateStored(H[0]), chain(2), StateStored(H[5])]))
    assert index.contents("a") == (frozenset(H[:2]), frozenset())
    assert index.score(H[:2])["a"] == WorkerScore(2, 0)


def test_removing_a_page_removes_its_state_and_the_hit_behind_it(backend):
    index, a = backend.make(), EventStream("a")
    index.apply(a.batch([chain(4), StateStored(H[1]), StateStored(H[3])]))
    assert index.score(H[:4])["a"] == WorkerScore(4, 4)
    index.apply(a.batch([PagesRemoved((H[3], H[9]))]))
    assert index.contents("a") == (frozenset(H[:3]), frozenset([H[1]]))
    assert index.score(H[:4])["a"] == WorkerScore(3, 2)
    index.apply(a.batch([PagesStored((H[3],), H[2])]))
    assert index.score(H[:4])["a"] == WorkerScore(4, 2), "the state died with its page"


def test_a_state_under_a_missing_page_does_not_count(backend):
    index, a = backend.make(), EventStream("a")
    index.apply(a.batch([chain(4), StateStored(H[3]), PagesRemoved((H[1],))]))
    assert index.score(H[:4])["a"] == WorkerScore(1, 0)


def test_states_at_names_the_trusted_workers_holding_a_sub_page_state_and_its_medium(backend):
    """A sub-page state travels as a page of its own after its floor, with a state there
    (`Checkpoint.index_key`); `states_at` tells who holds one at each key asked, never a page
    without a state, an untrusted worker, or a key gone with its page."""
    index, a, b, c = backend.make(), EventStream("a"), EventStream("b"), EventStream("c")
    sub_a, sub_b, bare = H[-1], H[-2], H[-3]
    index.apply(a.batch([chain(2), PagesStored((sub_a,), H[1]), StateStored(sub_a)]))
    index.apply(b.batch([chain(2), PagesStored((sub_a, sub_b), H[1], HOST), StateStored(sub_b, HOST),
                         StateStored(sub_a, HOST), PagesStored((bare,), H[1])]))
    index.apply(c.batch([chain(2), PagesStored((sub_b,), H[1]), StateStored(sub_b)]))
    index.distrust("c")
    assert index.states_at([bare, sub_b, H[9], sub_a]) == {"a": [(3, False)], "b": [(1, True), (3, True)]}
    index.apply(a.batch([PagesRemoved((sub_a,))]))
    assert index.states_at([sub_a]) == {"b": [(0, True)]}
    assert index.states_at([]) == {}


def test_all_cleared_empties_only_that_worker(backend):
    index, a, b = backend.make(), EventStream("a"), EventStream("b")
    index.apply(a.batch([chain(3), StateStored(H[2])]))
    index.apply(b.batch([chain(3), StateStored(H[2])]))
    index.apply(a.batch([AllCleared()]))
    assert index.contents("a") == (frozenset(), frozenset())
    assert index.score(H[:3])["b"] == WorkerScore(3, 3)
    assert index.score(H[:3]).get("a", WorkerScore(0, 0)) == WorkerScore(0, 0)


def test_all_cleared_in_the_middle_of_a_batch_keeps_what_follows_it(backend):
    index, a, b = backend.make(), EventStream("a"), EventStream("b")
    index.apply(b.batch([chain(3), StateStored(H[2])]))
    index.apply(a.batch([chain(3), StateStored(H[2])]))
    index.apply(a.batch([PagesStored((H[3],), H[2]), AllCleared(), chain(2), StateStored(H[1])]))
    assert index.contents("a") == (frozenset(H[:2]), frozenset([H[1]]))
    assert index.score(H[:4]) == {"a": WorkerScore(2, 2), "b": WorkerScore(3, 3)}
    assert index.stats()["pages"] == 5 and index.stats()["states"] == 2


def test_a_page_demoted_to_the_host_and_promoted_back_is_in_one_medium_at_every_step(backend):
    index, a = backend.make(max_pages=4), EventStream("a")  # the bound is full: a move is no new entry
    index.apply(a.batch([chain(4), StateStored(H[1]), StateStored(H[3])]))
    assert index.host_contents("a") == (frozenset(), frozenset())
    assert index.score(H[:4])["a"] == WorkerScore(4, 4, 4, False)

    index.apply(a.batch([PagesStored((H[2], H[3]), H[1], HOST), StateStored(H[3], HOST)]))  # demoted
    assert index.contents("a") == (frozenset(H[:4]), frozenset([H[1], H[3]])), "contents: every medium"
    assert index.host_contents("a") == (frozenset(H[2:4]), frozenset([H[3]]))
    assert index.score(H[:4])["a"] == WorkerScore(4, 4, 2, True)
    assert index.score(H[:2])["a"] == WorkerScore(2, 2, 2, False)
    stats = index.stats()
    assert (stats["pages"], stats["states"], stats["pages_dropped"]) == (4, 2, 0)

    index.apply(a.batch([StateStored(H[1], HOST)]))  # a state goes to the host while its page stays
    assert index.host_contents("a") == (frozenset(H[2:4]), frozenset([H[1], H[3]]))
    assert index.score(H[:3])["a"] == WorkerScore(3, 2, 2, True)

    index.apply(a.batch([PagesStored((H[2],), H[1]), StateStored(H[1])]))  # promoted back, one page
    assert index.host_contents("a") == (frozenset([H[3]]), frozenset([H[3]]))
    assert index.score(H[:4])["a"] == WorkerScore(4, 4, 3, True)
    index.apply(a.batch([PagesStored((H[3],), H[2], DEVICE), StateStored(H[3], DEVICE)]))
    assert index.host_contents("a") == (frozenset(), frozenset())
    assert index.score(H[:4])["a"] == WorkerScore(4, 4)
    stats = index.stats()
    assert (stats["pages"], stats["states"], stats["pages_dropped"]) == (4, 2, 0)


def test_removing_a_page_on_the_host_removes_it_and_its_state_from_the_host(backend):
    index, a = backend.make(), EventStream("a")
    index.apply(a.batch([chain(3), StateStored(H[2]), PagesStored((H[2],), H[1], HOST), StateStored(H[2], HOST)]))
    index.apply(a.batch([PagesRemoved((H[2],)), StateStored(H[2], HOST)]))  # the state's page is gone: ignored
    assert index.contents("a") == (frozenset(H[:2]), frozenset())
    assert index.host_contents("a") == (frozenset(), frozenset())
    index.apply(a.batch([PagesStored((H[1],), H[0], HOST), StateStored(H[1], HOST), StateRemoved(H[1])]))
    assert index.host_contents("a") == (frozenset([H[1]]), frozenset())
    index.apply(a.batch([AllCleared(), PagesStored((H[0],), None, HOST)]))
    assert index.contents("a") == index.host_contents("a") == (frozenset([H[0]]), frozenset())
    assert index.score(H[:2])["a"] == WorkerScore(1, 0, 0, False)
    assert index.stats()["pages"] == 1


def test_drop_worker_forgets_it_and_keeps_the_pages_others_share(backend):
    index, a, b = backend.make(), EventStream("a"), EventStream("b")
    index.apply(a.batch([chain(3), StateStored(H[2])]))
    index.apply(b.batch([chain(2), StateStored(H[1])]))
    index.drop_worker("a")
    index.drop_worker("never-seen")
    assert index.workers() == {"b"}
    assert index.score(H[:3]) == {"b": WorkerScore(2, 2)}
    with pytest.raises(KeyError):
        index.contents("a")
    assert index.stats()["pages"] == 2 and index.stats()["states"] == 1
    c = EventStream("c")  # a newcomer (it may reuse a's bit) inherits nothing of the dropped worker
    index.apply(c.batch([]))
    assert index.score(H[:3]) == {"b": WorkerScore(2, 2), "c": WorkerScore(0, 0)}


def test_max_pages_bounds_the_entries_and_counts_what_it_drops(backend):
    index, a, b = backend.make(max_pages=5), EventStream("a"), EventStream("b")
    index.apply(a.batch([chain(3)]))
    index.apply(b.batch([chain(4), StateStored(H[3])]))
    assert index.stats()["pages"] == 5 and index.stats()["pages_dropped"] == 2
    assert index.score(H[:4]) == {"a": WorkerScore(3, 0), "b": WorkerScore(2, 0)}
    index.apply(b.batch([chain(2)]))
    assert index.stats()["pages_dropped"] == 2
    index.apply(a.batch([PagesRemoved((H[0], H[1], H[2]))]))
    index.apply(b.batch([chain(2, start=2)]))
    assert index.stats()["pages"] == 4 and index.score(H[:4])["b"] == WorkerScore(4, 0)


def test_stats_report_sizes_and_counts(backend):
    index, a = backend.make(), EventStream("a")
    index.apply(a.batch([chain(3), StateStored(H[2])]))
    index.apply(a.batch([]))
    stats = index.stats()
    assert {k: stats[k] for k in ("workers", "pages", "states", "batches_applied", "gaps_detected")} == \
        dict(workers=1, pages=3, states=1, batches_applied=2, gaps_detected=0)
    assert stats["approx_bytes"] > 0


def test_a_long_prompt_scores_across_many_chunks(backend):
    rng = random.Random(7)
    prompt = [rng.randbytes(16) for _ in range(1300)]  # > 2 Redis read chunks
    index, a, b = backend.make(), EventStream("a"), EventStream("b")
    index.apply(a.batch([PagesStored(tuple(prompt), None), StateStored(prompt[1199])]))
    index.apply(b.batch([PagesStored(tuple(prompt[:600]), None), StateStored(prompt[9])]))
    assert index.score(prompt) == {"a": WorkerScore(1300, 1200), "b": WorkerScore(600, 10)}


# ---- restart: the Redis index outlives its process -------------------------------------------

def test_a_new_index_on_the_same_redis_resumes_with_identical_scores_and_seq_numbers(redis_backend):
    backend = redis_backend
    index, a, b = backend.make(), EventStream("a"), EventStream("b")
    index.apply(a.batch([chain(4), StateStored(H[1]), StateStored(H[3])]))
    index.apply(a.batch([PagesRemoved((H[3],))]))
    index.apply(b.batch([chain(2)]))
    b.batch([])  # lost: b is untrusted
    assert not index.apply(b.batch([]))
    before = (index.score(H[:5]), index.workers(), index.workers_needing_resync(),
              index.contents("a"), index.host_contents("a"), index.last_seq("a"), index.last_seq("b"))

    restarted = backend.reopen()
    after = (restarted.score(H[:5]), restarted.workers(), restarted.workers_needing_resync(),
             restarted.contents("a"), restarted.host_contents("a"), restarted.last_seq("a"), restarted.last_seq("b"))
    assert after == before
    assert after[0] == {"a": WorkerScore(3, 2), "b": WorkerScore(0, 0)} and after[5] == 1
    assert restarted.apply(a.batch([PagesStored((H[1], H[2]), H[0], HOST), StateStored(H[1], HOST)]))
    assert restarted.last_seq("a") == 2, "the restarted index continues a's stream where it was"
    assert restarted.apply(b.snapshot([(H[0], None)], []))
    assert restarted.score(H[:2])["b"] == WorkerScore(1, 0)
    assert restarted.stats()["batches_applied"] == index.stats()["batches_applied"] == 5
    again = backend.reopen()  # the media it was told survive it too
    assert again.score(H[:5])["a"] == restarted.score(H[:5])["a"] == WorkerScore(3, 2, 1, True)
    assert again.host_contents("a") == restarted.host_contents("a") == (frozenset(H[1:3]), frozenset([H[1]]))


def test_the_replaced_writer_can_no_longer_write_but_readers_can_still_read(redis_backend):
    backend = redis_backend
    from cairn.cache_service.redis_store import StoreSuperseded

    old, a = backend.make(), EventStream("a")
    assert old.apply(a.batch([chain(2)]))
    new = backend.reopen()
    with pytest.raises(StoreSuperseded):
        old.apply(a.batch([chain(1, start=2)]))
    assert new.contents("a") == (frozenset(H[:2]), frozenset())
    assert old.score(H[:2]) == {"a": WorkerScore(2, 0)}, "reading needs no epoch"


def test_a_redis_that_lost_everything_is_claimed_again_and_workers_it_forgot_resync(redis_backend):
    """A Redis restarted empty (here: its keys wiped) must not fence the writer out for good: the
    next write claims the namespace again, and workers the index no longer knows resync."""
    import redis

    backend = redis_backend
    index, a = backend.make(), EventStream("a")
    assert index.apply(a.batch([chain(3)]))
    client = redis.Redis.from_url(backend.url)
    client.delete(*client.scan_iter(match=f"{backend.namespace}:*"))  # as a Redis restarted empty: epoch too
    assert not index.apply(a.batch([chain(1, start=3)])), "an unknown worker's incremental batch is a gap"
    assert index.store_losses == 1 and index.store_lost()
    assert index.needs_resync("a")
    assert index.apply(a.snapshot([(h, p) for h, p in zip(H[:4], [None, *H[:3]])], [H[2]]))
    assert index.score(H[:4])["a"] == WorkerScore(4, 3)
    newer = backend.reopen()  # a newer writer still fences this one out
    from cairn.cache_service.redis_store import StoreSuperseded
    with pytest.raises(StoreSuperseded):
        index.apply(a.batch([]))
    assert newer.contents("a")[0] == frozenset(H[:4])


# ---- scoring with media (cairn.cache_service.scoring) ------------------------------------------------

def test_a_score_made_from_hit_and_state_alone_is_all_on_the_device():
    assert WorkerScore(5, 3) == WorkerScore(5, 3, 5, False)
    assert WorkerScore(5, 3).device_pages == 5 and not WorkerScore(5, 3).state_on_host
    assert WorkerScore(5, 3, 2, True) != WorkerScore(5, 3)


def test_walk_scores_finds_each_workers_device_run_and_where_its_state_is():
    a, b, c = 1, 2, 4  # masks of workers a, b, c
    pages = [  # per page: (page mask, state mask, host page mask, host state mask)
        (a | b | c, 0, 0, 0),
        (a | b | c, a | c, 0, c),     # c's state here is on the host, its page is not
        (a | b | c, 0, b, 0),         # b's device run ends here
        (a | b, b, b, b),             # c's hit ends here; b's state on the host with its page
        (a | b, a, a, 0),             # a's device run ends here, its state (on the device) over a host page
        (a, 0, a, 0),
    ]
    scores = walk_scores(iter(pages), a | b | c, {"a": 0, "b": 1, "c": 2})
    assert scores == {"a": WorkerScore(6, 5, 4, False), "b": WorkerScore(5, 4, 2, True),
                      "c": WorkerScore(3, 2, 3, True)}


def test_walk_scores_of_a_run_on_the_host_from_its_first_page_has_no_device_pages():
    masks = [(1, 0, 1, 0), (1, 1, 1, 1), (0, 0, 0, 0)]
    assert walk_scores(iter(masks), 1, {"a": 0, "untrusted": 1}) == {
        "a": WorkerScore(2, 2, 0, True), "untrusted": WorkerScore(0, 0)}
    assert walk_scores(iter([(1, 0, 0, 0)]), 0, {"a": 0}) == {"a": WorkerScore(0, 0)}, "no trusted worker"
