"""A replica's side of peer fetch: fetching a resume point from the replica that holds it (routing
config `fetch`).

The router names, beside its choice, the replica resuming a request deepest and how deep (a
`cairn.workers.request.FetchHint`, sent as the request's `fetch`: a hint, whichever replica takes the
request). A receiving replica hands the request to its engine with this `ReplicaPeerFetch` as the
fetcher (`EngineFront.stream`): if it resumes less deep (`cairn.workers.cache.transfer.plan_fetch`),
the engine holds the request and returns what to ask for, and `ReplicaPeerFetch` pulls it:
- the ask is an `ExportRequest` through the engine deployment's own handle, which the router
  sends to exactly the replica it names (`target_worker`; once Serve has dropped that replica, to
  another one, which answers that it holds nothing, so the ask never waits for a replica that
  will not come back); the holder copies the pages and the
  checkpoint between two of its steps (`EngineFront.export_resume`: one request's resume
  point, a bounded pause) and the reply crosses Ray's object store;
- the export is delivered to the receiving engine, which adopts it under the request's own
  hashes before the request's first step (so a fetch never crosses a cache salt) and whose
  events tell the index;
- whatever goes wrong (the holder evicted them meanwhile, died, is gone, or does not answer within
  `fetch_timeout_s`, not waiting for the call's cancellation either), the request is recomputed
  as if there had been no hint: never lost, never run twice. Each such fallback is counted by
  reason (`fetch_fallbacks_total{kind=...}`: evicted, timeout, holder_failed here; refused,
  no_checkpoint_slot by `cairn.workers.engine_peer_fetch.EnginePeerFetch.import_`).
Under tensor parallelism nothing is fetched (the engine plans nothing): each rank would need its
own slice from the holder's same rank.
"""

from __future__ import annotations

import asyncio
import logging

from cairn.workers import EngineFront
from cairn.workers.cache.transfer import FetchPlan, ResumeExport
from cairn.workers.request import ExportRequest, GenerateRequest

log = logging.getLogger(__name__)


class ReplicaPeerFetch:
    def __init__(self, worker_id: str, engine: EngineFront, timeout_s: float):
        self.worker_id, self.engine, self.timeout_s = worker_id, engine, timeout_s
        self._handle = None

    def _peers(self):
        if self._handle is None:
            from ray import serve

            ctx = serve.get_replica_context()
            self._handle = serve.get_deployment_handle(ctx.deployment, ctx.app_name)
        return self._handle

    async def __call__(self, request: GenerateRequest, plan: FetchPlan) -> ResumeExport | str:
        """The receiver's side: the export of what `plan` asks of the holder the request's hint
        names, or the reason there is none (module doc)."""
        holder = request.fetch.holder
        ask = ExportRequest(holder, list(request.page_hashes), plan.first, plan.depth, plan.tail, plan.root,
                            plan.before)
        asked = asyncio.ensure_future(self._peers().export_resume.remote(ask))
        done, _ = await asyncio.wait({asked}, timeout=self.timeout_s)
        if not done:  # not waiting for the cancellation either: a call to a dead node's actor may take
            asked.cancel()  # as long as Ray's detection of its death to give up
            return "timeout"
        try:
            export = asked.result()
        except Exception as e:  # the holder died, is gone, or failed
            log.info("fetching from %s failed: %r", holder, e)
            return "holder_failed"
        return "evicted" if export is None else export

    async def export(self, ask: ExportRequest) -> ResumeExport | None:
        """The holder's side: a copy of what `ask` names, or None (gone, or asked of another
        replica)."""
        if ask.target_worker != self.worker_id:
            return None
        return await self.engine.export_resume(ask)
