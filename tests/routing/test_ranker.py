"""The router's state and decisions without Ray (`cairn.cluster.routing.ranker`): it reads the index's
scores, merges predicted holders (`cairn.cluster.routing.predicted`), counts in-flight load, never fails
because the index does, and reads the request without writing it."""

import asyncio
import random

import pytest

from cairn.cache_service.scoring import WorkerScore
from cairn.cluster.routing.routing_config import RoutingConfig
from cairn.cluster.routing.cost import ReplicaLoad
from cairn.cluster.routing.predicted import PredictedHolders
from cairn.cluster.routing.ranker import AffinityRanker
from cairn.workers.request import FetchHint
from tests.support.routing_cases import CFG, H, PAGE, PAGE_BYTES, STATE_BYTES, Clock, rank, request, routed


def test_the_ranker_reads_the_actors_scores_with_their_media_and_an_older_actors_pairs_as_the_device():
    async def main():
        ranker = AffinityRanker(CFG, rng=random.Random(0))

        async def index(hashes):
            return {"a": (40, 30, 10, True), "b": (40, 30, 40, False)}

        async def older(hashes):
            return {"a": (40, 30)}
        return ((await ranker.rank("r1", request(40), {"a": {}, "b": {}, "c": {}}, index)).order,
                (await ranker.rank("r2", request(40), {"a": {}, "b": {}}, older)).order)

    media, pairs = asyncio.run(main())
    assert media == ["b", "a", "c"] and pairs[0] == "a"


def test_with_fetch_load_moves_a_conversation_off_its_busy_holder_and_the_request_names_the_holder():
    fetch = CFG.model_copy(update=dict(fetch=True, fetch_bandwidth_bytes_per_s=50e9))
    busy = {"a": ReplicaLoad(requests=1, tokens=600)}  # its load weighs less than its cache...
    assert rank({"a": (40, 30)}, loads=busy, config=CFG)[0] == "a", "without fetch the cache keeps it there"
    assert rank({"a": (40, 30)}, loads=busy, config=fetch)[0] != "a", "...but more than a fetch of it"

    async def main(config):
        ranker = AffinityRanker(config, rng=random.Random(0))
        req = routed(H[:40], 40 * PAGE + 5)
        before = repr(req)

        async def index(hashes):
            return {"a": (40, 30), "b": (10, 5)}
        ranking = await ranker.rank("r", req, {"a": {}, "b": {}, "c": {}}, index)
        assert repr(req) == before, "the ranker reads the request, never writes it"
        return ranking.fetch
    assert asyncio.run(main(fetch)) == FetchHint("a", 30)
    assert asyncio.run(main(CFG)) is None, "fetch off: no hint"


def test_predicted_holders_name_the_deepest_recorded_page_younger_than_the_age_asked():
    clock = Clock()
    held = PredictedHolders(keep_s=10.0, clock=clock)
    held.record("a", H[:10])
    clock.now += 1
    held.record("b", H[:4])
    assert held.pages(H[:12], max_age_s=2) == {"a": (10, 10), "b": (4, 4)}
    assert held.pages(H[20:30], max_age_s=2) == {}
    clock.now += 1.5  # a's record is older than 2 s, b's is not
    assert held.pages(H[:12], max_age_s=2) == {"b": (4, 4)}
    assert held.pages(H[:12], max_age_s=10) == {"a": (10, 10), "b": (4, 4)}, "an older record is still remembered"
    clock.now += 9
    assert held.pages(H[:12], max_age_s=10) == {} and held._at == {}, "past keep_s nothing is left behind"


@pytest.mark.parametrize("seed", range(5))
def test_predicted_depths_equal_the_deepest_unexpired_record_of_each_replica(seed):
    rng, clock = random.Random(seed), Clock()
    held = PredictedHolders(keep_s=30.0, clock=clock, max_hashes=rng.choice([40, 400, 10_000]))
    chains = [[bytes([c, k]) * 8 for k in range(30)] for c in range(3)]
    log = []  # (time, replica, prompt) of every record
    for _ in range(300):
        clock.now += rng.uniform(0, 2)
        chain = rng.choice(chains)
        prompt = chain[:rng.randint(1, 30)]
        replica = rng.choice("abcd")
        held.record(replica, prompt)
        log.append((clock.now, replica, prompt))
        ask = rng.choice(chains)[:rng.randint(1, 30)]
        age = rng.choice([1.0, 5.0, 30.0])
        kept = held._size  # what the bound left: the newest records whose hashes fit in it
        survivors, size = [], 0
        for at, r, p in reversed(log):
            if at <= clock.now - 30.0 or size + len(p) > kept:
                break
            survivors.append((at, r, p))
            size += len(p)
        want = {}
        for at, r, p in survivors:
            if at > clock.now - age:
                depth = next((k for k in range(min(len(p), len(ask)), 0, -1) if p[:k] == ask[:k]), 0)
                if depth:
                    want[r] = max(want.get(r, 0), depth)
        assert held.pages(ask, age) == {r: (depth, depth) for r, depth in want.items()}


