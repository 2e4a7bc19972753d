"""The cluster on a real local Ray: CPU engine replicas of the tiny demo model behind the HTTP
ingress, cache-affinity routing over the index actor, driven through the official openai client.

Which replica served a response is read from its `x-cairn-replica` header (cairn.cluster.ingress).

1. `cairn serve --port P` as a subprocess: its own Ray, the default cairn/configs/local.yaml (2 CPU
   replicas of the demo model), /health and chat answered, Ctrl-C (SIGINT to its process
   group) stops it with status 0 and leaves no process behind. It runs first, before the shared
   Ray session of this module starts, so two Ray instances never run at once here.
2. One Serve app (3 replicas) for the rest of the module, in the shared `ray_session`: the
   ingress's router mirrors the index from before its first request; conversations stay where
   their state is and spread over all replicas; a hot shared prompt fills its replica up to the
   spill limit and then spills; an event gap makes the worker resync; killing the index actor
   under load (restarted by Ray, or for good: a new one is created) costs no request and the
   index is rebuilt from the workers; killing a replica under load drops it from the index within
   5 s, nothing is routed to it afterwards, and its replacement is learned from its own events.
   `cairn serve --address` joins this cluster, deploys its own application next to the module's
   and, on Ctrl-C, deletes only that one.
   The ingress's /metrics, through Serve, parses as Prometheus text and counts the routing; Ray's
   metrics export holds every replica's series under its own replica tag, and every metric
   cairn/configs/grafana-dashboard.json reads.
3. Drain: as `serve deploy` does it, lowering the engine's num_replicas, then replacing its
   replica; streams in flight on a stopping replica finish whole, and it leaves the index itself.
The router decisions these rely on are tested in plain Python in tests/routing/.
"""

import concurrent.futures
import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
ray = pytest.importorskip("ray")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from tests.support.chat import chat_turns, open_chat_stream
from tests.support.chat_tokens import shared_prefix
from tests.support.foreign_shell import cairn_script, foreign_shell, shadowed_imports
from tests.support.ray_checks import LoadThreads, index_converged, kill_index_actor, mirrors_agree, wait_for_log, wait_until

from cairn.cache_service.events import EventBatch, PagesStored  # noqa: E402
from cairn.cluster.app import build_application  # noqa: E402
from cairn.cluster.ingress import REPLICA_HEADER  # noqa: E402
from cairn.cluster.routing.routing_config import RoutingConfig  # noqa: E402
from tests.support.paths import REPO
from tests.support.readme_chat import readme_chat, run_readme_chat

MODEL = "tiny"
PAGE_SIZE, TAIL_GUARD = 16, 8  # workers.EngineOptions defaults, which the app uses
INDEX = f"cairn-test-index-{uuid.uuid4().hex[:6]}"
WORDS = ("stone cairn ridge trail winter summit fog marker hiker moss granite slate wind path river valley "
         "lichen shelter map compass").split()
