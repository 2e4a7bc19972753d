"""The cluster across nodes, on Ray's own multi-node test utility: a head and worker nodes on this
machine, each with its own raylet and object store, GPUs counted by Ray but absent (the engines
run on the CPU). tests/support/multinode_scenarios.py deploys one app (2 engine replicas asking
`num_gpus: 1`, the index in a real redis-server, Serve's proxy on every node as cairn/configs/serve.yaml
has it, each with an ingress replica beside it) and runs its scenarios in a process of its own,
once for this module; each test here judges what one scenario observed:
- placement: engine replicas on distinct worker nodes; Serve's controller and the index actor on
  the head, even when a process on a worker node is the one that creates the index;
- a multi-turn conversation resumes across requests on its replica, on either worker node;
- requests entering at every node's proxy reach the same cache-aware routing: each proxy hands
  them to the ingress replica of its node, which routes by its own mirror of the index; a
  conversation whose turns enter at different proxies stays on its replica and resumes from its
  cache, a cached prompt goes to the same replica with the same cached tokens whichever proxy it
  enters at, and once traffic stops every ingress's mirror agrees with the index actor within
  seconds;
- a worker node hosting a replica (and a proxy and an ingress replica) is removed abruptly under
  load, with streams in flight entering at the head's proxy: its replica is replaced on the spare
  node, its in-flight requests and streams end with a retryable
  error (503 `engine_unavailable`), streams on the other node go on, the index drops the dead
  replica within seconds, and new requests succeed, on the replacement too;
- the index actor restarted by Ray comes back from Redis exactly; killed for good under load, its
  successor is created on the head, knows every replica from Redis, and no request fails;
- move and fetch (the app redeployed with routing `fetch: true`): a request sharing a hot prompt
  that lands on the replica of the other node, away from the busy holder, pulls the resume point
  through both nodes' object stores and computes what a cold request computes.
"""

import json
import os
import shutil
import subprocess
import sys
import tempfile

import pytest
from tests.support.paths import REPO, SUPPORT

pytestmark = pytest.mark.slow
pytest.importorskip("ray")
pytest.importorskip("openai")

PAGE_SIZE, TAIL_GUARD = 16, 8  # workers.EngineOptions defaults, which the app uses
RETRYABLE = {"status": 503, "code": "engine_unavailable"}


@pytest.fixture(scope="module")
def scenarios(tiny_model_dir, redis_url) -> dict:
    """name -> what the scenario observed (one run of tests/support/multinode_scenarios.py)."""
    ray_tmp = tempfile.mkdtemp(prefix="cairn-mn", dir="/tmp")  # short: Ray's socket paths live under it
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(RAY_TMPDIR=ray_tmp, RAY_AUTH_MODE="disabled", HF_HUB_OFFLINE="1",
               PYTHONPATH=os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p))
    try:
        run = subprocess.run([sys.executable, str(SUPPORT / "multinode_scenarios.py"), str(tiny_model_dir), redis_url],
                             capture_output=True, timeout=330, env=env, cwd=ray_tmp)
        out, err, rc = run.stdout, run.stderr, run.returncode
    except subprocess.TimeoutExpired as e:  # what the scenarios that ended printed still counts
        out, err, rc = e.stdout or b"", e.stderr or b"", "timed out"
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
    found = {}
    for line in out.decode().splitlines():
        if line.startswith("SCENARIO "):
            result = json.loads(line.removeprefix("SCENARIO "))
            found[result["name"]] = result
    print("multinode scenarios:", {name: r["s"] for name, r in found.items()}, "s")
    return {"results": found, "log": err.decode(errors="replace")[-4000:], "rc": rc}


def observed(scenarios: dict, name: str) -> dict:
    result = scenarios["results"].get(name)
    assert result is not None, f"scenario {name} did not run (exit {scenarios['rc']}):\n{scenarios['log']}"
    assert "error" not in result, result["error"]
    return result


def retryable(error: dict | None) -> bool:
    return error is not None and error.get("code") == RETRYABLE["code"] and error.get("type") == "service_unavailable"


def test_engine_replicas_run_on_worker_nodes_and_the_controller_and_the_index_on_the_head(scenarios):
    where = observed(scenarios, "placement")
    engines = [role for name, role in where["actors"].items() if "#Engine#" in name]
    assert sorted(engines) == ["worker0", "worker1"], where["actors"]
    assert where["actors"]["SERVE_CONTROLLER_ACTOR"] == "head"
    assert where["actors"][where["index"]] == "head"


def test_an_index_actor_created_from_a_worker_nodes_process_runs_on_the_head(scenarios):
    """A replica's publisher or router may be the first to look the index up; wherever it runs,
    the index goes to the head, so losing a worker node never takes the index with it."""
    assert observed(scenarios, "placement")["created_from_worker"] == ["head"] * 6