def test_a_recurrents_predicted_state_is_where_the_request_leaves_one_not_where_a_prompt_parts_from_it():
    clock = Clock()
    held = PredictedHolders(keep_s=10.0, clock=clock)
    held.record("a", H[:20], state_pages=[12, 19, 20, 0, 99])  # 0 and 99: no such depth
    assert held.pages(H[:20], 5, states=True) == {"a": (20, 20)}
    assert held.pages(H[:15] + H[30:35], 5, states=True) == {"a": (15, 12)}, "parting at 15: the state at 12"
    assert held.pages(H[:10], 5, states=True) == {"a": (10, 0)}, "its pages, but no state under 12"
    clock.now += 11
    assert held.pages(H[:20], 20, states=True) == {} and held._states == {}


def test_a_replica_that_resumed_a_prompt_deep_is_not_taken_to_hold_a_state_at_a_shallower_message_start():
    """The fetch scenario: b resumes a hot prompt at page 20 (pulled from a), so it leaves no
    state at the message start at page 15 it skipped; a prompt parting there goes to a, which
    holds that state, not to b on a guess (b would recompute it all)."""
    async def main():
        ranker = AffinityRanker(CFG.model_copy(update=dict(fetch=True)), clock=Clock(), rng=random.Random(0))
        replicas = {"a": {}, "b": {}}
        hot = routed(H[:22], 22 * PAGE + 5)
        hot.checkpoint_hints = [15 * PAGE + 3, 21 * PAGE + 2]

        async def index(hashes):  # a holds the hot prompt, with states at 15 and 20
            shared = next((k for k in range(len(hashes), 0, -1) if hashes[:k] == H[:k]), 0)
            deepest = max((j for j in (15, 20) if j <= shared), default=0)
            return {"a": WorkerScore(min(shared, 22), deepest)} if shared else {}
        ranker.loads["a"] = ReplicaLoad(requests=8, tokens=0)  # a is busy: the hot prompt goes to b
        ranking = await ranker.rank("hot", hot, replicas, index)
        assert ranking.order[0] == "b" and ranking.fetch == FetchHint("a", 20)
        ranker.on_routed("hot", "b", hot)
        ranker.loads["a"] = ReplicaLoad(requests=1, tokens=0)
        parting = routed(H[:16] + H[60:66], 22 * PAGE + 5)  # shares 16 pages, parts inside page 17
        scores = await ranker._scores(parting.page_hashes, index)
        return scores

    scores = asyncio.run(main())
    assert scores["b"] == WorkerScore(16, 0), "b's pages, but no state under 21: it resumed at 20"
    assert scores["a"].state_pages == 15


def test_the_memory_is_bounded_and_forgets_the_oldest_records_first():
    clock = Clock()
    held = PredictedHolders(keep_s=100.0, clock=clock, max_hashes=25)
    for i, replica in enumerate("abc"):
        clock.now += 1
        held.record(replica, H[40 * i:40 * i + 10])
    held.record("d", H[:10])  # 40 hashes held > 25: a's and b's records go, d's copy of a's chain stays
    assert held.pages(H[:10], 100) == {"d": (10, 10)} and held.pages(H[40:50], 100) == {}
    assert held.pages(H[80:90], 100) == {"c": (10, 10)} and held._size <= 25
    held.forget("d")
    assert held.pages(H[:10], 100) == {} and "d" not in held._at, "a forgotten replica's hashes leave nothing"


async def no_index(hashes):
    return {}


def test_a_burst_sharing_a_new_prefix_sticks_together_until_the_prediction_expires():
    async def main():
        clock = Clock()
        ranker = AffinityRanker(CFG, clock=clock, rng=random.Random(0))
        replicas = {r: {} for r in "abc"}
        first = (await ranker.rank("r0", request(60), replicas, no_index)).order
        ranker.on_routed("r0", first[0], request(60))
        followers = []
        for i in range(1, 4):  # the index knows nothing yet: events have not arrived
            order = (await ranker.rank(f"r{i}", request(60), replicas, no_index)).order
            ranker.on_routed(f"r{i}", order[0], request(60))
            followers.append(order[0])
        clock.now += 2.5  # the index answers (it knows nothing): only fresh predictions count
        later = (await ranker.rank("r9", request(60), replicas, no_index)).order
        return first[0], followers, later[0]

    first, followers, later = asyncio.run(main())
    assert followers == [first] * 3
    assert later != first, "once the prediction expires, the busy replica loses to idle ones"