QUESTIONS = ["How do I build a cairn that lasts through the winter storms on the ridge?",
             "And how tall should it be so hikers see it in fog?",
             "Which stones hold best when they are wet?",
             "How often should someone check on it?"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def persona(i: int, words: int = 160) -> str:
    """A system prompt of its own per conversation (~600 tokens of the demo tokenizer)."""
    rng = random.Random(i)
    return f"Conversation {i}. " + " ".join(rng.choice(WORDS) for _ in range(words))


def chat(client, messages, max_tokens: int = 8):
    raw = client.chat.completions.with_raw_response.create(model=MODEL, messages=messages, max_tokens=max_tokens,
                                                           temperature=0)
    return raw.parse(), raw.headers.get(REPLICA_HEADER)


def converse(client, i: int, turns: int, think_s: float = 0.3, start=None) -> list[tuple[int, int, str]]:
    """One conversation, each turn echoing the answer back after a think time of about
    `think_s`; (prompt, cached, replica) per turn. `start`: a barrier to open together on."""
    messages, rng = [{"role": "system", "content": persona(i)}], random.Random(i)
    out = []
    if start is not None:
        start.wait(timeout=60)
    for t, question in enumerate(QUESTIONS[:turns]):
        if t:
            time.sleep(think_s * (0.5 + rng.random()))
        messages.append({"role": "user", "content": question})
        completion, replica = chat(client, messages)
        usage = completion.usage
        out.append((usage.prompt_tokens, usage.prompt_tokens_details.cached_tokens, replica))
        messages.append({"role": "assistant", "content": completion.choices[0].message.content or ""})
    return out


def descendants(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            children.setdefault(int(stat.rsplit(")", 1)[1].split()[1]), []).append(int(entry))
    out, stack = [], [root]
    while stack:
        pid = stack.pop()
        out.append(pid)
        stack.extend(children.get(pid, []))
    return out


# ---- 1. `cairn serve` as a user runs it ---------------------------------------------------------

KEYS = {"tenant": "sk-alice-4c1f9e2b7d", "bare": "sk-bare-9a0d3e6f51", "metrics": "sk-ops-2b8e7c4a90"}


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads the process tree from /proc")
def test_cairn_serve_starts_its_own_ray_serves_the_api_and_stops_cleanly_on_ctrl_c(tmp_path, tiny_model_dir):
    """With keys given on the command line, none of them appears in cairn serve's output or in
    any file of its Ray session (Serve logs an application's arguments: keys travel as digests).
    The README's chat, run against it, prints what the README shows (measured on one engine).
    Run as a user runs it: the console script, from a folder outside the checkout where other
    distributions' `kernels`, `workers`, ... come first on the path; no process of it (Ray's
    workers, the replicas) imports one of them."""
    port, log_path = free_port(), tmp_path / "serve.log"
    ray_tmp = Path(tempfile.mkdtemp(prefix="cairn-ray-", dir="/tmp"))  # short: Ray's socket paths are bounded
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(RAY_AUTH_MODE="disabled", RAY_TMPDIR=str(ray_tmp))
    shell = tmp_path / "shell"  # outside the checkout, other distributions' `kernels`, `workers`, ... first
    env = foreign_shell(shell, env)
    with open(log_path, "w") as log:
        proc = subprocess.Popen([cairn_script(), "serve", "--port", str(port),
                                 "--api-key", f"alice:{KEYS['tenant']}", "--api-key", KEYS["bare"],
                                 "--metrics-key", KEYS["metrics"]],
                                stdout=log, stderr=subprocess.STDOUT, env=env, cwd=shell, start_new_session=True)
    try:
        wait_for_log(proc, log_path, f"serving on http://127.0.0.1:{port}/v1", 150)
        base = f"http://127.0.0.1:{port}"
        health = httpx.get(base + "/health", timeout=30)
        assert health.status_code == 200 and health.json() == {"status": "ok"}
        assert httpx.get(base + "/ready", timeout=30).json() == {"status": "ready"}  # the engines answer
        assert httpx.get(base + "/v1/models", timeout=30).status_code == 401
        bare = {"Authorization": f"Bearer {KEYS['bare']}"}
        model = httpx.get(base + "/v1/models", timeout=30, headers=bare).json()["data"][0]["id"]
        assert model == "demo-tiny", "no --model: the demo model (cairn/configs/local.yaml)"
        metrics = httpx.get(base + "/metrics", timeout=30, headers={"Authorization": f"Bearer {KEYS['metrics']}"})
        assert metrics.status_code == 200 and httpx.get(base + "/metrics", headers=bare).status_code == 401
        client = openai.OpenAI(base_url=base + "/v1", api_key=KEYS["tenant"], max_retries=0, timeout=60)

        def ask(i):
            raw = client.chat.completions.with_raw_response.create(
                model=model, messages=[{"role": "user", "content": persona(i, 40)}], max_tokens=8, temperature=0)
            return raw.parse(), raw.headers.get(REPLICA_HEADER)
        with concurrent.futures.ThreadPoolExecutor(6) as pool:
            answers = list(pool.map(ask, range(6)))
        chats = [[{"role": "user", "content": persona(i, 40)}] for i in range(6)]
        for i, (completion, replica) in enumerate(answers):
            assert completion.choices[0].finish_reason == "length" and completion.usage.completion_tokens == 8
            # six new conversations of one tenant: none resumes past what it shares with the others
            shared = shared_prefix(tiny_model_dir, chats[i], chats[:i] + chats[i + 1:])
            assert completion.usage.prompt_tokens_details.cached_tokens <= shared, (i, shared)
            assert replica.startswith("SERVE_REPLICA::cairn#Engine#")
        assert len({replica for _, replica in answers}) == 2, "cairn/configs/local.yaml: 2 engine replicas"
        assert shadowed_imports(shell) == [], f"cairn serve, its Ray workers or its replicas imported {shadowed_imports(shell)}"
        _, shown, _ = readme_chat()  # the README's chat: two replicas print what one engine prints
        # a tenant of its own (the bare key's): alice's six asks above share the role header with turn 1
        printed = run_readme_chat(base + "/v1", env, api_key=KEYS["bare"])
        assert printed.returncode == 0 and printed.stdout == shown, \
            f"README.md shows\n{shown}but behind two replicas the chat printed\n{printed.stdout}{printed.stderr[-2000:]}"

        tree = descendants(proc.pid)
        assert len(tree) > 3, "Ray's processes run under cairn serve (a local Ray it started)"
        os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C in its terminal sends
        assert proc.wait(timeout=90) == 0
        assert "cairn: stopped" in log_path.read_text()
        deadline = time.monotonic() + 20
        while alive := [pid for pid in tree if Path(f"/proc/{pid}").exists()]:
            assert time.monotonic() < deadline, f"left behind: {alive}"
            time.sleep(0.2)
        with pytest.raises(httpx.ConnectError):
            httpx.get(base + "/health", timeout=5)
        sessions = list(ray_tmp.glob("ray/session_*/logs"))
        assert sessions and any(sessions[0].rglob("controller_build_*.log")), "Ray wrote its session logs there"
        files = [log_path, *(f for f in ray_tmp.rglob("*") if f.is_file() and not f.is_symlink())]
        for name, key in KEYS.items():
            leaks = [str(f) for f in files if key.encode() in f.read_bytes()]
            assert not leaks, f"the {name} key is written in {leaks}"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        shutil.rmtree(ray_tmp, ignore_errors=True)


# ---- 2. a 3-replica app in the shared Ray session ----------------------------------------------

REQUEST_TIMEOUT_S = 600  # Serve's http_options.request_timeout_s here, which the ingress enforces too
ROUTING = RoutingConfig(index_actor_name=INDEX, index_timeout_ms=500,  # a busy 2-core CI box: be patient
                        routing_stats_period_s=0.5, fetch=False)  # the affinity and spill rule alone (fetch:
# test_cluster_fetch.py): with fetch, a tiny model's short steps make a move nearly free, and a hot
# prompt spreads before its spill limit


@dataclass
class Cluster:
    url: str
    engine: object  # the Engine deployment's handle (broadcast)

    @property
    def index(self):
        """The index actor now registered under the name (a new one once killed for good)."""
        return ray.get_actor(INDEX, namespace=ROUTING.index_actor_namespace)

    def client(self):
        return openai.OpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0, timeout=60)

    def replicas(self) -> dict[str, tuple[frozenset, frozenset]]:
        """Live replica -> (pages, states) it holds now."""
        results = self.engine.broadcast("cache_contents").results(timeout_s=30)
        return {worker: (pages, states) for worker, pages, states in results}

    def index_workers(self) -> set[str]:
        return ray.get(self.index.workers.remote(), timeout=30)

    def converged(self, timeout_s: float = 20.0) -> dict[str, tuple[frozenset, frozenset]]:
        """Waits until the index holds exactly what every live replica holds (and no one else)."""
        return index_converged(self.engine, lambda: self.index, timeout_s)


@pytest.fixture(scope="module")
def cluster(ray_session, tiny_model_dir):
    from ray import serve

    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port, "request_timeout_s": REQUEST_TIMEOUT_S})
    serve.run(build_application(tiny_model_dir, replicas=3, num_cpus=0.25, routing=ROUTING,
                                api=dict(served_model_name=MODEL), health_check_period_s=1.0),
              name="cairn", route_prefix="/")
    yield Cluster(f"http://127.0.0.1:{port}", serve.get_deployment_handle("Engine", app_name="cairn"))
    serve.shutdown()
    ray.kill(ray.get_actor(INDEX, namespace=ROUTING.index_actor_namespace), no_restart=True)