def test_each_conversation_resumes_on_its_replica_turn_after_turn_on_either_worker_node(scenarios):
    result = observed(scenarios, "conversations")
    served = set()
    for conv in result["conversations"]:
        assert len(conv["replicas"]) == 1, conv
        served.update(conv["replicas"])
        prompts, cached = conv["prompts"], conv["cached"]
        for t in range(1, len(prompts)):
            assert prompts[t - 1] - PAGE_SIZE - TAIL_GUARD <= cached[t] < prompts[t], conv
    assert {result["engines"][r] for r in served} == {"worker0", "worker1"}, "conversations ran on both workers"


def test_every_node_has_a_proxy_that_answers_with_an_ingress_replica_beside_it(scenarios):
    result = observed(scenarios, "every_proxy")
    assert sorted(result["proxies"]) == ["head", "worker0", "worker1"], result["proxies"]
    assert sorted(result["ingress_nodes"].values()) == ["head", "worker0", "worker1"], result["ingress_nodes"]
    answers = [result["first"], *result["same_prompt"].values()]
    assert all(a["status"] == 200 and a["replica"] in result["engines"] for a in answers), answers
    print(f"every proxy: all {len(result['proxies'])} serving {result['ready_s']} s after the scenario began")


def test_a_conversation_entering_at_a_different_node_s_proxy_each_turn_resumes_on_its_replica(scenarios):
    """Each turn is routed by another ingress replica's mirror, which must already know what the
    replica cached for the turn before: no ingress remembers where the others sent a request."""
    result = observed(scenarios, "every_proxy")
    for conv in result["conversations"]:
        assert len(set(conv["proxies"])) == 3, conv  # it entered at every node's proxy
        assert len(conv["replicas"]) == 1 and conv["replicas"][0] in result["engines"], conv
        prompts, cached = conv["prompts"], conv["cached"]
        for t in range(1, len(prompts)):
            assert prompts[t - 1] - PAGE_SIZE - TAIL_GUARD <= cached[t] < prompts[t], conv
    # each ingress's router follows the index from its start, not from its first request
    routed = result["routed_meanwhile"]
    assert all(r["ranked"] > 0 and r["index_fallbacks"] == 0 for r in routed.values()), routed
    print("every proxy: requests ranked by each node's ingress, none without the index:",
          {node: r["ranked"] for node, r in sorted(routed.items())})


def test_a_cached_prompt_goes_to_the_same_replica_with_the_same_cached_tokens_through_every_proxy(scenarios):
    result = observed(scenarios, "every_proxy")
    first, same = result["first"], result["same_prompt"]
    assert sorted(same) == ["head", "worker0", "worker1"], same
    assert {a["replica"] for a in same.values()} == {first["replica"]}, (first, same)
    assert len({a["cached"] for a in same.values()}) == 1, same
    assert first["prompt"] - PAGE_SIZE - TAIL_GUARD <= same["head"]["cached"] < first["prompt"], (first, same)


def test_every_ingress_mirror_agrees_with_the_index_once_traffic_stops(scenarios):
    """Same feed epoch and cursor, same digest (contents, media, trust, seq numbers) as the index
    actor's, every engine replica known: within seconds of the last response."""
    result = observed(scenarios, "every_proxy")
    states, index = result["ingresses"], result["index"]
    assert sorted(s["node"] for s in states) == ["head", "worker0", "worker1"], states
    mirrors = [m for s in states for m in s["routers"] if m["deployment"] == "Engine"]
    assert len(mirrors) >= len(states) and all(s["routers"] for s in states), states
    assert result["agreed_s"] is not None, f"mirrors {states} never agreed with the index {index}"
    assert result["agreed_s"] < 15, result["agreed_s"]
    for m in mirrors:  # as last seen, when they agreed
        assert (m["epoch"], m["cursor"], m["digest"]) == (index["epoch"], index["cursor"], index["digest"]), m
        assert m["workers"] == sorted(result["engines"]) and m["pages"] > 0, m
    print(f"every proxy: {len(mirrors)} mirrors on {len(states)} ingress replicas agreed with the index "
          f"({mirrors[0]['pages']} pages, cursor {index['cursor']}) {result['agreed_s']} s after the last response")


def test_a_lost_node_s_replica_is_replaced_on_the_spare_node(scenarios):
    loss = observed(scenarios, "node_loss")
    (new,) = set(loss["after"]) - set(loss["before"])
    assert loss["after"][new] == "worker2", loss["after"]  # the spare: the other worker still has its GPU in use
    assert loss["victim"] not in loss["after"]
    assert loss["replaced_s"] < 60, loss["replaced_s"]
    print(f"node loss: index dropped the replica after {loss['index_dropped_s']} s, replacement serving after "
          f"{loss['replaced_s']} s and in the index after {loss['replacement_indexed_s']} s")