def test_when_the_index_cannot_answer_the_router_remembers_where_it_sent_each_conversation():
    async def main():
        clock = Clock()
        ranker = AffinityRanker(CFG.model_copy(update=dict(fallback_memory_s=60)), clock=clock, rng=random.Random(0))
        replicas = {r: {} for r in "abc"}
        homes = {}
        for conv in range(3):  # three conversations, spread by load
            turn = routed(H[50 * conv:50 * conv + 20], 20 * PAGE + 5)
            order = (await ranker.rank(f"c{conv}", turn, replicas, no_index)).order
            ranker.on_routed(f"c{conv}", order[0], turn)
            homes[conv] = order[0]
        clock.now += 30  # long after the fresh predictions: the next turns arrive with the index down

        async def down(hashes):
            raise ConnectionError("index actor restarting")
        down_order = {}
        for conv in range(3):
            turn = routed(H[50 * conv:50 * conv + 30], 30 * PAGE + 5)
            down_order[conv] = ((await ranker.rank(f"c{conv}-2", turn, replicas, down)).order)[0]
        counts = dict(ranker.counts)
        for conv in range(3):
            ranker.on_completed(f"c{conv}", homes[conv])
        clock.now += 10  # the breaker has closed, the ranked turns no longer count as tentative load
        ranker.loads[homes[0]] = ReplicaLoad(tokens=2)  # a hair more load at the remembered home
        up_order = (await ranker.rank("c0-3", routed(H[:30], 30 * PAGE + 5), replicas, no_index)).order
        return homes, down_order, up_order, counts

    homes, down_order, up_order, counts = asyncio.run(main())
    assert sorted(homes.values()) == ["a", "b", "c"]
    assert down_order == homes, "each turn goes where the router sent its conversation"
    assert counts["index_fallbacks"] == 3 and counts["index_errors"] == 3
    assert up_order[0] != homes[0], "an answering index (that holds nothing) outranks an old memory"


def test_with_the_memory_off_a_down_index_still_leaves_the_fresh_predictions():
    async def main():
        ranker = AffinityRanker(CFG.model_copy(update=dict(fallback_memory_s=0, fallback_memory_pages=0)),
                                rng=random.Random(0))
        replicas = {r: {} for r in "abc"}
        first = ((await ranker.rank("r0", request(40), replicas, no_index)).order)[0]
        ranker.on_routed("r0", first, request(40))

        async def down(hashes):
            raise ConnectionError("index actor restarting")
        return first, ((await ranker.rank("r1", request(40), replicas, down)).order)[0]

    first, second = asyncio.run(main())
    assert second == first, "the prompt just sent there still counts as held there"


def test_the_ranker_spreads_a_burst_frees_finished_prefill_and_keeps_turns_when_the_index_fails():
    chains = [[bytes([i, k]) * 8 for k in range(31)] for i in range(3)]  # page hashes name their prefix
    ranker = AffinityRanker(RoutingConfig(predicted_holder_ttl_s=30, page_size=16, recurrent=True,
                                          page_bytes=PAGE_BYTES, state_bytes=STATE_BYTES), rng=random.Random(0))
    replicas = {"a": {}, "b": {}, "c": {}}

    async def slow_index(hashes):
        await asyncio.sleep(0.01)  # every request of the burst is ranked while the others await
        return {}

    async def down(hashes):
        raise ConnectionError("index actor restarting")

    async def main():
        burst = [routed(chains[i][:30], 490) for i in range(3)]
        orders = [r.order for r in await asyncio.gather(*(ranker.rank(f"r{i}", r, replicas, slow_index)
                                                          for i, r in enumerate(burst)))]
        assert sorted(order[0] for order in orders) == ["a", "b", "c"], "a burst ranked at once spreads"
        for i, (r, order) in enumerate(zip(burst, orders)):
            r.request_id = f"r{i}"
            ranker.on_routed(f"r{i}", order[0], r)
        holder = orders[0][0]
        assert ranker.loads[holder] == ReplicaLoad(requests=1, tokens=490)
        ranker.on_prefill_done("r0")  # the ingress saw its first output
        assert ranker.loads[holder] == ReplicaLoad(requests=1, tokens=0)
        for i, order in enumerate(orders):
            ranker.on_completed(f"r{i}", order[0])
        assert ranker.loads[holder] == ReplicaLoad()
        ranker.on_routed("busy", holder, routed([], 300))  # the holder is the busiest now
        order = (await ranker.rank("r0-turn2", routed(chains[0], 500), replicas, down)).order  # extends r0's prompt
        assert order[0] == holder, "the index is down: the router's own prediction keeps the turn"
    asyncio.run(main())


