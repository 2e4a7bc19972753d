"""Fetching a resume point from the replica that holds it (routing config `fetch`).

The router names, on each request it routes, the replica resuming it deepest and how deep
(`GenerateRequest.fetch_from`: a hint, whichever replica takes the request). A receiving replica
that resumes less deep (`workers.cache.transfer.plan_fetch`) pulls what it lacks before the
request enters its engine:
- the ask is an `ExportRequest` through the engine deployment's own handle, which the router
  sends to exactly the replica it names (`target_worker`); the holder copies the pages and the
  checkpoint between two of its steps (`Engine.export_resume`: one request's resume point, a
  bounded pause) and the reply crosses Ray's object store;
- the receiver adopts them (`Engine.import_resume`) under the request's own hashes, so a fetch
  never crosses a cache salt, and its events tell the index;
- whatever goes wrong (the holder evicted them meanwhile, died, is gone, or does not answer within
  `fetch_timeout_s`), the request is recomputed as if there had been no hint: never lost, never
  run twice. Each such fallback is counted by reason (`fetch_fallbacks_total{kind=...}`:
  evicted, timeout, holder_failed here; refused, no_checkpoint_slot by `Engine.import_resume`).
Under tensor parallelism nothing is fetched (`plan_fetch` says so): each rank would need its own
slice from the holder's same rank.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)


@dataclass
class ExportRequest:
    """Pages [first, depth) of a prompt's chain and the checkpoint at `depth`, asked of the
    replica `target_worker` (the router routes it there and nowhere else)."""
    target_worker: str
    page_hashes: list[bytes]
    first: int
    depth: int


class PeerFetch:
    def __init__(self, worker_id: str, engine: Any, timeout_s: float):
        """engine: the replica's `AsyncEngine`."""
        self.worker_id, self.engine, self.timeout_s = worker_id, engine, timeout_s
        self._handle = None

    def _peers(self):
        if self._handle is None:
            from ray import serve

            ctx = serve.get_replica_context()
            self._handle = serve.get_deployment_handle(ctx.deployment, ctx.app_name)
        return self._handle

    async def before(self, request: Any) -> None:
        """Pulls what `request.fetch_from` names, if this replica lacks it (module doc)."""
        hint, hashes = getattr(request, "fetch_from", None), request.page_hashes
        if not hint or not hashes or hint[0] == self.worker_id:
            return
        holder, depth = hint
        n = len(request.prompt_token_ids)
        plan = await self.engine.call(lambda engine: engine.fetch_plan(hashes, n, depth))
        if plan is None:
            return
        ask = ExportRequest(holder, hashes, plan.first, plan.depth)
        try:
            export = await asyncio.wait_for(self._peers().export_resume.remote(ask), self.timeout_s)
        except asyncio.TimeoutError:
            return await self._fell_back("timeout")
        except Exception as e:  # the holder died, is gone, or failed
            log.info("fetching from %s failed: %r", holder, e)
            return await self._fell_back("holder_failed")
        if export is None:
            return await self._fell_back("evicted")
        await self.engine.call(lambda engine: engine.import_resume(export, hashes, plan.first))  # counts a refusal

    async def _fell_back(self, reason: str) -> None:
        await self.engine.call(lambda engine: engine.count_fetch_fallback(reason))

    async def export(self, ask: ExportRequest):
        """The holder's side: a copy of what `ask` names, or None (gone, or asked of another
        replica)."""
        if ask.target_worker != self.worker_id:
            return None
        return await self.engine.call(lambda engine: engine.export_resume(ask.page_hashes, ask.first, ask.depth))