@dataclass
class Record:
    start: float
    end: float
    ok: bool
    replica: str | None


class Load(LoadThreads):
    """Threads holding multi-turn conversations back to back until stopped; every request is
    recorded (a failed one ends its conversation)."""

    def __init__(self, cluster: Cluster, threads: int = 4, turns: int = 4):
        super().__init__(threads)
        self.cluster, self.turns, self.records, self._lock = cluster, turns, [], threading.Lock()

    def _run(self, k: int) -> None:
        client, conv = self.cluster.client(), 1000 * (k + 1)
        while not self._stop.is_set():
            conv += 1
            messages = [{"role": "system", "content": persona(conv, 60)}]
            for question in QUESTIONS[:self.turns]:
                if self._stop.is_set():
                    return
                messages.append({"role": "user", "content": question})
                start = time.monotonic()
                try:
                    completion, replica = chat(client, messages)
                except Exception:
                    with self._lock:
                        self.records.append(Record(start, time.monotonic(), False, None))
                    break
                with self._lock:
                    self.records.append(Record(start, time.monotonic(), True, replica))
                messages.append({"role": "assistant", "content": completion.choices[0].message.content or ""})


def test_the_ingress_mirrors_the_index_from_before_its_first_request(cluster):
    """The ingress starts its engine handle's router in its constructor: before any request its
    router's mirror follows the index (`Ingress.routing_state`) and holds what the index actor
    holds, so its first requests are routed by cache, not by load alone."""
    from ray import serve

    ingress, seen = serve.get_deployment_handle("Ingress", app_name="cairn"), {}
    wait_until(lambda: mirrors_agree(ingress, cluster.index, list(cluster.replicas()), seen), 30,
               "the ingress's mirror caught up with the index", 0.2)
    (state,) = seen["ingresses"]
    mirrors = [m for m in state["routers"] if m["deployment"] == "Engine"]
    # and no request yet
    assert mirrors and all(m["counts"]["ranked"] == 0 and m["index"] == INDEX for m in mirrors), mirrors
    assert state["node"] == ray.get_runtime_context().get_node_id() and "#Ingress#" in state["replica"], state
    assert state["request_timeout_s"] == REQUEST_TIMEOUT_S, "the operator's limit, which no client header lifts"


