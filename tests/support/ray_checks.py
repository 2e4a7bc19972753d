"""Waiting on and inspecting a real Ray cluster in tests: the index converged, the routers'
mirrors agree, where actors run, a killed index actor, steady load threads, a free port."""

from __future__ import annotations

import socket
import subprocess
import threading
import time
from pathlib import Path



def index_converged(engine, index, timeout_s: float = 20.0) -> dict[str, tuple[frozenset, frozenset]]:
    """Waits until the cache index holds exactly what every live engine replica holds, and no one
    else; returns replica -> (pages, states). `engine`: the Engine deployment's handle; `index()`:
    the index actor now registered (looked up each time: a new one once killed for good)."""
    import ray

    deadline = time.monotonic() + timeout_s
    while True:
        held = {w: (p, s) for w, p, s in engine.broadcast("cache_contents").results(timeout_s=30)}
        actor = index()
        known = {w: ray.get(actor.contents.remote(w), timeout=30) for w in held}
        stale = ray.get(actor.workers_needing_resync.remote(), timeout=30)
        if not stale and ray.get(actor.workers.remote(), timeout=30) == set(held) and all(
                known[w] is not None and tuple(known[w]) == held[w] for w in held):
            return held
        sizes = {w: ((len(p), len(s)), known[w] and (len(known[w][0]), len(known[w][1])))
                 for w, (p, s) in held.items()}
        assert time.monotonic() < deadline, f"index never converged: needing resync {stale}, " \
                                            f"(replica, index) sizes {sizes}"
        time.sleep(0.25)


class LoadThreads:
    """Threads running `_run(k)` (k = 0 .. threads - 1, a subclass's load loop, which returns once
    `_stop` is set) from the start of a `with` block to its end, which stops and joins them."""

    def __init__(self, threads: int):
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(k,), daemon=True) for k in range(threads)]

    def __enter__(self):
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        for t in self._threads:
            t.join(timeout=90)

    def _run(self, k: int) -> None:
        raise NotImplementedError


def kill_index_actor(name: str, namespace: str = "cairn") -> None:
    """Kills a test's cache-index actor (detached: it outlives its app) if it is still there."""
    import ray

    try:
        ray.kill(ray.get_actor(name, namespace=namespace), no_restart=True)
    except ValueError:  # never created, or already gone
        pass


def wait_for_log(proc: subprocess.Popen, log_path: Path, text: str, timeout_s: float) -> None:
    """Waits until `text` appears in the log of `proc` (a `cairn serve`), failing with the log's
    tail if the process exits first or the time runs out."""
    deadline = time.monotonic() + timeout_s
    while text not in log_path.read_text():
        assert proc.poll() is None, f"cairn serve exited with {proc.returncode}:\n{log_path.read_text()[-3000:]}"
        assert time.monotonic() < deadline, f"cairn serve never came up:\n{log_path.read_text()[-3000:]}"
        time.sleep(0.5)


def actor_nodes() -> dict[str, str]:
    """Every live named actor of the connected Ray cluster -> the id of the node it runs on (from
    the GCS's actor table: Ray's state API needs a dashboard, which test clusters may not run)."""
    import ray

    return {a["Name"]: a["Address"]["NodeID"] for a in ray._private.state.actors(actor_state_name="ALIVE").values()
            if a["Name"]}


def wait_until(condition, timeout_s: float, what: str, every_s: float = 0.1):
    """`condition()` once it is truthy, polled every `every_s`; TimeoutError naming `what` past `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not (value := condition()):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not within {timeout_s} s")
        time.sleep(every_s)
    return value


def mirrors_agree(ingress, index, engines: list[str], seen: dict | None = None) -> bool:
    """Whether every ingress replica's index mirror (`Ingress.routing_state`, through the Ingress
    deployment's handle `ingress`) holds the index actor's (`index`) epoch, cursor and digest and
    knows exactly the engine replicas `engines`; what was read is left in `seen` (`ingresses`,
    `index`)."""
    import ray

    seen = {} if seen is None else seen
    seen.update(ingresses=ingress.broadcast("routing_state").results(timeout_s=30),
                index=ray.get(index.digest.remote(), timeout=30))
    want = [seen["index"][k] for k in ("epoch", "cursor", "digest")]
    mirrors = [m for state in seen["ingresses"] for m in state["routers"]]
    return all(state["routers"] for state in seen["ingresses"]) and all(
        [m.get(k) for k in ("epoch", "cursor", "digest")] == want and m["workers"] == sorted(engines)
        for m in mirrors)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
