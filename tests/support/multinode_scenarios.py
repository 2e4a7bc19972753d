"""The cluster across nodes: scenarios on a `multinode_cluster.App` (2 engine replicas on 2 GPU
worker nodes, a proxy and an ingress replica on each node, the index in Redis), run as a script
by tests/ray/test_cluster_multinode.py in a process of its own (a process holds one Ray connection,
and the test process may hold the shared local one). `RAY_TMPDIR` should be a folder of its own:
the head writes there the address that a bare `ray.init()` on this machine would join. The last
scenario, `fetch`, redeploys the app with routing `fetch: true`.

    python3 tests/support/multinode_scenarios.py MODEL_DIR REDIS_URL

deploys the app, then runs the scenarios in order, each printing one line `SCENARIO {json}`: what
it observed, for the test to judge (`error`: the traceback of a scenario that raised). Times are
seconds, measured here.
"""

from __future__ import annotations

import json
import sys
import threading
import time
import traceback

import httpx
import ray
from ray import serve
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from cairn.cluster.ingress import REPLICA_HEADER
from tests.support import ray_checks
from tests.support.chat import chat_turns, open_chat_stream
from tests.support.ray_checks import actor_nodes, index_converged, wait_until
from tests.support.multinode_cluster import INDEX, MODEL, App, Load, MultiNode, Outcome, persona

QUESTIONS = ["How do I build a cairn that lasts the winter?", "How tall should it be to show in fog?",
             "Which stones hold best when wet?", "How often should someone check on it?"]


# ---- scenarios ---------------------------------------------------------------------------------

@ray.remote(num_cpus=0)
def create_index(name: str, namespace: str) -> None:
    """Creates an index actor from wherever this task runs, as a replica's publisher does."""
    from cairn.cache_service.actor import index_actor

    ray.get(index_actor(name, namespace).stats.remote())


def placement(app: App) -> dict:
    """Where each actor runs, and where index actors created from a worker node's process land."""
    nodes, namespace = app.nodes, app.routing.index_actor_namespace
    ray.get(app.index.stats.remote(), timeout=30)  # running, not only registered
    where = {name: nodes.role(node) for name, node in actor_nodes().items()}
    names = [f"{INDEX}-from-worker-{k}" for k in range(6)]
    on_worker = NodeAffinitySchedulingStrategy(nodes.workers[0].node_id, soft=False)
    ray.get([create_index.options(scheduling_strategy=on_worker).remote(n, namespace) for n in names])
    created = [nodes.role(actor_nodes()[n]) for n in names]
    for n in names:
        ray.kill(ray.get_actor(n, namespace=namespace), no_restart=True)
    return {"actors": where, "index": INDEX, "created_from_worker": created}


def conversations(app: App, first: int = 0) -> dict:
    """Four conversations at once (personas `first`.. `first` + 3), four turns each, through the
    official client."""
    def run(i: int) -> dict:
        prompts, cached, replicas = chat_turns(app.client(), MODEL, persona(first + i), QUESTIONS)
        return {"prompts": prompts, "cached": cached, "replicas": sorted(replicas)}
    return {"conversations": concurrently(4, run), "engines": app.engines()}


def concurrently(n: int, conversation) -> list[dict]:
    """`conversation(i)` for i in 0 .. n - 1, each on a thread of its own; their results, or a
    RuntimeError naming every one that failed."""
    out: list = [None] * n

    def run(i: int) -> None:
        try:
            out[i] = conversation(i)
        except Exception as e:  # noqa: BLE001 - raised below, for the test to show
            out[i] = {"error": repr(e)}
    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    if failed := [c for c in out if c is None or "error" in c]:
        raise RuntimeError(f"conversations failed: {failed}")
    return out


def since(zero: float) -> float:
    return round(time.monotonic() - zero, 2)