def test_turns_land_where_their_conversation_is_and_conversations_spread_over_all_replicas(cluster):
    replicas = set(cluster.replicas())
    assert len(replicas) == 3
    clients, start = [cluster.client() for _ in range(12)], threading.Barrier(12)
    with concurrent.futures.ThreadPoolExecutor(12) as pool:  # a dozen conversations opening at once
        conversations = list(pool.map(lambda i: converse(clients[i], i, turns=4, think_s=1.0, start=start),
                                      range(12)))
    first = [turns[0][2] for turns in conversations]
    assert set(first) == replicas, f"12 concurrent conversations use every replica: {first}"
    for i, turns in enumerate(conversations):
        for (prev_prompt, _, prev_replica), (prompt, cached, replica) in zip(turns, turns[1:]):
            assert replica == prev_replica, (i, turns)
            assert cached >= prev_prompt - PAGE_SIZE - TAIL_GUARD, (i, turns)
            assert cached < prompt
    cluster.converged()


def test_the_ingress_metrics_parse_as_prometheus_text_and_count_the_routing(cluster):
    from prometheus_client.parser import text_string_to_metric_families

    chat(cluster.client(), [{"role": "user", "content": "How many stones make a cairn?"}])
    response = httpx.get(cluster.url + "/metrics", timeout=30)
    assert response.status_code == 200, response.text
    assert len(response.headers.get_list("x-request-id")) == 1, "Serve's proxy echoes the id the app adopted"
    families = {f.name: f for f in text_string_to_metric_families(response.text)}
    value = {name: sum(s.value for s in f.samples) for name, f in families.items()}
    assert value["cairn_router_ranked"] >= 1 and value["cairn_router_routed"] >= 1
    assert value["cairn_router_index_fallbacks"] <= value["cairn_router_ranked"]
    assert value["cairn_router_index_mirror_pages"] > 0, "the router mirrors what the replicas hold"
    assert 0 <= value["cairn_router_index_mirror_age_seconds"] <= ROUTING.index_staleness_s
    info = families["cairn_engine_info"].samples[0].labels
    assert info["worker_id"] in cluster.replicas(), "the engine metrics name the replica that answered"
    assert value["cairn_prompt_tokens"] > 0, "the chat's prompt is counted"
    assert value["cairn_engine_cache_budget_bytes"] > 0 and "cairn_engine_pages_cached" in value


def sse_events(http, path: str, body: dict) -> list:
    """A streamed request's data events, `[DONE]` included, read to the end of the response."""
    with http.stream("POST", path, json={**body, "stream": True}) as response:
        assert response.status_code == 200, response.read()
        return [line[6:] if line[6:] == "[DONE]" else json.loads(line[6:])
                for line in response.iter_lines() if line.startswith("data: ")]


def test_a_request_of_several_choices_or_prompts_answers_every_one_of_them(cluster):
    """n > 1 and prompt batches fan out into engine calls from one HTTP request, which Serve once
    tracked under that request's single id: all but the first call waited forever. Greedy, every
    choice computes what the same prompt computes alone."""
    client, http = cluster.client(), httpx.Client(base_url=cluster.url, timeout=60)
    messages = [{"role": "user", "content": "Which stones hold best when they are wet?"}]
    alone = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=0)
    answer = alone.choices[0].message.content
    for n in (2, 5):
        out = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=0, n=n)
        assert sorted(c.index for c in out.choices) == list(range(n))
        assert [c.message.content for c in out.choices] == [answer] * n
        assert out.usage.completion_tokens == n * alone.usage.completion_tokens
    events = sse_events(http, "/v1/chat/completions", dict(model=MODEL, messages=messages, max_tokens=6,
                                                           temperature=0, n=6))
    assert events[-1] == "[DONE]"
    texts, finished = [""] * 6, set()
    for event in events[:-1]:
        for c in event["choices"]:
            texts[c["index"]] += c["delta"].get("content") or ""
            if c["finish_reason"]:
                finished.add(c["index"])
    assert finished == set(range(6)) and texts == [answer] * 6

    prompts = ["a cairn on the ridge", "fog over the summit", "moss on granite"]
    singles = [client.completions.create(model=MODEL, prompt=p, max_tokens=5, temperature=0).choices[0].text
               for p in prompts]
    out = client.completions.create(model=MODEL, prompt=prompts, max_tokens=5, temperature=0, n=2)
    assert [(c.index, c.text) for c in out.choices] == [(k * 2 + i, singles[k]) for k in range(3) for i in range(2)]
    events = sse_events(http, "/v1/completions", dict(model=MODEL, prompt=prompts, max_tokens=5, temperature=0, n=2))
    assert events[-1] == "[DONE]"
    texts, finished = [""] * 6, set()
    for event in events[:-1]:
        for c in event["choices"]:
            texts[c["index"]] += c["text"]
            if c["finish_reason"]:
                finished.add(c["index"])
    assert finished == set(range(6)) and texts == [s for s in singles for _ in range(2)]


def ray_exported_families(timeout_s: float, ready) -> dict:
    """Ray's metrics export of this node (its metrics agent, on the node's MetricsExportPort), parsed,
    once `ready(families)` holds (Ray exports every few seconds)."""
    from prometheus_client.parser import text_string_to_metric_families

    node = next(n for n in ray.nodes() if n["Alive"])
    url = f"http://{node['NodeManagerAddress']}:{node['MetricsExportPort']}/metrics"
    deadline, families = time.monotonic() + timeout_s, {}
    while time.monotonic() < deadline:
        try:
            families = {f.name: f for f in text_string_to_metric_families(httpx.get(url, timeout=10).text)}
        except httpx.HTTPError:
            families = {}
        if ready(families):
            return families
        time.sleep(1)
    raise AssertionError(f"Ray's export at {url} never had what was waited for; it has "
                         f"{sorted(n for n in families if 'cairn' in n)}")