def test_a_report_taken_before_the_last_turn_finished_does_not_count_that_turn():
    wall = Clock()
    ranker = AffinityRanker(CFG, rng=random.Random(0), wall_clock=wall)

    async def index(hashes):
        return {"a": (20, 20)}  # the conversation's home holds its first turn: 3 pages more than b's

    async def main():
        turn = routed(H[:20], 20 * PAGE + 5)
        ranker.on_routed("t1", "a", turn)
        wall.now += 1.0
        report = dict(running_requests=1, states_in_use=1, states_total=8, taken_at=wall.now)  # t1 running
        wall.now += 0.5
        ranker.on_completed("t1", "a")
        wall.now += 0.5
        other = {"b": {}}
        home = (await ranker.rank("t2", routed(H[:23], 23 * PAGE + 5), {"a": report, **other}, index)).order
        # a request routed there after the report and finished since was never in it: it frees nothing
        ranker.on_routed("x", "a", turn)
        wall.now += 0.1
        ranker.on_completed("x", "a")
        busy = dict(report, running_requests=3, states_in_use=3)
        later = (await ranker.rank("t3", routed(H[:23], 23 * PAGE + 5), {"a": busy, **other}, index)).order
        return home, later

    home, later = asyncio.run(main())
    assert home[0] == "a", "the home's report still shows the finished turn, which the router knows is gone"
    assert later[0] == "b", "two requests of others still run there: the report stands, less t1 alone"


def test_in_flight_accounting_follows_routing_and_completion():
    async def main():
        ranker = AffinityRanker(CFG, rng=random.Random(0))

        async def index(hashes):
            return {"a": (10, 8)}
        await ranker.rank("r1", request(20), {"a": {}, "b": {}}, index)
        ranker.on_routed("r1", "a", request(20))
        ranker.on_routed("r1", "a", request(20))  # reported twice: counted once
        assert ranker.loads["a"] == ReplicaLoad(requests=1, tokens=20 * PAGE + 5 - 8 * PAGE)
        ranker.on_completed("r1", "b")  # not there: nothing happens
        ranker.on_completed("r1", "a")
        ranker.on_completed("r1", "a")
        assert ranker.loads["a"] == ReplicaLoad()
    asyncio.run(main())


@pytest.mark.parametrize("failure", ["timeout", "error"])
def test_an_index_that_is_slow_or_down_leaves_routing_by_load_and_is_counted(failure):
    async def main():
        fallbacks = []
        ranker = AffinityRanker(CFG, rng=random.Random(0), on_fallback=fallbacks.append)
        ranker.loads["a"] = ReplicaLoad(requests=2)

        async def index(hashes):
            if failure == "timeout":
                await asyncio.sleep(10)
            raise ConnectionError("index actor died")
        loop = asyncio.get_running_loop()
        start = loop.time()
        order = (await ranker.rank("r1", request(60), {"a": {}, "b": {}}, index)).order
        return order, loop.time() - start, fallbacks, ranker.counts

    order, elapsed, fallbacks, counts = asyncio.run(main())
    assert order == ["b", "a"], "by load alone"
    assert elapsed < 0.5, "the router waits index_timeout_ms, not for the index"
    assert fallbacks == [failure] and counts["index_fallbacks"] == 1
    assert counts["index_timeouts" if failure == "timeout" else "index_errors"] == 1


def test_a_request_without_page_hashes_is_ranked_by_load_without_asking_the_index():
    async def main():
        ranker = AffinityRanker(CFG, rng=random.Random(0))
        ranker.loads["a"] = ReplicaLoad(requests=1)
        asked = []

        async def index(hashes):
            asked.append(hashes)
            return {}
        return (await ranker.rank("r1", routed(None, 10), {"a": {}, "b": {}}, index)).order, asked, ranker.counts

    order, asked, counts = asyncio.run(main())
    assert order == ["b", "a"] and asked == [] and counts["index_fallbacks"] == 0
