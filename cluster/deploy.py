"""`cairn serve` on Ray: start or join a cluster, deploy, print the endpoint, wait for Ctrl-C.

With `--config` the Serve config YAML is deployed as written (`serve deploy` semantics, through
Ray's own schema); otherwise the application is built from the flags (`cluster.app`). The cache
index is the in-memory one unless the routing config names a Redis URL.
"""

from __future__ import annotations

import argparse
import os
import signal
import threading
from typing import Any


def serve_forever(args: argparse.Namespace, engine_options: dict[str, Any]) -> int:
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    import ray
    from ray import serve

    from cluster.app import app_builder, build_application
    from cluster.routing_config import RoutingConfig

    ray.init(address=args.address, include_dashboard=False) if args.address else ray.init(include_dashboard=False)
    serve.start(http_options={"host": args.host, "port": args.port})
    if args.config:
        import yaml
        from ray.serve.schema import ServeDeploySchema

        config = ServeDeploySchema.model_validate(yaml.safe_load(open(args.config)))
        for app in config.applications:
            serve.run(app_builder(app.args), name=app.name, route_prefix=app.route_prefix, blocking=False)
    else:
        routing = RoutingConfig.from_yaml(args.routing) if args.routing else RoutingConfig()
        app = build_application(args.model, args.replicas, engine_options=engine_options, routing=routing,
                                num_cpus=args.num_cpus, num_gpus=args.num_gpus,
                                served_model_name=args.served_model_name, api_key=args.api_key)
        serve.run(app, name="cairn", route_prefix="/", blocking=False)
    print(f"cairn: serving on http://{args.host}:{args.port}/v1 (Ctrl-C to stop)", flush=True)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        stop.wait()
    except KeyboardInterrupt:
        pass
    finally:
        serve.shutdown()
        ray.shutdown()
    return 0