def series(families: dict, sample: str, **tags) -> list:
    return [s for f in families.values() for s in f.samples
            if s.name == sample and all(s.labels.get(k) == v for k, v in tags.items())]


def test_every_replicas_metrics_reach_rays_export_each_under_its_own_replica_tag(cluster):
    chat(cluster.client(), [{"role": "user", "content": "Where does the trail cross the river?"}])
    engines = {w.rsplit("#", 1)[1] for w in cluster.replicas()}  # Serve's replica tag ends the worker id
    on_engines = dict(sample="ray_cairn_engine_pages_total", application="cairn", deployment="Engine")

    dashboard = json.loads((REPO / "cairn" / "configs" / "grafana-dashboard.json").read_text())
    shown = {n for panel in dashboard["panels"] for t in panel["targets"]
             for n in re.findall(r"\bray_cairn_[a-z0-9_]+\b", t["expr"])}

    def ready(families):
        names = {s.name for f in families.values() for s in f.samples}
        return {s.labels["replica"] for s in series(families, **on_engines)} == engines and shown <= names and \
            series(families, "ray_cairn_requests_total", deployment="Ingress", endpoint="/v1/chat/completions")
    families = ray_exported_families(90, ready)  # every name the Grafana dashboard reads, too
    assert len(engines) == 3 and all(s.value > 0 for s in series(families, **on_engines))
    held = {s.labels["replica"] for s in series(families, "ray_cairn_engine_cached_tokens", deployment="Engine")}
    assert held == engines, "every engine gauge, not only one"
    buckets = series(families, "ray_cairn_time_to_first_token_seconds_bucket", deployment="Ingress")
    assert {s.labels["le"] for s in buckets} >= {"0.005", "+Inf"} and max(s.value for s in buckets) >= 1, \
        "a histogram arrives bucket by bucket, readable by histogram_quantile"
    assert series(families, "ray_cairn_router_ranked_total", deployment="Ingress")


def test_a_hot_shared_prompt_fills_its_replica_up_to_the_spill_limit_then_spills(cluster):
    hot = "You are the shared assistant of the cairn club. " * 105  # ~2,400 tokens, shared by every request
    client, limit = cluster.client(), ROUTING.spill_limit
    _, holder = chat(client, [{"role": "system", "content": hot}, {"role": "user", "content": "warm up"}])
    streams, placed = [], []
    http = httpx.Client(base_url=cluster.url, timeout=60)
    try:
        for i in range(limit + 4):  # one at a time, each kept in flight (ignore_eos, long)
            response = open_chat_stream(http, MODEL, [{"role": "system", "content": hot},
                                                      {"role": "user", "content": f"question {i}"}])
            streams.append(response)
            assert response.status_code == 200
            placed.append(response.headers[REPLICA_HEADER])
    finally:
        for response in streams:
            response.close()
        http.close()
    assert placed[:limit] == [holder] * limit, f"affinity holds up to the spill limit: {placed}"
    counts, replicas = {}, set(cluster.replicas())
    for replica in placed:  # every request was routed while all earlier ones were still in flight
        busy = [counts.get(r, 0) for r in replicas]
        assert counts.get(replica, 0) - min(busy) < limit, f"routed past the spill limit: {placed}"
        counts[replica] = counts.get(replica, 0) + 1
    assert counts[holder] == limit and len(counts) >= 2, placed


def test_cairn_serve_address_joins_a_running_cluster_and_takes_down_only_its_own_app(cluster, tiny_model_dir,
                                                                                    tmp_path):
    import yaml
    from ray import serve

    config = {"applications": [{
        "name": "joined", "route_prefix": "/joined", "import_path": "cairn.cluster.app:app_builder",
        "args": {"replicas": 1, "num_cpus": 0.25, "routing": {"index_actor_name": INDEX + "-joined"}}}]}
    (tmp_path / "joined.yaml").write_text(yaml.safe_dump(config))
    log_path, env = tmp_path / "serve.log", {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    address = ray.get_runtime_context().gcs_address
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "cairn.cluster.cli", "serve", "--address", address,
                                 "--config", str(tmp_path / "joined.yaml"), "--model", str(tiny_model_dir),
                                 "--served-model-name", MODEL], stdout=log, stderr=subprocess.STDOUT, env=env,
                                cwd=tmp_path, start_new_session=True)
    try:
        url = cluster.url + "/joined/v1"  # the running Serve's port, whatever the config says
        wait_for_log(proc, log_path, f"serving on {url}", 120)
        client = openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=60)
        completion, replica = chat(client, [{"role": "user", "content": "hello"}])
        assert completion.usage.completion_tokens == 8 and replica.startswith("SERVE_REPLICA::joined#Engine#")
        os.killpg(proc.pid, signal.SIGINT)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        kill_index_actor(INDEX + "-joined")
    apps = serve.status().applications
    assert "joined" not in apps and apps["cairn"].status == "RUNNING", "only its own application was deleted"
    assert ray.is_initialized() and chat(cluster.client(), [{"role": "user", "content": "still there?"}])[1]