def ask_at(url: str, system: str) -> dict:
    """One short greedy chat through the proxy at `url`: its status, the replica that served it,
    its prompt and cached tokens."""
    body = {"model": MODEL, "max_tokens": 4, "temperature": 0,
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": QUESTIONS[0]}]}
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=60)
    usage = (r.json().get("usage") or {}) if r.status_code == 200 else {}
    return {"status": r.status_code, "replica": r.headers.get(REPLICA_HEADER), "prompt": usage.get("prompt_tokens"),
            "cached": (usage.get("prompt_tokens_details") or {}).get("cached_tokens")}


def every_proxy(app: App, agree_within_s: float = 15.0) -> dict:
    """Requests entering at every node's proxy, each handed to the ingress replica on its node,
    which routes by its own mirror of the index: two conversations at once whose turns each enter
    at the next node's proxy; one prompt, once cached (sent at the head's), sent through every
    proxy; then, the traffic over, how long until every ingress's mirror (`Ingress.routing_state`)
    and the index actor (`digest`) agree (at most `agree_within_s`). `routed_meanwhile`: per
    ingress replica, what its routers' counters (requests ranked, index fallbacks by reason) rose
    by during the scenario."""
    proxies = app.nodes.proxy_urls()  # role -> URL: the head's, worker0's and worker1's
    roles = sorted(proxies)
    started = time.monotonic()
    counted = routed_by_ingress(app)

    def serving(url: str) -> bool:
        try:
            return httpx.get(url + "/v1/models", timeout=5).status_code == 200
        except httpx.HTTPError:
            return False
    wait_until(lambda: all(serving(url) for url in proxies.values()), 60, "every proxy serves the app", 0.5)
    ready_s = since(started)

    def converse(i: int) -> dict:
        order = [roles[(i + t) % len(roles)] for t in range(len(QUESTIONS))]
        prompts, cached, replicas = chat_turns([app.client(proxies[r]) for r in order], MODEL, persona(30 + i),
                                               QUESTIONS)
        return {"proxies": order, "prompts": prompts, "cached": cached, "replicas": sorted(replicas)}
    out = concurrently(2, converse)

    first = ask_at(app.url, persona(40))  # computes and caches it
    same = {role: ask_at(proxies[role], persona(40)) for role in roles}

    quiet = time.monotonic()
    seen: dict = {}

    try:
        wait_until(lambda: mirrors_agree(app, seen), agree_within_s, "every mirror agrees with the index", 0.2)
        agreed_s = since(quiet)
    except TimeoutError:
        agreed_s = None
    routed = {}
    for state in seen["ingresses"]:
        state["node"] = app.nodes.role(state["node"])
        routed[state["node"]] = rose(counted.get(state["replica"], {}), summed(state))
    return {"proxies": proxies, "ready_s": ready_s, "ingress_nodes": app.ingresses(), "engines": app.engines(),
            "conversations": out, "first": first, "same_prompt": same, "agreed_s": agreed_s,
            "routed_meanwhile": routed, **seen}


def mirrors_agree(app: App, seen: dict) -> bool:
    """`ray_checks.mirrors_agree` for this app's ingress replicas, index and live engine replicas."""
    return ray_checks.mirrors_agree(app.ingress, app.index, list(app.engines()), seen)


def routed_by_ingress(app: App) -> dict[str, dict[str, int]]:
    """Each ingress replica -> its routers' counters, summed (`summed`)."""
    return {s["replica"]: summed(s) for s in app.ingress.broadcast("routing_state").results(timeout_s=30)}


