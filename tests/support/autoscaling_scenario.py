"""cairn/configs/cluster.yaml and cairn/configs/serve.yaml, autoscaled end to end on Ray's fake multi-node
provider (`tests/support/fake_autoscaler.py`), run as a script by tests/ray/test_cluster_autoscaling.py in a
process of its own:

    python3 tests/support/autoscaling_scenario.py WORKDIR

1. The head starts from the cluster config's own start commands (Redis, `ray start --head` with
   the bootstrap config). The autoscaler launches the `min_workers` GPU worker node.
2. `cairn serve --address auto --config SERVE_YAML` deploys cairn/configs/serve.yaml on it: the demo
   model, an arena and an autoscaling window sized for this machine, everything else as written
   (EveryNode proxies, 2 ingress replicas, engines asking `num_cpus: 2, num_gpus: 1`, the index in
   the head's Redis).
3. Load: streams held open past `target_ongoing_requests` per replica. Serve asks for a second
   engine replica; with no GPU free it waits; the autoscaler launches a GPU worker node of the
   declared type for it, and the replica starts there.
4. Quiet: Serve retires a replica after `downscale_delay_s`, and the autoscaler the node left idle
   after `idle_timeout_minutes`, down to `min_workers`.

It prints one line `AUTOSCALING {json}`: a timeline of what ran where (`events`: seconds since
the cluster was started, node counts by type, engine replicas by node), each request's outcome,
and `error` (a traceback) if a step failed. Times are seconds, measured here.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path

import httpx
import yaml

from tests.support.chat import open_chat_stream
from tests.support.ray_checks import LoadThreads, actor_nodes, free_port, wait_until
from tests.support.fake_autoscaler import FakeCluster, gpu_nodes, serve_config

REPO = Path(__file__).resolve().parents[2]
MODEL = "tiny"
# what this machine changes in cairn/configs/serve.yaml's application (everything else as written)
SERVE_ARGS = {
    "model_dir": None,            # the demo model
    "served_model_name": MODEL,
    "engine_options": {"cache_memory_bytes": 64 << 20, "host_cache_bytes": 16 << 20},
    # the window shortened to fit CI: seconds where a GPU cluster waits minutes
    "autoscaling": {"min_replicas": 1, "initial_replicas": 1, "max_replicas": 2, "target_ongoing_requests": 2,
                    "upscale_delay_s": 1, "downscale_delay_s": 4, "look_back_period_s": 3, "metrics_interval_s": 1},
    "graceful_shutdown_timeout_s": 20,
}
CLUSTER_OVERRIDES = {"idle_timeout_minutes": 0.1}   # 6 s where the config says 10 minutes
POLL_S = 0.5  # how often the scenario looks at the cluster (each look asks the GCS and the controller)
FAST_METRICS = {"AUTOSCALER_UPDATE_INTERVAL_S": "1",  # the autoscaler's loop (5 s by default)
                "RAY_SERVE_REPLICA_AUTOSCALING_METRIC_PUSH_INTERVAL_S": "1",
                "RAY_SERVE_HANDLE_AUTOSCALING_METRIC_PUSH_INTERVAL_S": "1"}


class Timeline:
    def __init__(self):
        self.zero, self.events = time.monotonic(), []

    def now(self) -> float:
        return round(time.monotonic() - self.zero, 1)

    def note(self, what: str, **facts) -> None:
        self.events.append({"t": self.now(), "what": what, **facts})
        print(f"[{self.now():6.1f}] {what} {facts}", file=sys.stderr, flush=True)


def cluster_state() -> dict:
    """What runs where now: the autoscaler's own report (its last loop's, from the GCS: live nodes
    by declared type, launches pending), every live node's type (`nodes`: node id -> type), the
    node of every live engine replica, Serve's view of the engine deployment (status, replicas by
    state) and its proxies (node id -> status)."""
    import ray
    from ray import serve
    from ray.experimental.internal_kv import _internal_kv_get

    raw = _internal_kv_get("__autoscaling_status")
    report = (json.loads(raw).get("autoscaler_report") or {}) if raw else {}
    alive = {n["NodeID"]: n["Resources"] for n in ray.nodes() if n["Alive"]}
    types = report.get("node_type_mapping") or {}  # node "ip" -> type: the fake provider's ip is the node id
    status = serve.status()
    app = status.applications.get("cairn")
    engine = app.deployments.get("Engine") if app else None
    return {"active": report.get("active_nodes", {}), "pending_launches": report.get("pending_launches", {}),
            "pending_nodes": len(report.get("pending_nodes") or ()),
            "nodes": {nid: types.get(nid, "?") for nid in sorted(alive)},
            "resources": {nid: {k: r[k] for k in ("CPU", "GPU") if k in r} for nid, r in alive.items()},
            "engines": {name.split("#")[-1]: node for name, node in actor_nodes().items() if "#Engine#" in name},
            "engine_status": engine and str(engine.status), "replica_states": engine and dict(engine.replica_states),
            "proxies": {nid: str(p) for nid, p in status.proxies.items()}}


class Sampler(LoadThreads):
    """Samples `cluster_state()` every `every_s` on a thread of its own, into `samples` (each with
    its time on the timeline), from the `with` block's start to its end."""

    def __init__(self, timeline: "Timeline", every_s: float = 0.5):
        super().__init__(threads=1)
        self.timeline, self.every_s, self.samples = timeline, every_s, []

    def _run(self, k: int) -> None:
        while not self._stop.wait(self.every_s):
            try:
                self.samples.append({"t": self.timeline.now(), **cluster_state()})
            except Exception as e:  # noqa: BLE001 - a sample missed is no failure
                self.samples.append({"t": self.timeline.now(), "error": repr(e)})