def test_an_event_gap_makes_the_worker_resync_and_the_index_converges(cluster):
    workers = set(cluster.converged())
    gaps_before = ray.get(cluster.index.stats.remote())["gaps_detected"]
    for worker in workers:  # a batch far ahead of what the worker sent: events in between were lost
        batch = EventBatch(worker, 10**9, time.time(), (PagesStored((os.urandom(16),), None),))
        assert tuple(ray.get(cluster.index.apply.remote(batch.encode()))) == (False, True)
    assert ray.get(cluster.index.workers_needing_resync.remote()) == workers
    assert ray.get(cluster.index.score.remote([os.urandom(16)])) == {}
    converse(cluster.client(), 99, turns=2)  # the replicas that serve it hear "resync" in the index's answer;
    held = cluster.converged()              # the idle ones on their next poll
    assert sum(len(pages) for pages, _ in held.values()) > 0
    assert ray.get(cluster.index.stats.remote())["gaps_detected"] == gaps_before + len(workers)


def test_killing_the_index_actor_under_load_loses_no_request_and_the_index_is_rebuilt(cluster):
    index = cluster.index
    with Load(cluster) as load:
        time.sleep(1.5)
        killed = time.monotonic()
        ray.kill(index, no_restart=False)  # Ray restarts it (max_restarts=-1), empty: in-memory backend
        deadline = time.monotonic() + 30
        while True:
            try:
                if ray.get(index.stats.remote(), timeout=5)["restarted"]:
                    break
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                pass
            assert time.monotonic() < deadline, "Ray did not restart the index actor"
            time.sleep(0.1)
        time.sleep(2)
    assert all(r.ok for r in load.records), [r for r in load.records if not r.ok]
    assert sum(r.start > killed for r in load.records) >= 4, "requests were served while the index was down"
    held = cluster.converged()  # rebuilt from the workers' snapshots
    stats = ray.get(cluster.index.stats.remote())
    assert stats["restarted"] and stats["workers"] == 3 and stats["pages"] == sum(len(p) for p, _ in held.values())