def test_requests_in_flight_on_a_lost_node_end_with_a_retryable_error_and_others_go_on(scenarios):
    loss = observed(scenarios, "node_loss")
    victim = loss["victim"]
    on_victim = [s for s in loss["streams"] if s["replica"] == victim]
    elsewhere = [s for s in loss["streams"] if s["replica"] != victim]
    assert all(s["status"] == 200 for s in loss["streams"]), loss["streams"]
    assert on_victim and elsewhere, "streams were in flight on both replicas"
    for s in on_victim:
        assert s["done"] and retryable(s["error"]) and s["end"] < 20, s  # an error event, then [DONE]
    for s in elsewhere:
        assert s["error"] is None and s["end"] > 0, s  # streaming on after the loss
    failed = [o for o in loss["load"] if o["status"] != 200]
    assert all(o["status"] == RETRYABLE["status"] and retryable(o["error"]) for o in failed), failed
    assert all(o["start"] < loss["index_dropped_s"] for o in failed), "only requests sent before the index " \
                                                                     "dropped the replica may fail"
    print(f"node loss: {len(on_victim)} streams on the lost node ended after "
          f"{sorted(s['end'] for s in on_victim)} s; {len(failed)} of {len(loss['load'])} requests failed: "
          f"{sorted({o['error']['code'] for o in failed})}")


def test_the_index_drops_a_lost_node_s_replica_within_seconds_and_new_requests_succeed(scenarios):
    """The index learns the loss when the replica's name is gone (Serve's controller stops the
    replica once its health check fails), on the reaper's second lookup; routers stop sending to it
    earlier, when Serve takes it out of their replica set."""
    loss = observed(scenarios, "node_loss")
    assert loss["index_dropped_s"] < 15, loss["index_dropped_s"]  # 5 to 7 s here, alone on 2 cores
    later = [o for o in loss["load"] if o["start"] > loss["index_dropped_s"]]
    assert len(later) >= 4 and all(o["status"] == 200 and o["replica"] != loss["victim"] for o in later), later
    served = set()
    for conv in loss["conversations_after"]:
        served.update(conv["replicas"])
        for t in range(1, len(conv["prompts"])):
            assert conv["cached"][t] >= conv["prompts"][t - 1] - PAGE_SIZE - TAIL_GUARD, conv
    assert served == set(loss["after"]), "new conversations use both replicas, the replacement included"
    last = max(o["start"] for o in loss["load"] if o["replica"] == loss["victim"] or o["status"] != 200)
    print(f"node loss: the last request sent to the lost replica left {last} s after the loss")


def test_an_index_actor_restarted_by_ray_comes_back_from_redis_exactly_on_the_head(scenarios):
    restarted = observed(scenarios, "index_restart")["restarted"]
    assert restarted["node"] == "head" and restarted["stats"]["backend"] == "redis"
    assert restarted["same_contents"] and restarted["pages_before"] > 0, restarted
    assert restarted["workers_after"] == restarted["workers_before"] and not restarted["needing_resync"]
    print(f"index restarted: back after {restarted['back_s']} s with its {restarted['pages_before']} pages")


def test_an_index_actor_killed_for_good_under_load_is_succeeded_on_the_head_from_redis(scenarios):
    replaced = observed(scenarios, "index_restart")["replaced"]
    assert replaced["node"] == "head"
    assert replaced["workers_after"] == replaced["workers_before"] and replaced["stats"]["pages"] > 0, replaced
    assert replaced["load"] and all(o["status"] == 200 for o in replaced["load"]), replaced["load"]
    print(f"index killed for good: successor after {replaced['back_s']} s, converged after "
          f"{replaced['converged_s']} s, {len(replaced['load'])} requests meanwhile")


def test_a_replica_on_another_node_fetches_a_hot_prompt_s_resume_point_and_computes_what_cold_computes(scenarios):
    """Move and fetch between nodes: the resume point crosses two nodes' object stores."""
    result = observed(scenarios, "fetch")
    engines, holder, metrics = result["engines"], result["holder"], result["metrics"]
    assert len(set(engines.values())) == 2 and "head" not in engines.values(), engines
    others = [w for w in metrics if w != holder]
    assert set(result["placed"] + [result["shared"]["replica"]]) - {holder}, "the load spread past the holder"
    assert engines[others[0]] != engines[holder], "the receiver is on another node"
    assert all(r.get("index_fallbacks", 0) == 0 for r in result["routed_meanwhile"].values()), \
        f"every request was routed by a mirror of the index: {result['routed_meanwhile']}"
    shared, cold = result["shared"], result["cold"]
    assert shared["cached"] >= shared["prompt"] - PAGE_SIZE - TAIL_GUARD - 24, result
    assert cold["cached"] == 0 and cold["text"] == shared["text"], "resumed == cold; no fetch crosses a salt"
    assert sum(metrics[w]["fetches_total"] for w in others) >= 1 and sum(metrics[w]["fetched_pages_total"]
                                                                        for w in others) > 0, metrics
    assert metrics[holder]["exported_bytes_total"] > 0, metrics
    assert not any(k.startswith("fetch_fallbacks_total") for m in metrics.values() for k in m), metrics
    print(f"fetch across nodes: {sum(metrics[w]['fetched_pages_total'] for w in others)} pages, "
          f"{sum(metrics[w]['fetched_bytes_total'] for w in others)} bytes; the request resumed at "
          f"{shared['cached']} of {shared['prompt']} tokens")
