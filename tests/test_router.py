"""The router sends a request where it recomputes the least, unless that replica is busy; it never
fails because the index does. Plain ranking first (no Ray), then the Ray Serve adapter driven by
Serve's own fake replicas (no Ray session)."""

import asyncio
import itertools
import random

import pytest

from cache_service.scoring import WorkerScore, resume_at_token
from cluster.routing.config import RoutingConfig
from cluster.routing.cost import (ReplicaLoad, host_copy_tokens, rank_replicas, replica_cost, reported_load,
                                  routing_stats)
from cluster.routing.predicted import PredictedHolders
from cluster.routing.ranker import AffinityRanker
from cluster.routing.router import replica_worker_id
from workers.metrics import EngineMetrics
from workers.request import FetchHint, GenerateRequest

PAGE = 16
PAGE_BYTES, STATE_BYTES = 2 << 20, 64 << 20  # a large hybrid model's page and state, in bytes
CFG = RoutingConfig(page_size=PAGE, recurrent=True, page_bytes=PAGE_BYTES, state_bytes=STATE_BYTES,
                    load_weight=0.5, request_load_tokens=256, occupancy_load_tokens=2048,
                    spill_limit=4, predicted_holder_ttl_s=2.0, index_mode="remote", index_timeout_ms=50)
H = [bytes([i]) * 16 for i in range(200)]


_ids = itertools.count()


def routed(page_hashes: list[bytes] | None, num_prompt_tokens: int, prompt: str | None = "hello",
           messages: list | None = None) -> GenerateRequest:
    """A request as the ingress makes it, with `num_prompt_tokens` tokens and these page hashes."""
    return GenerateRequest(f"req-{next(_ids)}", [0] * num_prompt_tokens, prompt=prompt, messages=messages,
                           page_hashes=None if page_hashes is None else list(page_hashes))


def request(pages: int, extra_tokens: int = 5) -> GenerateRequest:
    return routed(H[:pages], pages * PAGE + extra_tokens)


def rank(scores, loads=None, n=1000, config=CFG, replicas=("a", "b", "c"), seed=0):
    """`scores`: replica -> WorkerScore fields, (hit_pages, state_pages) alone meaning all on the device."""
    scores = {r: WorkerScore(*s) for r, s in scores.items()}
    return rank_replicas(list(replicas), scores, loads or {}, config, n, random.Random(seed))


# ---- the resume point (design rule 4) --------------------------------------------------------

def test_a_recurrent_resumes_at_its_deepest_state_and_an_attention_model_at_its_page_hit():
    assert resume_at_token(10, 6, 1000, PAGE, recurrent=True) == 96
    assert resume_at_token(10, 6, 1000, PAGE, recurrent=False) == 160
    assert resume_at_token(10, 0, 1000, PAGE, recurrent=True) == 0


def test_the_last_prompt_token_is_always_computed():
    assert resume_at_token(4, 4, 64, PAGE, recurrent=True) == 63
    assert resume_at_token(4, 4, 1, PAGE, recurrent=False) == 0
    assert resume_at_token(0, 0, 0, PAGE, recurrent=True) == 0


# ---- ranking ---------------------------------------------------------------------------------

def test_the_deepest_resume_point_wins():
    assert rank({"a": (40, 10), "b": (50, 30), "c": (60, 0)}) == ["b", "a", "c"]


def test_pages_without_a_usable_state_score_as_a_miss_for_a_recurrent():
    busy_a = {"a": ReplicaLoad(tokens=2)}  # a hair more load on the replica with the pages
    assert rank({"a": (60, 0)}, busy_a, replicas=("a", "b")) == ["b", "a"]
    attention = CFG.model_copy(update=dict(recurrent=False))
    assert rank({"a": (60, 0)}, busy_a, replicas=("a", "b"), config=attention) == ["a", "b"]


def test_load_breaks_a_tie_between_equal_resume_points():
    scores = {"a": (20, 20), "b": (20, 20), "c": (20, 20)}
    loads = {"a": ReplicaLoad(requests=2), "b": ReplicaLoad(requests=1), "c": ReplicaLoad(requests=3)}
    assert rank(scores, loads) == ["b", "a", "c"]


def test_equal_costs_spread_at_random():
    firsts = {rank({}, seed=seed)[0] for seed in range(30)}
    assert firsts == {"a", "b", "c"}


def test_load_overrides_a_small_cache_gain_but_not_a_large_one():
    one_request = {"a": ReplicaLoad(requests=1, tokens=100)}  # 0.5 * (100 + 256) = 178 tokens of cost
    assert rank({"a": (3, 3)}, one_request, replicas=("a", "b"))[0] == "b", "48 tokens saved < 178 of load"
    assert rank({"a": (30, 30)}, one_request, replicas=("a", "b"))[0] == "a", "480 tokens saved > 178 of load"


