"""What a replica costs a request, and the ranking that follows (`cairn.cluster.routing.cost`): the
resume point, load, host copies priced at measured rates, spill, move and fetch. Pure functions."""

import pytest

from cairn.cache_service.scoring import WorkerScore, resume_at_token
from cairn.cluster.routing.cost import ReplicaLoad, host_copy_tokens, replica_cost, reported_load, routing_stats
from cairn.workers.engine_metrics import EngineMetrics
from tests.support.routing_cases import CFG, PAGE, PAGE_BYTES, STATE_BYTES, rank


def test_a_recurrent_resumes_at_its_deepest_state_and_an_attention_model_at_its_page_hit():
    assert resume_at_token(10, 6, 1000, PAGE, recurrent=True) == 96
    assert resume_at_token(10, 6, 1000, PAGE, recurrent=False) == 160
    assert resume_at_token(10, 0, 1000, PAGE, recurrent=True) == 0


def test_the_last_prompt_token_is_always_computed():
    assert resume_at_token(4, 4, 64, PAGE, recurrent=True) == 63
    assert resume_at_token(4, 4, 1, PAGE, recurrent=False) == 0
    assert resume_at_token(0, 0, 0, PAGE, recurrent=True) == 0


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


def test_requests_finished_since_the_report_leave_its_count_and_free_their_share():
    stats = dict(running_requests=2, waiting_requests=0, pages_in_use=40, pages_total=100, states_in_use=2,
                 states_total=8)
    assert reported_load(None, stats, finished=1) == ReplicaLoad(0, 0, 1, pytest.approx(0.2))
    assert reported_load(None, stats, finished=2) == ReplicaLoad(0, 0, 0, 0.0)
    assert reported_load(None, stats, finished=5) == ReplicaLoad(0, 0, 0, 0.0), "never below nothing"
    # a home whose report still shows its last turn running: its 3 pages of resume win once that turn is gone
    stale = reported_load(None, dict(running_requests=1, states_in_use=1, states_total=8))
    assert rank({"a": (3, 3)}, {"a": stale}, replicas=("a", "b"))[0] == "b"
    assert rank({"a": (3, 3)}, {"a": reported_load(None, dict(running_requests=1, states_in_use=1,
                                                              states_total=8), finished=1)},
                replicas=("a", "b"))[0] == "a"


def test_routing_stats_come_from_engine_metrics():
    stats = routing_stats(EngineMetrics(running_requests=2, waiting_requests=1, pages_held=30, pages_total=120),
                          max_num_seqs=8, taken_at=100.0)
    assert reported_load(None, stats) == ReplicaLoad(0, 0, 3, 0.25) and stats["taken_at"] == 100.0
    measured = routing_stats(EngineMetrics(host_copy_bytes_per_s=5e9, prefill_tokens_per_s=2000.0, step_seconds=0.03),
                             max_num_seqs=8, taken_at=100.0)
    load = reported_load(None, measured)
    assert (load.host_copy_bytes_per_s, load.prefill_tokens_per_s, load.step_seconds) == (5e9, 2000.0, 0.03)
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


def test_with_fetch_a_replica_without_the_cache_costs_the_holders_prefill_plus_the_transfer_and_its_wait():
    fetch = CFG.model_copy(update=dict(fetch=True, fetch_bandwidth_bytes_per_s=10e9, step_seconds=0.01))
    holder, empty, idle = WorkerScore(40, 30), WorkerScore(0, 0), ReplicaLoad()
    n = 40 * PAGE + 5
    rate, trip = fetch.prefill_tokens_per_s, fetch.fetch_round_trip_s
    transfer = (30 * PAGE_BYTES + STATE_BYTES) / 10e9 * rate
    prior = fetch.step_seconds  # the holder's step, until it reports the one it measured
    assert replica_cost(empty, idle, fetch, n, holder) == \
        pytest.approx(n - 30 * PAGE + transfer + (prior + trip) * rate)
    assert replica_cost(empty, idle, CFG, n, holder) == n, "fetch off: it recomputes"
    partly = WorkerScore(10, 5)  # its own first 10 pages need not move
    assert replica_cost(partly, idle, fetch, n, holder) == \
        pytest.approx(n - 30 * PAGE + ((20 * PAGE_BYTES + STATE_BYTES) / 10e9 + prior + trip) * rate)
    stepping = ReplicaLoad(step_seconds=0.02)  # the holder copies between its steps: the request waits one out
    assert replica_cost(empty, idle, fetch, n, holder, stepping) == \
        pytest.approx(n - 30 * PAGE + transfer + (0.02 + trip) * rate)
    measured = ReplicaLoad(prefill_tokens_per_s=2000.0)  # seconds become tokens at the receiver's own rate
    assert replica_cost(empty, measured, fetch, n, holder, stepping) == \
        pytest.approx(n - 30 * PAGE + (transfer / rate + 0.02 + trip) * 2000.0)
    slow = fetch.model_copy(update=dict(fetch_bandwidth_bytes_per_s=1e6))
    assert replica_cost(empty, idle, slow, n, holder) == n, "a transfer slower than recomputing is not taken"


def test_a_conversation_stays_over_a_small_load_gap_because_a_fetch_waits_for_its_holders_step():
    """A fetch priced by its bytes alone looks free, so one in-flight request at the holder would
    move the turn, which then waits for that very replica's step anyway. Priced with the holder's
    measured step, the turn stays until the holder's load outweighs the wait."""
    fetch = CFG.model_copy(update=dict(fetch=True, fetch_bandwidth_bytes_per_s=100e9))  # a NIC: 12 tokens' transfer
    scores, n = {"home": (40, 40)}, 40 * PAGE + 20
    busy = ReplicaLoad(requests=2, step_seconds=0.05)  # two requests decoding at home, 50 ms steps
    assert rank(scores, {"home": busy}, n, fetch, ("home", "away")) == ["home", "away"]
    quick = ReplicaLoad(requests=2, step_seconds=0.001)  # a step too short to wait for: the load moves it
    assert rank(scores, {"home": quick}, n, fetch, ("home", "away")) == ["away", "home"]
    unmeasured = ReplicaLoad(requests=2)
    assert rank(scores, {"home": unmeasured}, n, fetch, ("home", "away")) == ["home", "away"], \
        "a holder that has not measured its steps yet is priced at the config's step"
    crowded = ReplicaLoad(requests=7, tokens=1000, step_seconds=0.05)  # its queue outweighs one step's wait
    assert rank(scores, {"home": crowded}, n, fetch, ("home", "away")) == ["away", "home"]
