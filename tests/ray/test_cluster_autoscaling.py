"""cairn/configs/cluster.yaml and cairn/configs/serve.yaml autoscaled end to end, on Ray's fake multi-node
provider: the autoscaler reads the cluster config (only its provider swapped, its idle timeout
shortened), "launches" nodes of its declared types as raylets on this machine, and Serve scales
the engine replicas by their queue (cairn/configs/serve.yaml's `autoscaling`, its window shortened).
tests/support/autoscaling_scenario.py runs it once, in a process of its own; each test here judges what
it observed:
- the head starts from the config's own start commands (Redis, then `ray start --head` with the
  bootstrap config), the autoscaler keeps `min_workers` GPU nodes of the declared resources, and
  the app deployed by `cairn serve --address auto --config` puts its engine there, its index in
  the head's Redis and a proxy on every node;
- under load, Serve asks for a second engine replica, which waits for a GPU; the autoscaler
  launches a `gpu_worker` node for it, the replica starts there and serves; no stream fails;
- when quiet, Serve retires the replica and the autoscaler the node left idle, down to
  `min_workers`; the app still answers; nothing the cluster started is left running.

What the fake provider cannot prove: `setup_commands` (pip installs; tests/cluster/test_configs.py checks
their order) and `worker_start_ray_commands` (it starts a node's raylet itself).
"""

import json
import os
import shutil
import subprocess
import sys
import tempfile

import pytest
import yaml

pytestmark = pytest.mark.slow
pytest.importorskip("ray")

from tests.support.fake_autoscaler import FAKE_HEAD_TYPE, GPU_TYPE, gpu_nodes  # noqa: E402 - tests/ is on the path (conftest)
from tests.support.paths import REPO, SUPPORT

CLUSTER = yaml.safe_load((REPO / "cairn" / "configs" / "cluster.yaml").read_text())


@pytest.fixture(scope="module")
def run() -> dict:
    """What tests/support/autoscaling_scenario.py observed (its `AUTOSCALING` line)."""
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed (apt-get install -y redis-server): the head runs it")
    home = tempfile.mkdtemp(prefix="cairn-as", dir="/tmp")  # short: Ray's socket paths live under it
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    try:
        done = subprocess.run([sys.executable, str(SUPPORT / "autoscaling_scenario.py"), home],
                              capture_output=True, timeout=600, env=env)
        out, err = done.stdout.decode(), done.stderr.decode(errors="replace")
    except subprocess.TimeoutExpired as e:
        out, err = (e.stdout or b"").decode(), (e.stderr or b"").decode(errors="replace")
    finally:
        shutil.rmtree(home, ignore_errors=True)
    line = next((x for x in out.splitlines() if x.startswith("AUTOSCALING ")), None)
    assert line is not None, f"the scenario printed no result:\n{err[-4000:]}"
    result = json.loads(line.removeprefix("AUTOSCALING "))
    print("autoscaling timeline:", [(e["t"], e["what"]) for e in result["events"]])
    assert "error" not in result, result["error"] + "\n" + err[-3000:]
    return result


def test_the_head_starts_from_the_cluster_configs_own_start_commands(run):
    started = run["started"]
    assert len(started) == len([c for c in CLUSTER["head_start_ray_commands"] if c.strip() != "ray stop"])
    assert any(c.count("redis-server") and "--appendonly yes" in c for c in started)
    assert any("ray start --head" in c and "--autoscaling-config=~/ray_bootstrap_config.yaml" in c for c in started)


def test_the_autoscaler_keeps_min_workers_gpu_nodes_of_the_declared_resources(run):
    initial, declared = run["initial"], CLUSTER["available_node_types"][GPU_TYPE]
    assert len(gpu_nodes(initial["nodes"])) == declared["min_workers"] == 1
    for node in gpu_nodes(initial["nodes"]):
        assert initial["resources"][node] == declared["resources"], "the node registers what its type declares"


def test_the_app_runs_its_engine_on_a_gpu_node_its_index_on_the_head_in_redis_and_a_proxy_on_every_node(run):
    deployed = run["deployed"]
    (engine_node,) = deployed["engines"].values()
    assert deployed["nodes"][engine_node] == GPU_TYPE
    assert deployed["index"]["backend"] == "redis" and deployed["nodes"][deployed["index"]["node"]] == FAKE_HEAD_TYPE
    for state in (deployed, run["scaled_up"]):
        assert set(state["proxies"]) == set(state["nodes"]), "proxy_location: EveryNode"
        assert all(p.endswith("HEALTHY") for p in state["proxies"].values()), state["proxies"]


def test_under_load_serve_asks_for_a_replica_and_the_autoscaler_launches_a_gpu_node_for_it(run):
    before, after = run["deployed"], run["scaled_up"]
    (new,) = set(after["engines"]) - set(before["engines"])
    new_node = after["engines"][new]
    assert new_node not in before["nodes"] and after["nodes"][new_node] == GPU_TYPE, "a node launched for it"
    assert len(set(after["engines"].values())) == 2, "one engine replica per GPU node"
    waiting = [s for s in run["samples"] if "error" not in s and sum((s["replica_states"] or {}).values()) == 2
               and len(gpu_nodes(s["nodes"])) == 1]
    assert waiting, "Serve asked for the replica before the node existed: the node was launched for it"
    launched = next(s["t"] for s in run["samples"] if "error" not in s and len(gpu_nodes(s["nodes"])) == 2)
    print(f"autoscaling: Serve asked for a second replica at {waiting[0]['t']} s, its node was up at "
          f"{launched} s, the replica running at {next(e['t'] for e in run['events'] if e['what'] == 'scaled up')} s")
    served = [o for o in run["load"] if o["replica"] and o["replica"].endswith(new)]
    assert served, "the new replica served streams"
    assert run["load"] and all(o["status"] == 200 and o["done"] and o["error"] is None for o in run["load"]), \
        [o for o in run["load"] if o["status"] != 200 or o["error"]]


def test_when_quiet_serve_retires_the_replica_and_the_autoscaler_the_idle_node(run):
    down, retired = run["scaled_down"], run["retired"]
    assert len(down["engines"]) == 1
    assert len(gpu_nodes(retired["nodes"])) == CLUSTER["available_node_types"][GPU_TYPE]["min_workers"]
    (kept,) = retired["engines"].values()
    assert gpu_nodes(retired["nodes"]) == [kept], "the node retired is the one left idle"
    assert run["after"]["status"] == 200
    stopped = next(e["t"] for e in run["events"] if e["what"] == "load stopped")
    print(f"autoscaling: load stopped at {stopped} s; one replica again at "
          f"{next(e['t'] for e in run['events'] if e['what'] == 'scaled down')} s; the idle node gone at "
          f"{next(e['t'] for e in run['events'] if e['what'] == 'idle node retired')} s")


def test_cairn_serve_stops_cleanly_and_nothing_the_cluster_started_is_left_running(run):
    assert run["serve_exit"] == 0, run["serve_log"]
    assert run["left_running"] == 0