def test_reported_stats_count_load_the_router_did_not_send():
    full = reported_load(None, dict(running_requests=3, waiting_requests=2, pages_in_use=90, pages_total=100,
                                    states_in_use=1, states_total=8))
    assert full.reported_requests == 5 and full.occupancy == pytest.approx(0.9)
    assert rank({"a": (10, 10)}, {"a": full}, replicas=("a", "b"))[0] == "b"
    assert reported_load(ReplicaLoad(requests=2, tokens=7), {"pages_total": 0, "running_requests": "x"}) == \
        ReplicaLoad(2, 7, 0, 0.0), "malformed stats count as none"


def test_routing_stats_come_from_engine_metrics():
    stats = routing_stats(EngineMetrics(running_requests=2, waiting_requests=1, pages_held=30, pages_total=120),
                          max_num_seqs=8)
    assert reported_load(None, stats) == ReplicaLoad(0, 0, 3, 0.25)
    measured = routing_stats(EngineMetrics(host_copy_bytes_per_s=5e9, prefill_tokens_per_s=2000.0), max_num_seqs=8)
    load = reported_load(None, measured)
    assert (load.host_copy_bytes_per_s, load.prefill_tokens_per_s) == (5e9, 2000.0)
    assert reported_load(None, {"host_copy_bytes_per_s": "x", "prefill_tokens_per_s": -1}) == ReplicaLoad(), \
        "malformed rates count as unmeasured"


def test_a_host_copy_is_priced_at_the_rates_the_replica_measured_and_at_the_configs_until_then():
    on_host = WorkerScore(40, 30, 10, True)  # pages 10..29 and the state come back from the host
    copy_bytes = 20 * PAGE_BYTES + STATE_BYTES
    assert host_copy_tokens(on_host, CFG) == \
        pytest.approx(copy_bytes / CFG.host_bandwidth_bytes_per_s * CFG.prefill_tokens_per_s), "not yet measured"
    measured = ReplicaLoad(host_copy_bytes_per_s=1e9, prefill_tokens_per_s=500.0)
    assert host_copy_tokens(on_host, CFG, measured) == pytest.approx(copy_bytes / 1e9 * 500.0)
    slow_link = {"a": ReplicaLoad(host_copy_bytes_per_s=1e8)}  # 1.3 s of copying: more than recomputing
    assert rank({"a": (40, 30, 10, True), "b": (10, 10)}, replicas=("a", "b"))[0] == "a"
    assert rank({"a": (40, 30, 10, True), "b": (10, 10)}, loads=slow_link, replicas=("a", "b"))[0] == "b"


def test_a_replica_past_the_spill_limit_ranks_after_all_others_whatever_its_cache():
    scores = {"a": (60, 60)}
    at_limit = {"a": ReplicaLoad(requests=4), "b": ReplicaLoad(requests=0), "c": ReplicaLoad(requests=1)}
    below = dict(at_limit, a=ReplicaLoad(requests=3))
    no_weight = CFG.model_copy(update=dict(load_weight=0.0))
    assert rank(scores, below, config=no_weight)[0] == "a"
    assert rank(scores, at_limit, config=no_weight)[-1] == "a"
    everyone_busy = {r: ReplicaLoad(requests=9) for r in "abc"}  # relative to the least loaded
    assert rank(scores, everyone_busy, config=no_weight)[0] == "a"


# ---- hits in host memory -----------------------------------------------------------------------

def test_a_hit_on_the_host_costs_exactly_its_copy_time_in_tokens_more_than_the_same_hit_on_the_device():
    load, n = ReplicaLoad(requests=1, tokens=50), 1000
    on_device, on_host = WorkerScore(40, 30), WorkerScore(40, 30, 10, True)  # pages 10..29 and the state
    copy_s = (20 * PAGE_BYTES + STATE_BYTES) / CFG.host_bandwidth_bytes_per_s
    assert replica_cost(on_host, load, CFG, n) - replica_cost(on_device, load, CFG, n) == \
        pytest.approx(copy_s * CFG.prefill_tokens_per_s)
    assert host_copy_tokens(WorkerScore(40, 30, 30, False), CFG) == 0, "pages past the resume point cost nothing"
    attention = CFG.model_copy(update=dict(recurrent=False))  # resumes at its page hit, needs no state
    assert host_copy_tokens(on_host, attention) == \
        pytest.approx(30 * PAGE_BYTES / CFG.host_bandwidth_bytes_per_s * CFG.prefill_tokens_per_s)


