"""Engine clients that run no model (`OneTokenClient`, `ScriptedClient`), for API tests that
check what reaches the engine, and `background_apps` to serve several apps at once."""

from __future__ import annotations

from contextlib import ExitStack, contextmanager
from cairn.workers.engine_metrics import EngineMetrics



class OneTokenClient:
    """An `EngineClient` with no engine behind it: it keeps every request it gets and answers each
    with one token. For API tests that need the ingress's work, not a model's."""

    def __init__(self, max_model_len: int = 1 << 16):
        from cairn.workers import EngineSpec

        self.spec = EngineSpec(fingerprint="scripted", page_size=16, max_model_len=max_model_len, recurrent=True,
                               vocab_size=512)
        self.requests: list = []

    async def generate(self, request):
        from cairn.workers import RequestOutput

        self.requests.append(request)
        yield RequestOutput(request.request_id, [5], None, 1, 0, token_ids=[5], finish_reason="length")

    async def abort(self, request_id):
        return False

    async def metrics(self):
        return EngineMetrics()

    def num_waiting(self):
        return 0

    async def ready(self):
        return True


class ScriptedClient(OneTokenClient):
    """An `EngineClient` that answers every request with `script`, one token per output, and keeps
    the requests: exact tokens in, exact text out."""

    def __init__(self):
        super().__init__(max_model_len=4096)
        self.script: list[int] = []

    async def generate(self, request):
        import asyncio

        from cairn.workers import RequestOutput

        self.requests.append(request)
        out: list[int] = []
        for t in self.script[:request.params.max_tokens]:
            out.append(t)
            done = len(out) == len(self.script) or len(out) == request.params.max_tokens
            yield RequestOutput(request.request_id, [t], None, len(out), 0, token_ids=list(out) if done else None,
                                finish_reason=("stop" if len(out) == len(self.script) else "length") if done else None)
            await asyncio.sleep(0)


@contextmanager
def background_apps(*apps):
    """A `BackgroundServer` for each ASGI app, in order; all stopped on exit."""
    from cairn.cluster.api.server import BackgroundServer

    with ExitStack() as stack:
        yield [stack.enter_context(BackgroundServer(app)) for app in apps]