def test_an_index_actor_killed_for_good_is_replaced_and_refilled_by_the_replicas(cluster):
    old = cluster.index
    with Load(cluster) as load:
        time.sleep(1.0)
        killed = time.monotonic()
        ray.kill(old, no_restart=True)  # gone for good: routers and replicas look the name up again
        deadline = time.monotonic() + 30
        while True:
            try:
                new = cluster.index
                if new._actor_id != old._actor_id and ray.get(new.stats.remote(), timeout=5)["workers"] == 3:
                    break
            except (ValueError, ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                pass  # not created yet, or still starting
            assert time.monotonic() < deadline, "no new index actor learned the replicas"
            time.sleep(0.1)
        time.sleep(1)
    assert all(r.ok for r in load.records), [r for r in load.records if not r.ok]
    assert sum(r.start > killed for r in load.records) >= 4
    cluster.converged()  # the replicas' next batches were gaps to it: they resynced


def test_a_killed_replica_leaves_the_index_within_5s_and_its_replacement_is_learned_from_events(cluster):
    before = set(cluster.replicas())
    with Load(cluster) as load:
        time.sleep(1.5)
        with load._lock:
            served = [r.replica for r in load.records if r.ok]
        victim = max(before, key=served.count)
        ray.kill(ray.get_actor(victim, namespace="serve"), no_restart=True)
        killed = time.monotonic()
        while victim in cluster.index_workers():
            assert time.monotonic() - killed < 5, "the dead replica is still in the index"
            time.sleep(0.05)
        dropped = time.monotonic()
        time.sleep(2)
    after = [r for r in load.records if r.start > dropped]
    assert len(after) >= 4 and all(r.ok for r in after), after
    assert victim not in {r.replica for r in after}
    assert all(r.ok for r in load.records if r.start > killed + 1.0), "only requests in flight at the kill may fail"

    deadline = time.monotonic() + 60  # Serve replaces it (health_check_period_s=1)
    while len(now := set(cluster.replicas())) < 3 or victim in now:
        assert time.monotonic() < deadline, "Serve never replaced the killed replica"
        time.sleep(0.5)
    (new,) = now - before
    held = cluster.converged()  # it introduced itself with its (empty) snapshot
    assert held[new] == (frozenset(), frozenset())
    with concurrent.futures.ThreadPoolExecutor(6) as pool:  # new conversations: the empty replica gets its share
        turns = list(pool.map(lambda i: converse(cluster.client(), 200 + i, turns=2), range(6)))
    assert new in {t[0][2] for t in turns}
    held = cluster.converged()
    assert held[new][0], "what it cached since reached the index through its events"


def test_behind_serves_proxy_the_ingress_refuses_big_headers_and_closes_a_stalled_body(cluster, tiny_model_dir):
    """Serve's proxy reads headers of any size and gives a body all the time it wants: the ingress's
    RequestGuard answers instead (431, 408), in OpenAI's shape, and its Connection: close reaches
    the client through the proxy."""
    from ray import serve

    limits = {"max_header_bytes": 4096, "body_timeout_s": 2.0}
    serve.run(build_application(tiny_model_dir, replicas=1, num_cpus=0.25,
                                api=dict(served_model_name=MODEL, http_limits=limits),
                                routing=RoutingConfig(index_actor_name=INDEX + "-limits")),
              name="limits", route_prefix="/limits")
    host, port = cluster.url.removeprefix("http://").split(":")
    try:
        big = httpx.get(cluster.url + "/limits/health", headers={"X-Big": "a" * 8000}, timeout=30)
        assert big.status_code == 431 and big.json()["error"]["code"] == "headers_too_large"
        with socket.create_connection((host, int(port)), timeout=30) as sock:
            sock.sendall(b"POST /limits/v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 1000\r\n\r\n{\"model\": ")
            start, data = time.monotonic(), b""
            while chunk := sock.recv(65536):
                data += chunk
        waited = time.monotonic() - start
        head, _, body = data.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 408") and json.loads(body)["error"]["code"] == "request_timeout", data
        assert 1.5 <= waited <= 15, "closed by the body deadline, not by the proxy's keep-alive"
    finally:
        serve.delete("limits", _blocking=True)
        kill_index_actor(INDEX + "-limits")


def test_a_qwen3_5_moe_model_is_served_by_its_hub_id_with_its_cache_and_routing(cluster, demo_model, ray_hf_home,
                                                                                 monkeypatch):
    """Any supported family serves in the cluster as the demo does, here the Qwen3.5 MoE demo
    model, deployed by a Hugging Face id that every replica resolves from its own (offline) cache:
    two replicas behind their own app; each conversation stays on the replica holding it, and its
    cached_tokens cover the previous turn's prompt (its template opens thinking every turn)."""
    from tests.support.checkpoints import write_hub_snapshot
    from ray import serve

    repo, commit = "cairn-org/qwen3_5-moe", "5" * 40
    cache = ray_hf_home / "hub" / "models--cairn-org--qwen3_5-moe"
    if not cache.exists():
        write_hub_snapshot(cache, commit, demo_model("qwen3_5_moe"))
        (cache / "refs").mkdir()
        (cache / "refs" / "main").write_text(commit)
    monkeypatch.setenv("HF_HOME", str(ray_hf_home))  # where this driver resolves it too
    index = INDEX + "-q35"
    serve.run(build_application(repo, replicas=2, num_cpus=0.25, routing=RoutingConfig(index_actor_name=index)),
              name="q35", route_prefix="/q35")
    client = openai.OpenAI(base_url=cluster.url + "/q35/v1", api_key="none", max_retries=0, timeout=60)
    try:
        assert [m.id for m in client.models.list().data] == [repo]  # the served name defaults to the id
        for i in range(2):
            prompts, cached, replicas = chat_turns(client, repo, persona(100 + i), QUESTIONS[:3])
            assert len(replicas) == 1, replicas
            for t in (1, 2):
                assert cached[t] >= prompts[t - 1] - PAGE_SIZE - TAIL_GUARD, (prompts, cached)
    finally:
        serve.delete("q35", _blocking=True)
        kill_index_actor(index)


# ---- 3. drain: a replica scaled down or replaced finishes what it has in flight ----------------

def stream_chat(url: str, content: str, max_tokens: int, first: threading.Event, out: dict) -> None:
    """One streamed chat through `url`; `out`: its replica, finish reasons, usage, error."""
    body = {"model": MODEL, "stream": True, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0,
            "stream_options": {"include_usage": True}, "messages": [{"role": "user", "content": content}]}
    try:
        with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=300) as r:
            out["status"], out["replica"] = r.status_code, r.headers.get(REPLICA_HEADER)
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                first.set()
                if line == "data: [DONE]":
                    out["done"] = True
                    continue
                chunk = json.loads(line[6:])
                out.setdefault("finish", []).extend(c["finish_reason"] for c in chunk.get("choices", [])
                                                    if c.get("finish_reason"))
                out["usage"] = chunk.get("usage") or out.get("usage")
    except Exception as e:  # noqa: BLE001 - what the test reports
        out["error"] = repr(e)
    finally:
        out["ended"] = time.monotonic()
        first.set()