def test_a_device_hit_beats_the_same_hit_on_the_host_which_beats_a_miss_unless_copying_is_slower_than_recomputing():
    assert rank({"a": (40, 30, 10, True), "b": (40, 30), "c": (0, 0)}) == ["b", "a", "c"]
    deep_on_host, shallow_on_device = (30, 30, 0, True), (10, 10)  # 480 tokens saved vs 160
    assert rank({"a": deep_on_host, "b": shallow_on_device}, replicas=("a", "b")) == ["a", "b"]
    slow = CFG.model_copy(update=dict(host_bandwidth_bytes_per_s=1e9))  # 130 MB: 1,300 tokens of copying
    assert rank({"a": deep_on_host, "b": shallow_on_device}, replicas=("a", "b"), config=slow) == ["b", "a"]


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


# ---- move and fetch ----------------------------------------------------------------------------

def test_with_fetch_a_replica_without_the_cache_costs_the_holders_prefill_plus_the_transfer():
    fetch = CFG.model_copy(update=dict(fetch=True, fetch_bandwidth_bytes_per_s=10e9))
    holder, empty, idle = WorkerScore(40, 30), WorkerScore(0, 0), ReplicaLoad()
    n = 40 * PAGE + 5
    transfer = (30 * PAGE_BYTES + STATE_BYTES) / 10e9 * fetch.prefill_tokens_per_s
    assert replica_cost(empty, idle, fetch, n, holder) == pytest.approx(n - 30 * PAGE + transfer)
    assert replica_cost(empty, idle, CFG, n, holder) == n, "fetch off: it recomputes"
    partly = WorkerScore(10, 5)  # its own first 10 pages need not move
    assert replica_cost(partly, idle, fetch, n, holder) == \
        pytest.approx(n - 30 * PAGE + (20 * PAGE_BYTES + STATE_BYTES) / 10e9 * fetch.prefill_tokens_per_s)
    slow = fetch.model_copy(update=dict(fetch_bandwidth_bytes_per_s=1e6))
    assert replica_cost(empty, idle, slow, n, holder) == n, "a transfer slower than recomputing is not taken"


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


# ---- predicted holders -------------------------------------------------------------------------

class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


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


# ---- configuration -----------------------------------------------------------------------------

def test_the_shipped_routing_yaml_loads_and_names_a_router_for_every_policy(tmp_path):
    from pathlib import Path

    config = RoutingConfig.from_yaml(Path(__file__).parent.parent / "configs" / "routing.yaml")
    assert config == RoutingConfig(), "the shipped file spells out the defaults"
    for policy in ("cache_affinity", "pow2", "round_robin", "ray_prefix"):
        rrc = RoutingConfig(policy=policy).request_router_config()
        assert rrc.get_request_router_class().__name__ == \
            {"cache_affinity": "CacheAffinityRouter", "pow2": "PowerOfTwoChoicesRequestRouter",
             "round_robin": "RoundRobinRouter", "ray_prefix": "RayPrefixRouter"}[policy]
    assert RoutingConfig.model_validate(RoutingConfig(load_weight=2).router_kwargs()).load_weight == 2


def test_a_bad_routing_yaml_names_the_file_and_every_bad_field(tmp_path):
    path = tmp_path / "routing.yaml"
    path.write_text("spill_limit: 0\npolicy: nearest\nspil_limit: 3\n")
    with pytest.raises(ValueError) as e:
        RoutingConfig.from_yaml(path)
    message = str(e.value)
    assert str(path) in message and "spill_limit" in message and "policy" in message and "spil_limit" in message
    path.write_text("- a list\n")
    with pytest.raises(ValueError, match="expected a mapping"):
        RoutingConfig.from_yaml(path)


def test_every_config_field_is_described():
    assert all(f.description for f in RoutingConfig.model_fields.values())


# ---- the Ray Serve adapter, with Serve's fake replicas -----------------------------------------

def make_router(config=CFG, scores=None, delay_s=0.0, index=None):
    """A CacheAffinityRouter whose index actor is `index` (default: a fake that answers `scores`
    after `delay_s` and records dropped workers)."""
    from ray.serve._private.common import DeploymentHandleSource, DeploymentID

    from cluster.routing.index_handle import IndexHandle
    from cluster.routing.router import CacheAffinityRouter

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


def test_with_fetch_the_serve_router_sends_the_hint_on_a_copy_and_routes_a_peers_ask_to_its_target():
    from workers.request import ExportRequest

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
        gone = ExportRequest("no-such-replica", original.page_hashes, 0, 50)
        assert await router.choose_replicas(replicas, pending(gone, "req-gone")) == []
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
    from cache_service.events import EventStream, PagesStored, StateStored
    from cache_service.feed import ChangeFeed
    from cache_service.index import CacheIndex

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

    from cluster.routing.router import RayPrefixRouter

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
from cluster.routing.registry import mirror_summaries, router_counts

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
    one registry the ingress reads (cluster.routing.registry)."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
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

    from cache_service.events import EventStream, PagesStored
    from cache_service.feed import ChangeFeed, IndexMirror
    from cache_service.index import CacheIndex
    from cluster.routing.registry import mirror_summaries, register_router

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