def rose(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    """How much each counter of `after` rose from `before` (a counter absent there: from 0)."""
    return {k: n - before.get(k, 0) for k, n in after.items()}


def summed(routing_state: dict) -> dict[str, int]:
    """An ingress replica's router counters (`Ingress.routing_state`), summed over its routers."""
    out: dict[str, int] = {}
    for router in routing_state["routers"]:
        for k, n in router["counts"].items():
            out[k] = out.get(k, 0) + n
    return out


def node_loss(app: App) -> dict:
    """A spare worker joins; then, under load and with streams in flight on both replicas, the
    worker node of one replica is removed abruptly, its proxy and its ingress replica with it (the
    requests enter at the head's proxy, whose ingress replica is the head's). Times are from the
    removal."""
    started = time.monotonic()
    app.nodes.workers.append(app.nodes.add_worker())
    spare_s = since(started)
    before = app.engines()
    victim = min(before)
    victim_node = next(w for w in app.nodes.workers if app.nodes.role(w.node_id) == before[victim])

    streams: list[Outcome] = []
    stop, threads = threading.Event(), []
    for i in range(4):  # one at a time: new prompts go by load, so both replicas hold streams
        opened = threading.Event()
        threads.append(threading.Thread(target=app.stream, args=(i, opened, stop, streams), daemon=True))
        threads[-1].start()
        opened.wait(60)
    with Load(app) as load:
        time.sleep(1.5)
        lost = time.monotonic()
        app.nodes.ray.remove_node(victim_node, allow_graceful=False)  # as if its machine went dark
        removed_s = since(lost)
        wait_until(lambda: victim not in app.index_workers(), 30, "the index dropped the dead replica")
        dropped_s = since(lost)
        after = wait_until(lambda: (e := app.replicas()) and victim not in e and len(e) == 2 and e, 120,
                           "Serve replaced the replica")
        replaced_s = since(lost)
        wait_until(lambda: set(after) <= app.index_workers(), 30, "the replacement reached the index")
        indexed_s = since(lost)
        time.sleep(1)
        stop.set()
    for t in threads:
        t.join(timeout=60)
    return {"victim": victim, "victim_node": before[victim], "before": before, "after": app.engines(),
            "spare_node_joined_s": spare_s, "removed_s": removed_s, "index_dropped_s": dropped_s,
            "replaced_s": replaced_s, "replacement_indexed_s": indexed_s,
            "streams": [o.since(lost) for o in streams], "load": [o.since(lost) for o in load.outcomes],
            "conversations_after": conversations(app, first=10)["conversations"]}


def index_restart(app: App) -> dict:
    """The index actor, whose state is in Redis, is killed twice: with nothing running, restarted by
    Ray (it must hold exactly what it held); then under load, for good (a successor is created by
    the first router or replica to look it up). Times are from the kill."""
    out: dict = {}
    for how, threads in (("restarted", 0), ("replaced", 2)):
        held = index_converged(app.engine, lambda: app.index, timeout_s=30)
        old = app.index
        with Load(app, threads) as load:
            time.sleep(1)
            killed = time.monotonic()
            ray.kill(old, no_restart=how == "replaced")

            def back():
                try:
                    new = app.index
                    stats = ray.get(new.stats.remote(), timeout=5)
                except (ValueError, ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                    return None  # not created yet, or still starting
                return (stats["restarted"] if how == "restarted" else new._actor_id != old._actor_id) and stats
            stats = wait_until(back, 60, f"index {how}")
            back_s, new = since(killed), app.index
            known = {w: ray.get(new.contents.remote(w), timeout=30) for w in held}
            out[how] = {"back_s": back_s, "node": app.nodes.role(actor_nodes()[INDEX]), "stats": stats,
                        "workers_before": sorted(held), "workers_after": sorted(ray.get(new.workers.remote())),
                        "needing_resync": sorted(ray.get(new.workers_needing_resync.remote())),
                        "same_contents": all(known[w] is not None and tuple(known[w]) == held[w] for w in held),
                        "pages_before": sum(len(p) for p, _ in held.values())}
            time.sleep(1)
        index_converged(app.engine, lambda: app.index, timeout_s=30)
        out[how].update(converged_s=since(killed), load=[o.since(killed) for o in load.outcomes])
    return out


HOT = "You are the shared assistant of the cairn club; answer briefly about stone piles. " * 60


def fetch(app: App) -> dict:
    """Move and fetch across nodes: the app redeployed with routing `fetch: true` and a spill limit
    of 2 (its replicas on two worker nodes); a hot system prompt warmed on one replica; long
    streams sharing it, which the router spreads once the holder is busy; then a request sharing
    it, and the same request under another cache salt (computed cold). A replica on the other node
    that gets them pulls the resume point from the holder through both nodes' object stores."""
    # staleness: a feed answer slowed by a busy machine does not turn routing to load alone mid-scenario
    app.deploy(app.routing.model_copy(update=dict(fetch=True, spill_limit=2, index_staleness_s=30.0)))
    engines = wait_until(lambda: (e := app.engines()) and len(e) == 2 and e, 120, "two engine replicas")
    wait_until(lambda: mirrors_agree(app, {}), 30, "every ingress's mirror follows the index", 0.2)
    before = routed_by_ingress(app)
    client = app.client()

    def ask(content: str, salt: str | None = None) -> dict:
        raw = client.chat.completions.with_raw_response.create(
            model=MODEL, temperature=0, max_tokens=8, extra_body={"cache_salt": salt} if salt else None,
            messages=[{"role": "system", "content": HOT}, {"role": "user", "content": content}])
        done = raw.parse()
        return {"replica": raw.headers.get(REPLICA_HEADER), "text": done.choices[0].message.content,
                "prompt": done.usage.prompt_tokens, "cached": done.usage.prompt_tokens_details.cached_tokens}

    holder = ask("warm up")["replica"]
    streams, placed = [], []
    with httpx.Client(base_url=app.url, timeout=60) as http:
        try:
            for i in range(2 * app.routing.spill_limit):  # long streams in flight: load the router balances
                r = open_chat_stream(http, MODEL, [{"role": "system", "content": HOT},
                                                   {"role": "user", "content": f"busy {i}"}])
                streams.append(r)
                placed.append(r.headers.get(REPLICA_HEADER))
            shared = ask("How tall should a cairn be?")
            cold = ask("How tall should a cairn be?", salt="another-tenant")
        finally:
            for r in streams:
                r.close()
    metrics = {m.worker_id: m for m in app.engine.broadcast("metrics").results(timeout_s=30)}
    keep = ("fetches_total", "fetched_pages_total", "fetched_bytes_total", "exported_bytes_total", "cached_tokens",
            "checkpoints_evicted_total", "checkpoints_without_slot_total")
    routed = {r: rose(before.get(r, {}), counts) for r, counts in routed_by_ingress(app).items()}
    return {"engines": engines, "holder": holder,
            "placed": placed, "shared": shared, "cold": cold,
            "metrics": {w: {**{k: getattr(m, k) for k in keep},
                            **{f"fetch_fallbacks_total:{why}": n for why, n in m.fetch_fallbacks_total.items()}}
                        for w, m in metrics.items()}, "routed_meanwhile": routed}


SCENARIOS = (placement, conversations, every_proxy, node_loss, index_restart, fetch)


def main(model_dir: str, redis_url: str) -> None:
    nodes = MultiNode(workers=2)
    try:
        ray.init(address=nodes.ray.address, namespace="cairn-multinode", log_to_driver=False)
        started = time.monotonic()
        app = App(nodes, model_dir, redis_url)
        print("SCENARIO " + json.dumps({"name": "deploy", "s": round(time.monotonic() - started, 1)}), flush=True)
        for scenario in SCENARIOS:
            started = time.monotonic()
            try:
                result = scenario(app)
            except Exception:
                result = {"error": traceback.format_exc()}
            result.update(name=scenario.__name__, s=round(time.monotonic() - started, 1))
            print("SCENARIO " + json.dumps(result, default=sorted), flush=True)
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()
            nodes.ray.shutdown()


if __name__ == "__main__":
    main(*sys.argv[1:3])