def test_a_replica_scaled_down_or_replaced_finishes_its_streams_then_leaves_the_index(cluster, tiny_model_dir):
    """As `serve deploy` (and `cairn serve --config`) does it: a config whose `deployments:` lowers the
    engine's num_replicas scales down in place (Serve picks the replica to stop); one whose args change
    is a new code version and replaces every replica. Either way a stopping replica is sent nothing new,
    keeps running until its requests end (graceful_shutdown_timeout_s), then says goodbye to the index
    (drop_worker): the index never had to reap it."""
    from ray import serve
    from ray.serve.context import _get_global_client
    from ray.serve.schema import ServeDeploySchema

    index_name, client = INDEX + "-drain", _get_global_client()
    args = {"model_dir": str(tiny_model_dir), "replicas": 2, "num_cpus": 0.25, "served_model_name": MODEL,
            "routing": {"index_actor_name": index_name, "index_timeout_ms": 500}, "health_check_period_s": 1.0,
            "graceful_shutdown_timeout_s": 120, "graceful_shutdown_wait_loop_s": 0.5}
    app = {"name": "drain", "route_prefix": "/drain", "import_path": "cairn.cluster.app:app_builder", "args": args}
    url = cluster.url + "/drain"

    def deploy(app_config: dict) -> None:
        client.deploy_apps(ServeDeploySchema.model_validate({"applications": [app_config]}), _blocking=False)

    def serve_status(name: str):
        a = serve.status().applications.get(name)
        return a.status if a else None

    def running_replicas(n: int) -> set[str]:
        deadline = time.monotonic() + 120
        while True:
            status = serve_status("drain")
            if status == "RUNNING":
                try:
                    live = {w for w, *_ in serve.get_deployment_handle("Engine", app_name="drain")
                            .broadcast("cache_contents").results(timeout_s=30)}
                    if len(live) == n:
                        return live
                except Exception:  # noqa: BLE001 - a replica going away mid-broadcast
                    pass
            assert time.monotonic() < deadline, f"drain app never ran {n} replicas: {status}"
            time.sleep(0.5)

    def index_lists(workers: set[str], timeout_s: float = 30) -> None:
        actor, deadline = ray.get_actor(index_name, namespace=ROUTING.index_actor_namespace), time.monotonic() + timeout_s
        while (listed := ray.get(actor.workers.remote(), timeout=30)) != workers:
            assert time.monotonic() < deadline, f"the index lists {listed}, not {workers}"
            time.sleep(0.2)

    def reaped() -> int:
        actor = ray.get_actor(index_name, namespace=ROUTING.index_actor_namespace)
        return ray.get(actor.stats.remote(), timeout=30)["workers_reaped"]

    def streams_in_flight(k: int, max_tokens: int) -> list[tuple[threading.Thread, dict]]:
        out = []
        for i in range(k):
            first, result = threading.Event(), {}
            t = threading.Thread(target=stream_chat, args=(url, persona(500 + i, 30), max_tokens, first, result),
                                 daemon=True)
            t.start()
            assert first.wait(120), "no first token"
            out.append((t, result))
        return out

    def finished_whole(streams, max_tokens: int) -> None:
        for t, result in streams:
            t.join(timeout=240)
            assert not t.is_alive() and "error" not in result, result
            assert result["status"] == 200 and result.get("done") and result["finish"] == ["length"], result
            assert result["usage"]["completion_tokens"] == max_tokens, result

    tokens = 600
    try:
        deploy(app)
        before = running_replicas(2)
        index_lists(before)  # each introduced itself with its first snapshot
        reaped_before = reaped()

        # scale down in place: streams on both replicas, then one replica fewer
        streams = streams_in_flight(4, tokens)
        assert {r["replica"] for _, r in streams} == before, "both replicas hold a stream"
        asked = time.monotonic()
        deploy(dict(app, deployments=[{"name": "Engine", "num_replicas": 1}]))
        (kept,) = running_replicas(1)
        assert kept in before
        finished_whole(streams, tokens)
        stopped = [r for _, r in streams if r["replica"] != kept]
        assert stopped and all(r["ended"] > asked for r in stopped), "they were in flight when it was told to stop"
        print(f"scale-down: the stopped replica's streams ended {[round(r['ended'] - asked, 1) for r in stopped]} s "
              f"after it was asked")
        index_lists({kept})

        # replace: new args are a new code version; the old replica drains, its successor takes over
        streams = streams_in_flight(2, tokens)
        assert {r["replica"] for _, r in streams} == {kept}
        asked = time.monotonic()
        deploy(dict(app, args=dict(args, engine_options={"seed": 1}), deployments=[{"name": "Engine",
                                                                                    "num_replicas": 1}]))
        finished_whole(streams, tokens)
        print(f"replace: the old replica's streams ended {[round(r['ended'] - asked, 1) for _, r in streams]} s "
              f"after it was asked")
        (new,) = running_replicas(1)
        assert new != kept
        index_lists({new})
        assert reaped() == reaped_before, "each stopped replica left the index itself (drop_worker), not reaped"
    finally:
        serve.delete("drain", _blocking=True)
        kill_index_actor(index_name)


def test_the_ingress_is_ready_only_once_an_engine_replica_answers(monkeypatch):
    """No engine replica yet: the handle's call waits in Serve's queue, and /ready says 503 after
    READY_TIMEOUT_S rather than hanging; a replica that answers makes it ready."""
    import asyncio
    from types import SimpleNamespace

    from cairn.cluster import ingress

    monkeypatch.setattr(ingress, "READY_TIMEOUT_S", 0.2)

    async def never():
        await asyncio.Event().wait()

    async def answers():
        return True

    async def probe(remote):
        client = ingress.HandleEngineClient(SimpleNamespace(ready=SimpleNamespace(remote=remote)), spec=None)
        return await client.ready()

    assert asyncio.run(probe(never)) is False
    assert asyncio.run(probe(answers)) is True
