"""cairn/configs/cluster.yaml on Ray's fake multi-node provider, for tests/support/autoscaling_scenario.py.

Ray's autoscaler has a provider that "launches" a node as one more raylet and object store on this
machine (`fake_multinode`, enabled by `RAY_FAKE_CLUSTER=1`), with the resources its node type
declares. Running a cluster config on it proves the config's node types, resources and start
commands work together with the Serve config that runs on them, short of clouds and SSH:

- `gpu_nodes`: which of the cluster's nodes are of its GPU worker type.
- `bootstrap_config`: what `ray up` writes to the head's `~/ray_bootstrap_config.yaml` (Ray's own
  `prepare_config`: defaults filled, setup commands merged), with only the provider swapped for the
  fake one (which names its head node type `ray.head.default`, so the head type is renamed), and
  `overrides` (e.g. a short `idle_timeout_minutes`) written over it.
- `FakeCluster`: a home folder of its own stands in for the head's home; `start()` writes the
  bootstrap config there and runs the config's own `head_start_ray_commands` in it (Redis, then
  `ray start --head --autoscaling-config=~/ray_bootstrap_config.yaml`), every one but `ray stop`,
  which would stop every Ray on this machine. The well-known ports they name (Ray's 6379, Redis's
  6380, the object manager's 8076) become free ones. The fake provider launches nodes from the
  head's autoscaler process; so whatever the cluster starts carries `marker` in its environment,
  which is how `stop()` finds every one of its processes, and only those.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import yaml

from tests.support.ray_checks import free_port

FAKE_HEAD_TYPE = "ray.head.default"   # the head node type the fake provider reports
GPU_TYPE = "gpu_worker"               # cairn/configs/cluster.yaml's GPU worker node type
WELL_KNOWN_PORTS = {"gcs": 6379, "redis": 6380, "object_manager": 8076}
MARKER = "CAIRN_FAKE_CLUSTER"


def bootstrap_config(cluster_yaml: Path, gcs_address: str, overrides: dict[str, Any] | None = None) -> dict:
    from ray.autoscaler._private.util import prepare_config, validate_config

    config = prepare_config(yaml.safe_load(cluster_yaml.read_text()))  # as `ray up` does
    config["provider"] = {"type": "fake_multinode", "gcs_address": gcs_address,
                          "use_node_id_as_ip": True,         # nodes share this machine's address
                          "disable_node_updaters": True,     # no SSH: a node starts as its raylet
                          "disable_launch_config_check": True}
    types = config["available_node_types"]
    types[FAKE_HEAD_TYPE] = types.pop(config["head_node_type"])
    config["head_node_type"] = FAKE_HEAD_TYPE
    config.update(overrides or {})
    validate_config(config)
    return config


def gpu_nodes(nodes: dict[str, str]) -> list[str]:
    """The ids (sorted) of the `GPU_TYPE` nodes among `nodes` (node id -> its type)."""
    return sorted(nid for nid, kind in nodes.items() if kind == GPU_TYPE)


def swap_ports(command: str, ports: dict[str, int]) -> str:
    """`command` with each well-known port it names (as a whole number) replaced by ours."""
    for name, port in WELL_KNOWN_PORTS.items():
        command = re.sub(rf"(?<![\d.]){port}(?!\d)", str(ports[name]), command)
    return command


class FakeCluster:
    def __init__(self, cluster_yaml: Path, home: Path, overrides: dict[str, Any] | None = None,
                 env: dict[str, str] | None = None):
        self.home = home
        self.ports = {name: free_port() for name in WELL_KNOWN_PORTS}
        self.marker = uuid.uuid4().hex
        self.config = bootstrap_config(cluster_yaml, self.address, overrides)
        self.env = {**os.environ, **(env or {}), MARKER: self.marker, "HOME": str(home), "RAY_FAKE_CLUSTER": "1",
                    # the commands' `ray` is this Python's (as on a node, where setup_commands installed it)
                    "PATH": os.pathsep.join((str(Path(sys.executable).parent), os.environ.get("PATH", "")))}
        self.env.pop("RAY_ADDRESS", None)
        self.started: list[str] = []

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.ports['gcs']}"

    @property
    def redis_port(self) -> int:
        return self.ports["redis"]

    def start(self, timeout_s: float = 120) -> None:
        (self.home / "ray_bootstrap_config.yaml").write_text(yaml.safe_dump(self.config))
        for command in self.config["head_start_ray_commands"]:
            if command.strip() == "ray stop":
                continue
            command = swap_ports(command, self.ports)
            run = subprocess.run(["bash", "-c", command], cwd=self.home, env=self.env, capture_output=True,
                                 text=True, timeout=timeout_s)
            if run.returncode != 0:
                raise RuntimeError(f"{command!r} exited {run.returncode}:\n{run.stdout[-2000:]}\n{run.stderr[-4000:]}")
            self.started.append(command)

    def processes(self) -> list[int]:
        """Every process whose environment carries this cluster's marker."""
        needle = f"{MARKER}={self.marker}".encode()
        found = []
        for proc in Path("/proc").iterdir():
            if proc.name.isdigit() and int(proc.name) != os.getpid():
                try:
                    if needle in (proc / "environ").read_bytes().split(b"\0"):
                        found.append(int(proc.name))
                except OSError:  # gone meanwhile, or not ours to read
                    pass
        return found

    def stop(self, grace_s: float = 5) -> None:
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for pid in self.processes():
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
            deadline = time.monotonic() + grace_s
            while self.processes() and time.monotonic() < deadline:
                time.sleep(0.2)


def serve_config(serve_yaml: Path, port: int, redis_port: int, args: dict[str, Any]) -> dict:
    """cairn/configs/serve.yaml for this cluster: its proxy on `port`, its index in the head's Redis on
    `redis_port`, and `args` written over the application's (engine_options and autoscaling merged
    key by key)."""
    config = yaml.safe_load(serve_yaml.read_text())
    config["http_options"]["port"] = port
    (app,) = config["applications"]
    merged = dict(app["args"])
    for key, value in args.items():
        merged[key] = {**merged.get(key, {}), **value} if isinstance(value, dict) else value
    url, head_redis = merged["routing"]["redis_url"], f":{WELL_KNOWN_PORTS['redis']}/"
    if head_redis not in url:
        raise ValueError(f"{serve_yaml}: redis_url {url} is not the Redis the cluster config starts on the head")
    merged["routing"] = {**merged["routing"], "redis_url": url.replace(head_redis, f":{redis_port}/")}
    app["args"] = merged
    return config
