"""A cairn app on several Ray nodes of this machine, for tests/support/multinode_scenarios.py.

- `MultiNode`: Ray's own multi-node test utility (`ray.cluster_utils.Cluster`): a head of 2 CPUs
  and worker nodes of 2 CPUs and 1 GPU that Ray counts but no device behind it, each node its own
  raylet and object store. An engine replica asks `num_gpus: 1`, as cairn/configs/serve.yaml does, so it
  runs on a worker node only (its engine on the CPU); one replica per worker. Each node's Serve
  proxy has a port of its own (`proxy_urls`): the head's is Serve's http_options.port, a worker
  node's is `RAY_SERVE_WORKER_PROXY_HTTP_PORT` in its raylet's environment, which Serve's proxy
  reads in place of http_options.port on every node but the head (on one machine every node's
  proxy would otherwise bind the same port).
- `App`: the Serve app on it (2 engine replicas, the index in Redis, a proxy on every node that
  has a replica, as cairn/configs/serve.yaml's `proxy_location: EveryNode`, and one ingress replica on
  each of the head and the first two workers: a proxy hands requests to the ingress replica on
  its own node), and what runs where. `url` is the head's proxy.
- `Load`, `Outcome`: requests sent back to back, each one's status, replica and error kept.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from dataclasses import asdict, dataclass

import httpx
import openai
import ray
from ray import serve
from ray.cluster_utils import Cluster

from cairn.cluster.app import build_application
from cairn.cluster.ingress import REPLICA_HEADER
from cairn.cluster.routing.routing_config import RoutingConfig
from tests.support.chat import open_chat_stream
from tests.support.ray_checks import LoadThreads, actor_nodes, free_port

MB = 1024 * 1024
MODEL = "tiny"
WORKER_PROXY_PORT = "RAY_SERVE_WORKER_PROXY_HTTP_PORT"  # Serve: a worker node's proxy binds this port
INDEX = f"cairn-multinode-index-{uuid.uuid4().hex[:6]}"


def persona(i: int) -> str:
    return f"Conversation {i} on the ridge trail. " + "Stack flat stones, widest first. " * (8 + i)


class MultiNode:
    """The Ray cluster: a head with 2 CPUs, and worker nodes of 2 CPUs and 1 GPU each."""

    def __init__(self, workers: int):
        node = dict(object_store_memory=80 * MB)
        self.ray = Cluster(initialize_head=True, head_node_args=dict(node, num_cpus=2, include_dashboard=False))
        self.head = self.ray.head_node.node_id
        self.proxy_ports = {self.head: free_port()}  # node id -> the port its Serve proxy binds
        self.workers = [self.add_worker() for _ in range(workers)]

    def add_worker(self):
        port = free_port()
        node = self.ray.add_node(num_cpus=2, num_gpus=1, object_store_memory=80 * MB,
                                 env_vars={WORKER_PROXY_PORT: str(port)})  # the raylet's, its workers inherit it
        self.proxy_ports[node.node_id] = port
        return node

    def proxy_urls(self) -> dict[str, str]:
        """Each live node's role -> the URL of its Serve proxy (Serve runs one on the head and on
        every node with a replica)."""
        alive = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
        return {self.role(node): f"http://127.0.0.1:{port}" for node, port in self.proxy_ports.items()
                if node in alive}

    def role(self, node_id: str) -> str:
        if node_id == self.head:
            return "head"
        return next((f"worker{i}" for i, w in enumerate(self.workers) if w.node_id == node_id), "unknown")


@dataclass
class Outcome:
    """One request or stream: when it started and ended (time.monotonic()), its HTTP status, the
    replica that served it, and the error it got (OpenAI's `error` object)."""
    start: float
    end: float
    status: int | None
    replica: str | None
    error: dict | None = None
    done: bool = False  # a stream's [DONE]

    def since(self, zero: float) -> dict:
        """As a dict, its times in seconds from `zero`."""
        return dict(asdict(self), start=round(self.start - zero, 2), end=round(self.end - zero, 2))


class App:
    INGRESS_REPLICAS = 3  # one per node of the head and the first two workers (at most one per node)

    def __init__(self, nodes: MultiNode, model_dir: str, redis_url: str):
        self.nodes, self.port = nodes, nodes.proxy_ports[nodes.head]
        self.routing = RoutingConfig(index_actor_name=INDEX, index_timeout_ms=500, routing_stats_period_s=0.5,
                                     redis_url=redis_url, namespace=f"multinode-{uuid.uuid4().hex[:6]}")
        self.model_dir = model_dir
        serve.start(proxy_location="EveryNode", http_options={"host": "127.0.0.1", "port": self.port})
        self.deploy(self.routing)
        self.url = f"http://127.0.0.1:{self.port}"
        self.engine = serve.get_deployment_handle("Engine", app_name="cairn")
        self.ingress = serve.get_deployment_handle("Ingress", app_name="cairn")

    def deploy(self, routing: RoutingConfig) -> None:
        """Deploys the app with `routing` (again: every replica is replaced, on the GPU nodes free)."""
        self.routing = routing
        serve.run(build_application(self.model_dir, replicas=2, num_cpus=0.5, num_gpus=1, routing=routing,
                                    api=dict(served_model_name=MODEL), health_check_period_s=1.0,
                                    ingress_replicas=self.INGRESS_REPLICAS, ingress_max_replicas_per_node=1),
                  name="cairn", route_prefix="/")

    @property
    def index(self):
        return ray.get_actor(INDEX, namespace=self.routing.index_actor_namespace)

    def engines(self) -> dict[str, str]:
        """Live engine replica -> its node's role."""
        return self._replicas_of("Engine")

    def ingresses(self) -> dict[str, str]:
        """Live ingress replica -> its node's role."""
        return self._replicas_of("Ingress")

    def _replicas_of(self, deployment: str) -> dict[str, str]:
        return {name: self.nodes.role(node) for name, node in actor_nodes().items()
                if f"#{deployment}#" in name}

    def replicas(self) -> dict[str, tuple[frozenset, frozenset]] | None:
        """Engine replicas serving now -> (pages, states) they hold; None while one fails to answer."""
        try:
            return {w: (p, s) for w, p, s in self.engine.broadcast("cache_contents").results(timeout_s=10)}
        except Exception:  # noqa: BLE001 - a dead replica still in the handle's list
            return None

    def index_workers(self) -> set[str]:
        return ray.get(self.index.workers.remote(), timeout=30)

    def client(self, url: str | None = None):
        """The official client on `url` (a proxy's; default: the head's)."""
        return openai.OpenAI(base_url=(url or self.url) + "/v1", api_key="none", max_retries=0, timeout=60)

    def ask(self, http: httpx.Client, i: int) -> Outcome:
        """A short chat completion, not streamed."""
        start = time.monotonic()
        body = {"model": MODEL, "max_tokens": 8, "temperature": 0, "ignore_eos": True,
                "messages": [{"role": "system", "content": persona(50 + i % 7)}, {"role": "user", "content": "Why?"}]}
        try:
            r = http.post("/v1/chat/completions", json=body)
        except httpx.HTTPError as e:
            return Outcome(start, time.monotonic(), None, None, {"transport": repr(e)})
        try:
            error = r.json().get("error") if r.status_code != 200 else None
        except json.JSONDecodeError:  # not ours: Serve's proxy answers in plain text
            error = {"text": r.text[:200]}
        return Outcome(start, time.monotonic(), r.status_code, r.headers.get(REPLICA_HEADER), error)

    def stream(self, i: int, opened: threading.Event, stop: threading.Event, out: list) -> None:
        """A long streamed chat (ignore_eos), read until it ends or `stop` is set; its Outcome
        (`end`: its last event) is appended to `out`. `opened` is set at its first event."""
        o = Outcome(time.monotonic(), time.monotonic(), None, None)
        out.append(o)
        try:
            with httpx.Client(base_url=self.url, timeout=60) as http:
                r = open_chat_stream(http, MODEL, [{"role": "user", "content": persona(20 + i)}], max_tokens=3000)
                o.status, o.replica = r.status_code, r.headers.get(REPLICA_HEADER)
                try:
                    for line in r.iter_lines():
                        if stop.is_set():
                            break
                        if line.startswith("data: "):
                            o.end, o.done = time.monotonic(), line == "data: [DONE]"
                            opened.set()
                            o.error = o.error if o.done else json.loads(line[6:]).get("error", o.error)
                finally:
                    r.close()
        except httpx.HTTPError as e:
            o.end, o.error = time.monotonic(), {"transport": repr(e)}
        finally:
            opened.set()


class Load(LoadThreads):
    """Threads sending short chats back to back until stopped; every Outcome kept."""

    def __init__(self, app: App, threads: int = 2):
        super().__init__(threads)
        self.app, self.outcomes = app, []

    def _run(self, k: int) -> None:
        with httpx.Client(base_url=self.app.url, timeout=60) as http:
            i = k
            while not self._stop.is_set():
                self.outcomes.append(self.app.ask(http, i))
                i += len(self._threads)