class Streams(LoadThreads):
    """Threads each holding one long stream open after another, until stopped; each stream's
    outcome kept (status, the replica that served it, [DONE] reached, the error event if any)."""

    def __init__(self, url: str, threads: int, timeline: Timeline):
        super().__init__(threads)
        self.url, self.timeline, self.outcomes = url, timeline, []

    def _run(self, k: int) -> None:
        from cairn.cluster.ingress import REPLICA_HEADER

        with httpx.Client(base_url=self.url, timeout=120) as http:
            i = 0
            while not self._stop.is_set():
                i += 1
                messages = [{"role": "user", "content": f"Stream {k}.{i}: tell the long story of the ridge cairns."}]
                o = {"stream": f"{k}.{i}", "start": self.timeline.now(), "status": None, "replica": None,
                     "done": False, "error": None}
                try:
                    r = open_chat_stream(http, MODEL, messages, max_tokens=150)
                    o["status"], o["replica"] = r.status_code, r.headers.get(REPLICA_HEADER)
                    for line in r.iter_lines():
                        if line.startswith("data: "):
                            o["done"] = line == "data: [DONE]"
                            if not o["done"]:
                                o["error"] = json.loads(line[6:]).get("error") or o["error"]
                    r.close()
                except httpx.HTTPError as e:
                    o["error"] = {"transport": repr(e)}
                o["end"] = self.timeline.now()
                self.outcomes.append(o)


