"""Routing policies side by side on a real local Ray Serve cluster.

The Serve application of `cairn.cluster.app` (HTTP ingress + engine replicas), one per policy:
`cache_affinity` (cairn's router over the cache index), `pow2` (Serve's default), `round_robin`,
`ray_prefix` (Ray Serve LLM's PrefixCacheAffinityRouter), and `cache_affinity_fetch`: cairn's
router with move and fetch on (routing `fetch`: a replica resuming less deep than the holder
pulls the resume point from it, cairn.cluster.replica_peer_fetch). Every policy replays the same three
traces of concurrent multi-turn chats through HTTP (streamed, the answer echoed back,
each turn sent a think time after the previous answer, greedy decoding):
- shared-system: every conversation opens with the same system prompt;
- no-shared: every conversation has a system prompt of its own;
- hot-prefix: 80% of conversations open with one hot 2,000-token prefix, the rest with their own.
Each trace runs under its own cache_salt, so nothing cached in one trace helps another.

Measured per (trace, policy), from the client and the `x-cairn-replica` response header:
- hit tokens: usage.prompt_tokens_details.cached_tokens summed, and their ratio to the oracle
  (per request, the longest common prefix of its prompt with everything seen before it: earlier
  prompts and prompt + answer of finished requests; to within a page; capped at n - 1);
- TTFT p50/p99 (request sent to first streamed event);
- requests per replica and time-averaged in-flight requests per replica, as max/mean over the
  replicas (1.0 = perfectly even), and the peak in-flight of any replica;
- stay: the share of turns after the first served by the replica that served the previous turn;
- routing overhead per request: time in the policy's `choose_replicas` (cairn's includes scoring
  against its mirror of the index), p50/p99 wall time, measured inside the routers (each
  policy's class wrapped with a timer), and p99 CPU time of the router's thread over the same
  call: on a machine whose cores the replicas share, the wall time's tail is mostly waiting for
  a core or the interpreter lock, which the CPU time leaves out.
Then the ratios of cache_affinity against each baseline, measured in the same run, and fetch on
against off: hit tokens (local + fetched) / oracle, TTFT p50/p99, in-flight max/mean, and the
bytes fetched (the replicas' fetched_bytes_total over the trace). The cache index alone, without
Serve, is index_scoring.py's.

Writes benchmarks/out/routing.png, and every request's numbers to routing.json. Not a test:
nothing is asserted (tests/test_readme_commands.py runs --quick to see that it runs).

Usage: python3 benchmarks/routing.py [--quick] [--replicas 4] [--convs 32] [--turns 6] [--model DIR]
  --quick: 2 replicas, 4 conversations, 2 turns, a 600-token hot prefix, the tiny demo model, and
  cairn's router (fetch off and on) beside pow2 only, deployed at once (about a minute on a 2-core
  machine; tests/routing/ builds every policy's application). Without it the policies are deployed one
  after another (4 replicas each: on GPUs pass --num-gpus 1 and a --model).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import random
import statistics
import sys
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import ray  # noqa: E402

logging.getLogger("httpx").setLevel(logging.WARNING)  # one INFO line per request otherwise

from cairn.cluster.routing.router import CacheAffinityRouter  # noqa: E402
from cairn.workers import EngineSpec  # noqa: E402
from percentiles import pct  # noqa: E402  (benchmarks/percentiles.py)
from plotting import OUT, pyplot, save  # noqa: E402  (benchmarks/plotting.py)
from traces import Oracle, sentence, text_of_tokens  # noqa: E402  (benchmarks/traces.py)

FETCH = "cache_affinity_fetch"  # cairn's router with move and fetch on
POLICIES = ["cache_affinity", FETCH, "pow2", "round_robin", "ray_prefix"]
QUICK_POLICIES = ["cache_affinity", FETCH, "pow2"]
TRACES = ["shared-system", "no-shared", "hot-prefix"]
MODEL = "bench-model"
NAMESPACE = "cairn-bench"
STATS_ACTOR = "cairn-bench-route-stats"
HOT_PREFIX_TOKENS, HOT_SHARE = 2000, 0.8


# ---- routers with a stopwatch ------------------------------------------------------------------

def _record(router, policy: str, seconds: float, cpu_seconds: float) -> None:
    """Buffers a routing time (wall, and CPU of the router's thread); ships the buffer to the
    stats actor at most twice a second."""
    samples = router.__dict__.setdefault("_bench_samples", [])
    samples.append((seconds, cpu_seconds))
    now = time.monotonic()
    if now - router.__dict__.get("_bench_flushed", 0.0) < 0.5:
        return
    router._bench_flushed = now
    try:
        actor = router.__dict__.get("_bench_actor") or ray.get_actor(STATS_ACTOR, namespace=NAMESPACE)
        router._bench_actor = actor
        actor.add.remote(policy, list(samples))  # fire and forget
        samples.clear()
    except Exception:  # the stats actor is gone: nothing to report to
        pass


def _timed(base: type, policy: str) -> type:
    class Timed(base):
        async def choose_replicas(self, candidate_replicas, pending_request=None):
            start, cpu = time.perf_counter(), time.thread_time()
            try:
                return await super().choose_replicas(candidate_replicas, pending_request)
            finally:
                _record(self, policy, time.perf_counter() - start, time.thread_time() - cpu)

    Timed.__name__ = Timed.__qualname__ = f"Timed_{policy}"
    return Timed


def _base_router(policy: str) -> type:
    from ray.serve._private.request_router.pow_2_router import PowerOfTwoChoicesRequestRouter
    from ray.serve.experimental.round_robin_router import RoundRobinRouter

    import cairn.cluster.routing.router

    return {"cache_affinity": CacheAffinityRouter, FETCH: CacheAffinityRouter, "pow2": PowerOfTwoChoicesRequestRouter,
            "round_robin": RoundRobinRouter, "ray_prefix": cairn.cluster.routing.router.RayPrefixRouter}[policy]


TIMED = {}
for _policy in POLICIES:  # module attributes: Serve imports a router class by its path
    TIMED[_policy] = globals()[f"Timed_{_policy}"] = _timed(_base_router(_policy), _policy)


@ray.remote(num_cpus=0)
class RouteStats:
    def __init__(self):
        self.samples = defaultdict(list)

    def add(self, policy: str, samples: list[tuple[float, float]]) -> None:
        self.samples[policy].extend(samples)

    def take(self, policy: str) -> list[tuple[float, float]]:
        return self.samples.pop(policy, [])


def build_app(policy: str, args, model_dir: Path):
    """cairn.cluster.app's application for `policy`, its router class wrapped with the stopwatch."""
    from ray.serve.config import RequestRouterConfig

    from cairn.cluster.app import build_application
    from cairn.cluster.routing.routing_config import RoutingConfig

    base = RoutingConfig.from_yaml(args.routing) if args.routing else RoutingConfig()
    routing = base.model_copy(update=dict(policy="cache_affinity" if policy == FETCH else policy,
                                          fetch=policy == FETCH, index_actor_name=f"cairn-bench-index-{policy}",
                                          routing_stats_period_s=args.stats_period))
    routing = routing.for_engines(EngineSpec.from_model_dir(model_dir))  # what the timed router is given
    app = build_application(model_dir, args.replicas, routing=routing, num_cpus=args.num_cpus,
                            num_gpus=args.num_gpus, api=dict(served_model_name=MODEL))
    ingress = app._bound_deployment
    engine = ingress.init_args[0]._bound_deployment
    timed = engine.options(request_router_config=RequestRouterConfig(
        request_router_class=TIMED[policy], request_router_kwargs=routing.router_kwargs(),
        request_routing_stats_period_s=routing.routing_stats_period_s))
    return ingress.bind(timed.bind(*engine.init_args, **engine.init_kwargs), *ingress.init_args[1:],
                        **ingress.init_kwargs)


# ---- traces ------------------------------------------------------------------------------------

@dataclass
class Conversation:
    system: str
    users: list[str]
    start_s: float
    think_s: list[float]


def make_trace(name: str, args, tokenizer, seed: int) -> list[Conversation]:
    rng = random.Random(f"{name}-{seed}")
    shared = text_of_tokens(tokenizer, rng, args.system_tokens, "You are the cairn club's trail guide.")
    hot = text_of_tokens(tokenizer, rng, args.hot_prefix_tokens, "You are the cairn club's archive.")
    hot_convs = set(rng.sample(range(args.convs), round(HOT_SHARE * args.convs)))
    convs = []
    for c in range(args.convs):
        own = text_of_tokens(tokenizer, rng, args.system_tokens, f"Conversation {c} of {name}.")
        system = {"shared-system": shared, "no-shared": own, "hot-prefix": hot if c in hot_convs else own}[name]
        convs.append(Conversation(system, [sentence(rng, args.user_words) for _ in range(args.turns)],
                                  rng.uniform(0, args.think), [rng.uniform(0.5, 1.5) * args.think
                                                               for _ in range(args.turns)]))
    return convs


# ---- one trace through one policy's endpoint ---------------------------------------------------

@dataclass
class Req:
    conv: int
    turn: int
    start: float
    first: float = 0.0
    end: float = 0.0
    replica: str | None = None
    prompt_tokens: int = 0
    cached: int = 0
    ok: bool = False
    prompt_ids: list[int] = field(default_factory=list)
    seen_ids: list[int] = field(default_factory=list)  # prompt + answer, as the next turn will render it
    oracle: int = 0


async def converse(http, url: str, conv_id: int, conv: Conversation, salt: str, args, render, out: list[Req]):
    from cairn.cluster.ingress import REPLICA_HEADER

    messages = [{"role": "system", "content": conv.system}]
    await asyncio.sleep(conv.start_s)
    for turn, user in enumerate(conv.users):
        messages.append({"role": "user", "content": user})
        text, ids = await asyncio.to_thread(render, list(messages))
        body = {"model": MODEL, "messages": messages, "max_tokens": args.answer_tokens, "temperature": 0,
                "stream": True, "stream_options": {"include_usage": True}, "cache_salt": salt}
        req = Req(conv_id, turn, time.perf_counter(), prompt_ids=ids)
        out.append(req)
        answer: list[str] = []
        try:
            async with http.stream("POST", url, json=body) as response:
                req.replica = response.headers.get(REPLICA_HEADER)
                async for line in response.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    if not req.first:
                        req.first = time.perf_counter()
                    if line == "data: [DONE]":
                        break
                    chunk = json.loads(line[6:])
                    for choice in chunk.get("choices", []):
                        answer.append(choice.get("delta", {}).get("content") or "")
                    if chunk.get("usage"):
                        req.prompt_tokens = chunk["usage"]["prompt_tokens"]
                        req.cached = chunk["usage"]["prompt_tokens_details"]["cached_tokens"]
                req.ok = response.status_code == 200 and req.prompt_tokens > 0
        except Exception as e:  # counted as failed; the conversation ends
            print(f"  request failed: {e!r}")
        req.end = time.perf_counter()
        if not req.ok:
            return
        messages.append({"role": "assistant", "content": "".join(answer)})
        req.seen_ids = (await asyncio.to_thread(render, list(messages), False))[1]
        await asyncio.sleep(conv.think_s[turn])


async def run_trace(base_url: str, prefix: str, trace: list[Conversation], salt: str, args,
                    render) -> tuple[list[Req], float]:
    import httpx

    out: list[Req] = []
    limits = httpx.Limits(max_connections=len(trace) + 8, max_keepalive_connections=len(trace) + 8)
    async with httpx.AsyncClient(base_url=base_url, timeout=300, limits=limits) as http:
        start = time.perf_counter()
        await asyncio.gather(*(converse(http, f"{prefix}/v1/chat/completions", i, c, salt, args, render, out)
                               for i, c in enumerate(trace)))
        return out, time.perf_counter() - start


async def warm_up(base_url: str, prefix: str, n: int) -> None:
    """A few short requests (their own cache_salt) so no policy pays first-request costs inside
    a trace: every replica's first inference, the router's first index lookup."""
    import httpx

    async with httpx.AsyncClient(base_url=base_url, timeout=300) as http:
        await asyncio.gather(*(http.post(f"{prefix}/v1/chat/completions", json={
            "model": MODEL, "max_tokens": 2, "cache_salt": "warm-up",
            "messages": [{"role": "user", "content": f"warm up {i}"}]}) for i in range(n)))


# ---- the oracle and the numbers ----------------------------------------------------------------

def fill_oracle(reqs: list[Req], page: int) -> None:
    """Each request's oracle hit (traces.Oracle, to within a page), in the order things happened:
    a request's prompt when it was sent, its prompt and answer when it finished."""
    events = [(r.start, 0, r) for r in reqs] + [(r.end, 1, r) for r in reqs if r.ok]
    oracle = Oracle(page_tokens=page)
    for _, kind, r in sorted(events, key=lambda e: (e[0], e[1])):
        if kind == 0:
            r.oracle = oracle.hit_tokens(r.prompt_ids)
        else:
            oracle.insert(r.seen_ids)


@dataclass
class Result:
    trace: str
    policy: str
    requests: int
    failed: int
    hit: int
    oracle: int
    ttft_p50: float
    ttft_p99: float
    req_max_mean: float
    inflight_max_mean: float
    inflight_peak: int
    stay: float
    route_p50: float
    route_p99: float
    route_cpu_p99: float
    prompt_mismatch: int
    seconds: float
    fetched_bytes: int = 0


def summarize(trace: str, policy: str, reqs: list[Req], replicas: list[str], wall: float,
              route_samples: list[tuple[float, float]], page: int) -> Result:
    fill_oracle(reqs, page)
    route, route_cpu = [w for w, _ in route_samples], [c for _, c in route_samples]
    ok = [r for r in reqs if r.ok]
    ttft = [r.first - r.start for r in ok]
    counts = {rep: 0 for rep in replicas}
    busy = {rep: 0.0 for rep in replicas}
    for r in ok:
        counts[r.replica] = counts.get(r.replica, 0) + 1
        busy[r.replica] = busy.get(r.replica, 0.0) + (r.end - r.start)
    edges = sorted([(r.start, 1, r.replica) for r in ok] + [(r.end, -1, r.replica) for r in ok])
    now, peak = defaultdict(int), 0
    for _, step, rep in edges:
        now[rep] += step
        peak = max(peak, now[rep])
    by_conv = defaultdict(dict)
    for r in ok:
        by_conv[r.conv][r.turn] = r.replica
    pairs = [(turns[t - 1], turns[t]) for turns in by_conv.values() for t in turns if t and t - 1 in turns]
    mean_req = statistics.mean(counts.values()) if counts else 0
    mean_busy = statistics.mean(busy.values()) if busy else 0
    return Result(trace, policy, len(reqs), len(reqs) - len(ok), sum(r.cached for r in ok),
                  sum(r.oracle for r in ok), pct(ttft, 0.5), pct(ttft, 0.99),
                  max(counts.values()) / mean_req if mean_req else float("nan"),
                  max(busy.values()) / mean_busy if mean_busy else float("nan"), peak,
                  sum(a == b for a, b in pairs) / len(pairs) if pairs else float("nan"),
                  pct(route, 0.5), pct(route, 0.99), pct(route_cpu, 0.99),
                  sum(r.prompt_tokens != len(r.prompt_ids) for r in ok), wall)


def report(results: list[Result], args) -> None:
    for trace in TRACES:
        rows = [r for r in results if r.trace == trace]
        if not rows:
            continue
        print(f"\n== trace {trace}: {args.convs} conversations x {args.turns} turns, {args.replicas} replicas")
        print(f"{'policy':15s} {'reqs':>5s} {'fail':>4s} {'hit tok':>8s} {'oracle':>8s} {'hit/orc':>7s} "
              f"{'TTFT p50':>8s} {'p99 ms':>7s} {'req max/mean':>12s} {'infl max/mean':>13s} {'peak':>4s} "
              f"{'stay':>5s} {'route p50':>9s} {'p99 ms':>7s} {'cpu p99':>7s}")
        for r in rows:
            print(f"{r.policy:15s} {r.requests:5d} {r.failed:4d} {r.hit:8d} {r.oracle:8d} "
                  f"{r.hit / max(r.oracle, 1):7.3f} {1000 * r.ttft_p50:8.1f} {1000 * r.ttft_p99:7.1f} "
                  f"{r.req_max_mean:12.2f} {r.inflight_max_mean:13.2f} {r.inflight_peak:4d} {r.stay:5.2f} "
                  f"{1000 * r.route_p50:9.3f} {1000 * r.route_p99:7.3f} {1000 * r.route_cpu_p99:7.3f}")
        mine = next((r for r in rows if r.policy == "cache_affinity"), None)
        for base in rows:
            if mine is None or base is mine:
                continue
            print(f"  cache_affinity vs {base.policy:11s}: hit tokens x{mine.hit / max(base.hit, 1):.2f}, "
                  f"TTFT p50 x{mine.ttft_p50 / base.ttft_p50:.2f}, p99 x{mine.ttft_p99 / base.ttft_p99:.2f}, "
                  f"stay {mine.stay:.2f} vs {base.stay:.2f}, routing p50 x{mine.route_p50 / base.route_p50:.1f}")
        on, off = next((r for r in rows if r.policy == FETCH), None), mine
        if on is not None and off is not None:
            print(f"  fetch on vs off: hit/oracle {on.hit / max(on.oracle, 1):.3f} vs {off.hit / max(off.oracle, 1):.3f}, "
                  f"TTFT p50 x{on.ttft_p50 / off.ttft_p50:.2f}, p99 x{on.ttft_p99 / off.ttft_p99:.2f}, in-flight "
                  f"max/mean {on.inflight_max_mean:.2f} vs {off.inflight_max_mean:.2f}, "
                  f"{on.fetched_bytes / 2**20:.1f} MiB fetched")
        mismatched = sum(r.prompt_mismatch for r in rows)
        if mismatched:
            print(f"  note: {mismatched} prompts' client-side token count differed from the server's")


def plot(results: list[Result]) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, axes = plt.subplots(2, len(TRACES), figsize=(5 * len(TRACES), 7), squeeze=False)
    for col, trace in enumerate(TRACES):
        rows = [r for r in results if r.trace == trace]
        names = [r.policy for r in rows]
        ax = axes[0][col]
        ax.bar(names, [r.hit / max(r.oracle, 1) for r in rows], color="tab:green")
        ax.set_ylim(0, 1.05)
        ax.set_title(f"{trace}: hit tokens / oracle")
        ax.tick_params(axis="x", labelrotation=20)
        ax = axes[1][col]
        xs = range(len(rows))
        ax.bar([x - 0.2 for x in xs], [1000 * r.ttft_p50 for r in rows], width=0.4, label="p50")
        ax.bar([x + 0.2 for x in xs], [1000 * r.ttft_p99 for r in rows], width=0.4, label="p99")
        ax.set_xticks(list(xs), names, rotation=20)
        ax.set_title(f"{trace}: TTFT (ms)")
        ax.legend(fontsize=8)
    save(fig, "routing.png")


# ---- main --------------------------------------------------------------------------------------

def fetched_bytes(handle) -> int:
    """Bytes the replicas have pulled from their peers so far."""
    return int(sum(m.fetched_bytes_total for m in handle.broadcast("metrics").results(timeout_s=60)))


def wait_running(names: list[str], timeout_s: float = 600) -> None:
    from ray import serve

    deadline = time.monotonic() + timeout_s
    while True:
        apps = serve.status().applications
        states = [apps[n].status if n in apps else "MISSING" for n in names]
        if all(s == "RUNNING" for s in states):
            return
        if any(s in ("DEPLOY_FAILED", "UNHEALTHY") for s in states) or time.monotonic() > deadline:
            raise RuntimeError(f"deployment failed: {dict(zip(names, states))}")
        time.sleep(0.5)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="2 replicas, 4 conversations, 2 turns, tiny model")
    parser.add_argument("--model", default=None, help="checkpoint directory (default: the bench demo model; "
                                                      "--quick: the tiny one)")
    parser.add_argument("--arch", default="qwen3_next", choices=("qwen3_next", "qwen3_5", "qwen3_5_moe"),
                        help="the demo model's architecture, when no --model is given")
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument("--convs", type=int, default=32)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--system-tokens", type=int, default=400, help="system prompt length (not the hot prefix)")
    parser.add_argument("--hot-prefix-tokens", type=int, default=HOT_PREFIX_TOKENS)
    parser.add_argument("--user-words", type=int, default=30)
    parser.add_argument("--answer-tokens", type=int, default=32)
    parser.add_argument("--think", type=float, default=1.0, help="mean think time between turns, seconds")
    parser.add_argument("--num-cpus", type=float, default=0.5, help="per engine replica")
    parser.add_argument("--num-gpus", type=float, default=0, help="per engine replica")
    parser.add_argument("--stats-period", type=float, default=0.5, help="routing stats period, seconds")
    parser.add_argument("--routing", default=None, help="a routing YAML (cairn/configs/routing.yaml) whose settings "
                                                        "every policy's deployment starts from")
    parser.add_argument("--policies", default=None, help=f"default {','.join(POLICIES)}; --quick: {','.join(QUICK_POLICIES)}")
    parser.add_argument("--traces", default=",".join(TRACES))
    parser.add_argument("--parallel", action=argparse.BooleanOptionalAction, default=None,
                        help="deploy every policy's application at once (default: with --quick)")
    args = parser.parse_args()
    if args.quick:
        args.replicas, args.convs, args.turns, args.answer_tokens, args.think = 2, 4, 2, 8, 0.3
        args.system_tokens, args.user_words, args.num_cpus, args.hot_prefix_tokens = 300, 20, 0.25, 600
    parallel = args.quick if args.parallel is None else args.parallel
    policies = (args.policies or ",".join(QUICK_POLICIES if args.quick else POLICIES)).split(",")
    traces_wanted = args.traces.split(",")

    from ray import serve
    from ray.serve.api import RunTarget

    from cairn.cluster.api.chat_template import ChatTemplate
    from cairn.cluster.api.text_tokenizer import TextTokenizer
    from cairn.workers.demo import demo_model_dir

    model_dir = Path(args.model) if args.model else demo_model_dir("tiny" if args.quick else "bench", args.arch)
    tokenizer, template = TextTokenizer.from_dir(model_dir), ChatTemplate.from_dir(model_dir)

    def render(messages, add_generation_prompt=True):
        text = template.render(messages, add_generation_prompt=add_generation_prompt)
        return text, tokenizer.encode_with_ends(text)[0]

    started = time.perf_counter()
    group_size = len(policies) if parallel else 1
    needed = group_size * (args.replicas * args.num_cpus + min(args.num_cpus, 0.25)) + 0.5
    # logical CPUs: enough for every replica deployed at once (they take turns being busy)
    ray.init(include_dashboard=False, log_to_driver=False, namespace=NAMESPACE,
             num_cpus=max(os.cpu_count() or 1, int(needed + 0.999)))
    stats = RouteStats.options(name=STATS_ACTOR, namespace=NAMESPACE).remote()
    sock_port = _free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": sock_port})
    base_url = f"http://127.0.0.1:{sock_port}"
    traces = {name: make_trace(name, args, tokenizer, seed=1) for name in TRACES if name in traces_wanted}
    print(f"model {model_dir.name}, {args.replicas} replicas per policy "
          f"({args.num_cpus} CPU, {args.num_gpus} GPU each), "
          f"{args.convs} conversations x {args.turns} turns, answers of {args.answer_tokens} tokens, "
          f"think {args.think} s; system prompts ~{args.system_tokens} tokens, hot prefix ~{args.hot_prefix_tokens} "
          f"tokens shared by {HOT_SHARE:.0%}", flush=True)
    page = 16
    results: list[Result] = []
    records: dict[str, list[dict]] = {}
    try:
        groups = [policies] if parallel else [[p] for p in policies]
        for group in groups:
            t = time.perf_counter()
            serve.run_many([RunTarget(build_app(p, args, model_dir), name=f"bench-{p}", route_prefix=f"/{p}")
                            for p in group])  # started together, waited for together
            wait_running([f"bench-{p}" for p in group])
            print(f"deployed {', '.join(group)} ({args.replicas} replicas each) in {time.perf_counter() - t:.0f} s",
                  flush=True)
            for policy in group:
                handle = serve.get_deployment_handle("Engine", app_name=f"bench-{policy}")
                replicas = sorted(m.worker_id for m in handle.broadcast("metrics").results(timeout_s=60))
                asyncio.run(warm_up(base_url, f"/{policy}", 2 * args.replicas))
                for name, trace in traces.items():
                    ray.get(stats.take.remote(policy))
                    fetched = fetched_bytes(handle)
                    reqs, wall = asyncio.run(run_trace(base_url, f"/{policy}", trace, f"{name}-{policy}", args, render))
                    time.sleep(0.6)  # the routers' last timings reach the stats actor
                    route = ray.get(stats.take.remote(policy))
                    results.append(summarize(name, policy, reqs, replicas, wall, route, page))
                    results[-1].fetched_bytes = fetched_bytes(handle) - fetched
                    records[f"{name}/{policy}"] = [dict(conv=q.conv, turn=q.turn, start=q.start, ttft=q.first - q.start,
                                                        end=q.end, replica=q.replica, prompt=q.prompt_tokens,
                                                        cached=q.cached, oracle=q.oracle, ok=q.ok) for q in reqs]
                    r = results[-1]
                    print(f"  {policy:15s} {name:14s} {wall:5.1f} s  hit/oracle {r.hit / max(r.oracle, 1):.3f}  "
                          f"TTFT p50 {1000 * r.ttft_p50:.0f} ms  failed {r.failed}", flush=True)
            if not parallel:
                for p in group:
                    serve.delete(f"bench-{p}")
        report(results, args)
        OUT.mkdir(parents=True, exist_ok=True)
        (OUT / "routing.json").write_text(json.dumps(records))  # every request, for a closer look
        plot(results)
    finally:
        serve.shutdown()
    print(f"\nmodel {model_dir.name}; total {time.perf_counter() - started:.0f} s")
    ray.shutdown()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


if __name__ == "__main__":
    main()
