"""`serve_in_process`: the HTTP API over one engine in this process (no Ray).

For `cairn serve --replicas 1` debugging and local use: loads the checkpoint into an
`EngineFront`, builds the app over a `LocalEngineClient` and runs uvicorn until stopped.
Both it and `BackgroundServer` (tests, notebooks) serve every connection under `HTTPLimits`
(`cairn.cluster.api.connection.uvicorn_config`): header size and time, body time, keep-alive.
"""

from __future__ import annotations

import asyncio
import gc
from pathlib import Path

from cairn.cluster.api.connection import uvicorn_config
from cairn.cluster.api.http_limits import HTTPLimits
from cairn.cluster.api.api_options import APIOptions
from cairn.cluster.api.tenants import Tenants
from cairn.workers.engine_options import SERVED, EngineOptions


def serve_in_process(model_dir: str | Path | None = None, options: APIOptions | None = None, *,
                     host: str = "127.0.0.1", port: int = 8000, tenants: Tenants | None = None,
                     api_key: str | None = None, metrics_key: str | None = None,
                     engine_options: EngineOptions = SERVED) -> None:
    """Serves until interrupted. `model_dir` is a directory or a Hugging Face id (`org/name[@revision]`,
    `workers.ModelSource`; its name for clients unless `options.served_model_name` says otherwise);
    None serves the tiny demo model. `options` and the keys are `build_app`'s. The engine runs
    `engine_options` as given (by default warmed up: compiled before serving)."""
    import uvicorn

    from cairn.cluster.api import build_app
    from cairn.cluster.api.engine_client import LocalEngineClient
    from cairn.workers import EngineFront, ModelSource, demo_model_dir

    options = options or APIOptions()
    source = ModelSource.parse(model_dir if model_dir is not None else demo_model_dir("tiny"))
    model_dir = source.local_dir()
    options = options.model_copy(update=dict(served_model_name=options.served_model_name or source.served_name))
    engine = EngineFront.from_pretrained(model_dir, engine_options)
    gc.collect()
    gc.freeze()  # this process serves one engine: its long-lived objects need no cyclic scans (as a replica)
    app = build_app(LocalEngineClient(engine), model_dir, options, tenants=tenants, api_key=api_key,
                    metrics_key=metrics_key)
    http_limits = options.http_limits

    async def main() -> None:
        server = uvicorn.Server(uvicorn_config(app, http_limits, host=host, port=port, log_level="info"))
        try:
            await server.serve()
        finally:
            await engine.close()

    asyncio.run(main())


class BackgroundServer:
    """An ASGI app served by uvicorn on a free loopback port, in a daemon thread, under `limits`
    (default: HTTPLimits()): for tests, notebooks and benchmarks that want real HTTP. Use as a
    context manager; `url` is its root."""

    def __init__(self, app: object, host: str = "127.0.0.1", log_level: str = "warning",
                 limits: HTTPLimits | None = None):
        self.app, self.host, self.log_level, self.limits = app, host, log_level, limits
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def __enter__(self) -> "BackgroundServer":
        import socket
        import threading
        import time

        import uvicorn

        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.host, 0))
        self.port = sock.getsockname()[1]
        config = uvicorn_config(self.app, self.limits, log_level=self.log_level, timeout_graceful_shutdown=2)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [sock]}, daemon=True,
                                        name=f"uvicorn-{self.port}")
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the server on port {self.port} did not start")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10)