def deploy(cluster: FakeCluster, home: Path) -> tuple[subprocess.Popen, str]:
    """`cairn serve --address auto --config` (as the README says to run it on the head) with
    cairn/configs/serve.yaml adapted to this machine (`SERVE_ARGS`, a free port, the head's Redis port);
    returns the running process and the endpoint, once the app answers."""
    port = free_port()
    serve_yaml = home / "serve.yaml"
    serve_yaml.write_text(yaml.safe_dump(serve_config(REPO / "cairn" / "configs" / "serve.yaml", port, cluster.redis_port,
                                                      SERVE_ARGS)))
    server = subprocess.Popen([sys.executable, "-m", "cairn.cluster.cli", "serve", "--address", "auto",
                               "--config", str(serve_yaml)], cwd=home, env=cluster.env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"

    def answering():
        try:
            return httpx.get(url + "/v1/models", timeout=5).status_code == 200
        except httpx.HTTPError:
            return False
    wait_until(lambda: server.poll() is None and answering() and serve_running(), 240, "cairn serve answering", POLL_S)
    return server, url


def index_stats() -> dict:
    """The cache index actor's stats (its backend) and the node it runs on."""
    import ray

    from cairn.cluster.routing.routing_config import RoutingConfig

    routing = RoutingConfig()
    actor = ray.get_actor(routing.index_actor_name, namespace=routing.index_actor_namespace)
    stats = ray.get(actor.stats.remote(), timeout=30)  # running, not only registered
    return {**stats, "node": actor_nodes()[routing.index_actor_name]}


def main(workdir: str) -> None:
    home = Path(workdir)
    (home / "r").mkdir(exist_ok=True)  # Ray's temp folder: short, its socket paths live under it
    env = {"RAY_TMPDIR": str(home / "r"), "RAY_AUTH_MODE": "disabled", "HF_HUB_OFFLINE": "1",
           "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p), **FAST_METRICS}
    cluster = FakeCluster(REPO / "cairn" / "configs" / "cluster.yaml", home, CLUSTER_OVERRIDES, env)
    timeline, out, server = Timeline(), {}, None
    sampler = Sampler(timeline)
    try:
        cluster.start()
        out["started"] = cluster.started
        timeline.note("head started")
        import ray

        ray.init(address=cluster.address, log_to_driver=False)
        with sampler:
            out["initial"] = wait_until(lambda: (s := cluster_state()) and gpu_nodes(s["nodes"]) and s, 90,
                                        "the min_workers GPU node", POLL_S)
            timeline.note("min_workers node up", nodes=out["initial"]["nodes"])
            server, url = deploy(cluster, home)
            out["deployed"] = {**cluster_state(), "index": index_stats()}
            timeline.note("deployed", engines=out["deployed"]["engines"])
            with Streams(url, threads=6, timeline=timeline) as load:
                out["scaled_up"] = wait_until(lambda: (s := cluster_state()) and len(s["engines"]) >= 2
                                            and serve_running() and s, 180, "a second engine replica running", POLL_S)
                timeline.note("scaled up", engines=out["scaled_up"]["engines"])
                new = set(out["scaled_up"]["engines"]) - set(out["deployed"]["engines"])
                wait_until(lambda: any(o["replica"] and o["replica"].split("#")[-1] in new for o in load.outcomes),
                         90, "a stream served by the new replica", POLL_S)
            out["load"], out["load_stopped"] = load.outcomes, timeline.now()
            timeline.note("load stopped", streams=len(load.outcomes))
            out["scaled_down"] = wait_until(lambda: (s := cluster_state()) and len(s["engines"]) == 1 and s, 120,
                                          "back to one engine replica", POLL_S)
            timeline.note("scaled down", engines=out["scaled_down"]["engines"])
            out["retired"] = wait_until(lambda: (s := cluster_state()) and len(gpu_nodes(s["nodes"])) == 1 and s,
                                        120, "the idle GPU node retired", POLL_S)
            timeline.note("idle node retired", nodes=out["retired"]["nodes"])
            r = httpx.post(url + "/v1/chat/completions", timeout=60, json={
                "model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "Still there?"}]})
            out["after"] = {"status": r.status_code, "t": timeline.now()}
    except Exception:
        out["error"] = traceback.format_exc()
    finally:
        if server is not None:
            server.send_signal(signal.SIGINT)
            try:  # read while waiting: a full pipe would block its writer
                log = server.communicate(timeout=60)[0]
                out["serve_exit"] = server.returncode
            except subprocess.TimeoutExpired:
                server.kill()
                out["serve_exit"], log = "killed", server.communicate()[0]
            out["serve_log"] = log[-3000:]
        try:
            import ray

            ray.shutdown()
        finally:
            cluster.stop()
            out["left_running"] = len(cluster.processes())
        out["events"], out["samples"] = timeline.events, sampler.samples
        print("AUTOSCALING " + json.dumps(out, default=str), flush=True)


def serve_running() -> bool:
    from ray import serve

    app = serve.status().applications.get("cairn")
    return app is not None and app.status == "RUNNING" and all(
        d.status == "HEALTHY" for d in app.deployments.values())


if __name__ == "__main__":
    main(sys.argv[1])
