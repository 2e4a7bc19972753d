"""The engine's asyncio front end (`EngineFront`): many callers stream tokens, one thread steps.

Every call into the `Engine` (add, abort, step) runs on one dedicated worker thread, in order,
so the engine needs no locks and the event loop never blocks on a model step. `from_pretrained`
loads the model on that thread too, so that on a CPU one thread alone runs torch's parallel
work: each thread that does gets an OpenMP team of its own, and once a process has more team
threads than cores, GNU OpenMP stops spinning between parallel regions and every small op waits
on a wake-up (a 1024-token prefill step of the peer model took 1.5x as long, its batched
triangular solves 5x). A background task
steps while any request is unfinished and sleeps otherwise. Each request gets a queue of
`RequestOutput`s; `generate` yields them until the one that finishes.

The loop hands the engine its next step as soon as one ends, before it hands that step's outputs
to their queues: the event loop's work overlaps the engine's, one step behind it.

A caller that stops iterating (client gone, task cancelled) aborts its request, so its pages and
state slot go back to the cache. A caller that iterates slowly holds back its request: once
`MAX_BUFFERED` outputs wait in its queue the engine pauses it (it computes nothing, keeping its slot
and pages), and resumes it when the caller has taken all but `RESUME_BUFFERED`; so a reader that
never reads costs a bounded queue, and the device's time goes to the others. A request the engine
failed alone (finish_reason "error") gets `EngineError` with the reason; an unexpected fault of a
whole step fails the requests in flight the same way (logged once), and the loop goes on serving new
requests. An engine that broke (`EngineBroken`: a tensor-parallel rank lost) fails its requests with
`EngineBroken`, refuses new ones, and `check_health` raises. A request id already in flight is
refused before anything is touched.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from cairn.cache_service.events import EventBatch
from cairn.workers.cache.transfer import FetchPlan, ResumeExport
from cairn.workers.engine import Engine
from cairn.workers.engine_errors import EngineBroken, EngineError, RequestRejected
from cairn.workers.engine_metrics import EngineMetrics
from cairn.workers.engine_options import EngineOptions
from cairn.workers.output import RequestOutput
from cairn.workers.sampling_params import SamplingParams
from cairn.workers.request import ExportRequest, GenerateRequest
from cairn.workers.spec import EngineSpec

log = logging.getLogger(__name__)

# pulls a held request's resume point from the holder its hint names (cairn.cluster.replica_peer_fetch):
# the export, or why there is none (a fallback reason), or None when nothing was asked
Fetcher = Callable[[GenerateRequest, FetchPlan], Awaitable[ResumeExport | str | None]]


class EngineFront:
    MAX_BUFFERED, RESUME_BUFFERED = 32, 8  # outputs waiting in a request's queue: pause at, resume at

    def __init__(self, engine: Engine, executor: ThreadPoolExecutor | None = None):
        self.engine = engine
        # the engine's fixed facts, read without a call onto its thread
        self.spec: EngineSpec = engine.spec
        self.worker_id: str = engine.worker_id
        self.max_num_seqs: int = engine.options.max_num_seqs
        self._executor = executor or ThreadPoolExecutor(max_workers=1, thread_name_prefix="cairn-engine")
        self._queues: dict[str, asyncio.Queue] = {}
        self._paused: set[str] = set()
        self._wake: asyncio.Event | None = None
        self._loop_task: asyncio.Task | None = None
        self._ids = itertools.count()

    @classmethod
    def from_pretrained(cls, model_dir: str | Path, options: EngineOptions | None = None,
                        **kwargs: object) -> "EngineFront":
        """`Engine.from_pretrained(model_dir, options, **kwargs)`, loaded on the thread that will
        step it (see the module doc)."""
        executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="cairn-engine")
        try:
            engine = executor.submit(functools.partial(Engine.from_pretrained, model_dir, options, **kwargs)).result()
        except BaseException:
            executor.shutdown(wait=False)
            raise
        return cls(engine, executor)


    async def _call(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    def _submit_step(self) -> asyncio.Future:
        """A step, started on the engine thread now (not when awaited)."""
        return asyncio.get_running_loop().run_in_executor(self._executor, self.engine.step)

    def _ensure_loop(self) -> None:
        if self._loop_task is None or self._loop_task.done():
            self._wake = asyncio.Event()
            loop, wake = asyncio.get_running_loop(), self._wake
            self.engine.on_runnable = lambda: loop.call_soon_threadsafe(wake.set)  # a grammar compiled
            self._loop_task = loop.create_task(self._run())

    def generate(self, prompt_token_ids: list[int], params: SamplingParams | None = None,
                 request_id: str | None = None, *, hash_root: bytes | None = None,
                 page_hashes: list[bytes] | None = None, checkpoint_hints: list[int] | None = None,
                 tenant: str | None = None) -> AsyncIterator[RequestOutput]:
        """`stream` of a `GenerateRequest` built from these fields (an id made up when None)."""
        request_id = request_id if request_id is not None else f"async-{next(self._ids)}"
        return self.stream(GenerateRequest(request_id, list(prompt_token_ids), params or SamplingParams(),
                                           hash_root=hash_root, page_hashes=page_hashes,
                                           checkpoint_hints=list(checkpoint_hints or ()), tenant=tenant))

    async def stream(self, request: GenerateRequest, fetcher: Fetcher | None = None) -> AsyncIterator[RequestOutput]:
        """Streams outputs of one request; raises `RequestRejected` at once for a request the
        engine refuses (`Engine.add`). With a `fetcher` and a fetch hint the engine takes up
        (`Engine.add` returns a plan), the request waits in the engine while the fetcher pulls
        the holder's export, which is delivered to the engine's thread with the request's next
        step (`Engine.deliver_fetch`): one crossing for the request, none for the fetch."""
        self._ensure_loop()
        request_id = request.request_id
        if request_id in self._queues:  # refused before anything is touched: the running one goes on
            raise RequestRejected(f"request_id {request_id!r} is already in use", "request_id")
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[request_id] = queue
        try:
            plan = await self._call(self.engine.add, request, fetcher is not None)
        except BaseException:
            self._queues.pop(request_id, None)
            raise
        finished = False
        try:  # from here on, a caller that goes away (cancelled) aborts the request: `finally`
            if plan is not None:
                try:
                    export = await fetcher(request, plan)
                except Exception as e:  # a fetcher's fault: the request recomputes
                    log.warning("fetching %s's resume point failed: %r", request_id, e)
                    export = "holder_failed"
                self.engine.deliver_fetch(request_id, export)
            self._wake.set()
            while True:
                item = await queue.get()
                if request_id in self._paused and queue.qsize() <= self.RESUME_BUFFERED:
                    self._paused.discard(request_id)
                    await self._call(self.engine.pause, request_id, False)
                    self._wake.set()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            self._queues.pop(request_id, None)
            self._paused.discard(request_id)
            if not finished:
                await asyncio.shield(self._call(self.engine.abort, request_id))

    async def metrics(self) -> EngineMetrics:
        """`Engine.metrics()`, read on the engine thread (never mid-step)."""
        return await self._call(self.engine.metrics)

    async def drain_events(self) -> EventBatch | None:
        """`Engine.drain_events()`, on the engine thread."""
        return await self._call(self.engine.drain_events)

    async def snapshot_events(self) -> EventBatch:
        """`Engine.snapshot_events()`, on the engine thread."""
        return await self._call(self.engine.snapshot_events)

    async def cache_contents(self) -> tuple[frozenset[bytes], frozenset[bytes]]:
        """`Engine.cache_contents()`, on the engine thread."""
        return await self._call(self.engine.cache_contents)

    async def export_resume(self, ask: ExportRequest) -> ResumeExport | None:
        """`EnginePeerFetch.export` for a peer's ask, on the engine thread, between steps."""
        return await self._call(self.engine.fetches.export, ask.page_hashes, ask.first, ask.depth, tuple(ask.tail),
                                ask.root, tuple(ask.before))

    async def call(self, fn, *args):
        """Runs `fn(engine, *args)` on the engine thread, between steps (tests, admin)."""
        return await self._call(fn, self.engine, *args)

    async def abort(self, request_id: str) -> bool:
        """Ends a request; its stream yields a last output with finish_reason "abort"."""
        final = await self._call(self.engine.abort, request_id)
        queue = self._queues.get(request_id)
        if final is not None and queue is not None:
            queue.put_nowait(final)
        return final is not None

    async def _run(self) -> None:
        pending: asyncio.Future | None = None  # the step the engine thread is running
        while True:
            if pending is None:
                if not self.engine.has_runnable():  # idle, or every request waits for its reader
                    self._wake.clear()
                    await self._wake.wait()
                    continue
                pending = self._submit_step()
            try:
                outputs = await pending
            except Exception as e:  # an engine fault must not kill the loop
                pending = None
                log.exception("engine step failed; failing %d request(s) in flight", len(self._queues))
                await self._fail_all(e)
                continue
            # The next step starts now, on the engine thread, while this one's outputs go out: the
            # loop's work (queues, and the streams' encoding and sends behind them) overlaps the
            # step instead of coming between two of them (a decode step of 16 streams spent about
            # a fifth of its time so). A pause or an abort decided below lands after that step.
            pending = self._submit_step() if self.engine.has_runnable() else None
            behind = []
            for out in outputs:
                queue = self._queues.get(out.request_id)
                if queue is not None:
                    queue.put_nowait(out if out.finish_reason != "error" else
                                     EngineError(f"internal error while running request {out.request_id}: {out.error}"))
                    if not out.finished and queue.qsize() >= self.MAX_BUFFERED and out.request_id not in self._paused:
                        behind.append(out.request_id)
            for request_id in behind:  # its reader is behind: computing more would only queue it
                self._paused.add(request_id)
                await self._call(self.engine.pause, request_id)
            await asyncio.sleep(0)  # let consumers run between steps

    async def _fail_all(self, cause: Exception) -> None:
        for request_id, queue in list(self._queues.items()):
            await self._call(self.engine.abort, request_id)
            if isinstance(cause, EngineBroken):  # says so, so that the API answers "retry"
                queue.put_nowait(EngineBroken(f"request {request_id} was lost with its engine: {cause}"))
            else:
                queue.put_nowait(EngineError(f"internal error while running request {request_id}: "
                                             f"{type(cause).__name__}"))

    def check_health(self) -> None:
        """Raises `EngineBroken` once the engine can run nothing more (Serve's health check)."""
        if self.engine.broken is not None:
            raise EngineBroken(self.engine.broken)

    async def close(self) -> None:
        if self._loop_task is not None:
            self._loop_task.cancel()
            try:
                await self._loop_task
            except asyncio.CancelledError:
                pass
        self._executor.shutdown(wait=True)
        self.engine.close()
