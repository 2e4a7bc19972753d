"""A load-balancing HTTP proxy for the peer benchmark's cluster row: two peer servers behind one
OpenAI endpoint, routed round-robin or by session.

Contract:
- `python3 benchmarks/peer_proxy.py --port P --policy round-robin|session URL [URL ...]` serves
  on 127.0.0.1:P until terminated.
- POST bodies are forwarded unchanged to one backend, the response streamed back as it comes
  (status, content type and body), with the header `x-peer-backend: <index>` saying which backend
  answered: the client's in-flight balance comes from it, as cairn's from `x-cairn-replica`.
- `round-robin`: backends in turn. `session`: the backend is fixed by the request's
  `x-session-id` header (crc32 modulo the backends; round-robin for a request without one), the
  session affinity a user would put in front of engines that keep per-server caches.
- GET /v1/models is answered by the first backend (the benchmark's readiness probe).
- A backend that cannot be reached gives 502 with the reason; nothing is retried.
"""

from __future__ import annotations

import argparse
import itertools
import zlib

import httpx
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

BACKEND_HEADER = "x-peer-backend"
SESSION_HEADER = "x-session-id"


def make_app(backends: list[str], policy: str) -> Starlette:
    client = httpx.AsyncClient(timeout=None)
    turn = itertools.cycle(range(len(backends)))

    def choose(request: Request) -> int:
        session = request.headers.get(SESSION_HEADER)
        if policy == "session" and session is not None:
            return zlib.crc32(session.encode()) % len(backends)
        return next(turn)

    async def forward(request: Request) -> Response:
        index = choose(request) if request.method == "POST" else 0
        upstream = client.build_request(request.method, backends[index] + request.url.path,
                                        content=await request.body(),
                                        headers={"content-type": request.headers.get("content-type", "")})
        try:
            response = await client.send(upstream, stream=True)
        except httpx.HTTPError as e:
            return JSONResponse({"error": {"message": f"backend {index}: {type(e).__name__}: {e}"}}, 502)

        async def body():
            try:
                async for chunk in response.aiter_raw():
                    yield chunk
            finally:
                await response.aclose()

        return StreamingResponse(body(), status_code=response.status_code,
                                 media_type=response.headers.get("content-type"),
                                 headers={BACKEND_HEADER: str(index)})

    return Starlette(routes=[Route("/{path:path}", forward, methods=["GET", "POST"])])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--policy", choices=("round-robin", "session"), required=True)
    parser.add_argument("backends", nargs="+")
    args = parser.parse_args()
    uvicorn.run(make_app([b.rstrip("/") for b in args.backends], args.policy), host="127.0.0.1",
                port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
