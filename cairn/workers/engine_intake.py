"""The engine's intake: requests in, held, paused and aborted (a mixin of `Engine`, which holds the
state it reads: `_requests`, `_held`, the scheduler, the cache, the sampler's grammars, the peer
fetches).

`add` checks a request (`cairn.workers.request_check`: one that can never fit, a prompt beyond
`max_model_len` or more pages than the arena holds beside a state, is refused with
`RequestRejected` there, never halfway through) and queues it, or holds it out of the scheduler
while its grammar compiles (in the background: a slow grammar stalls no other request) or its
resume point is fetched from a peer (`cairn.workers.engine_peer_fetch`); held requests join the
scheduler's queue at the start of the step after both are in (`_release_held`). `add_request` is
`add` from loose fields; `abort` ends a request and frees what it holds; `pause` stops computing a
request whose reader is behind, keeping its slot and pages.
"""

from __future__ import annotations

from cairn.workers.cache.transfer import FetchPlan, ResumeExport
from cairn.workers.engine_errors import EngineBroken, RequestRejected
from cairn.workers.output import RequestOutput
from cairn.workers.request import GenerateRequest
from cairn.workers.request_check import check, check_images
from cairn.workers.vision.image_encoder import ImageEncoder
from cairn.workers.vision.image_input import prompt_keys
from cairn.workers.vision.vision_config import load_vision_config
from cairn.workers.sampling_params import SamplingParams
from cairn.workers.sequence import Sequence, Status


class EngineIntake:
    def add_request(self, prompt_token_ids: list[int], params: SamplingParams | None = None,
                    request_id: str | None = None, *, hash_root: bytes | None = None,
                    page_hashes: list[bytes] | None = None, checkpoint_hints: list[int] | None = None,
                    tenant: str | None = None) -> str:
        """`add` of a `GenerateRequest` built from these fields (an id made up when None);
        returns the request id."""
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        self.add(GenerateRequest(request_id, list(prompt_token_ids), params or SamplingParams(),
                                 hash_root=hash_root, page_hashes=page_hashes,
                                 checkpoint_hints=list(checkpoint_hints or ()), tenant=tenant))
        return request_id

    def use_vision(self, model_dir) -> None:
        """Takes images with prompts where the checkpoint in `model_dir` has a vision tower: loads it
        (in the model's dtype, on its device) behind an `ImageEncoder` (under tensor parallelism,
        every rank its own: cairn.workers.execution.tp_runner.build_rank_runner). A model without interleaved M-RoPE
        refuses requests with images. Under speculative decoding, sequences with images do not
        draft (cairn.workers.speculative.verifier)."""
        self.vision = load_vision_config(model_dir)
        if self.vision is None:
            return
        encoder = ImageEncoder.load(model_dir, self.model)
        self.images_refused = None if encoder else "a model without interleaved M-RoPE"
        getattr(self.runner, "local", self.runner).encoder = encoder
        self.scheduler.merge_size = self.vision.spatial_merge_size

    def add(self, request: GenerateRequest, fetch: bool = False) -> FetchPlan | None:
        """Queues a request; raises `RequestRejected` naming the field at fault. Its `hash_root`
        (`spec.hash_root(cache_salt)`, default: no salt) roots its page hashes; `page_hashes`
        (from the ingress, under that root) save hashing here; `checkpoint_hints` are token
        positions (message starts) where a state checkpoint may pay off; `tenant` is who asked
        (None: one tenant for all), whom the scheduler shares sequence slots among.

        With `fetch` (the caller can pull from a peer) and a `request.fetch` hint naming another
        replica that resumes deeper than this one, returns what to ask the holder for
        (`cairn.workers.cache.transfer.FetchPlan`): the request is then held out of the scheduler
        until `deliver_fetch` brings the export (or the reason there is none)."""
        if self.broken is not None:
            raise EngineBroken(self.broken)
        params, request_id = request.params, request.request_id
        checked = check(request, self.spec, self.layout, self.sampler.grammars is not None)
        images = check_images(request.images, checked.prompt, self.vision, self.images_refused)
        if request_id in self._requests:
            raise RequestRejected(f"request_id {request_id!r} is already in use", "request_id")
        seq = Sequence(request_id, checked.prompt, params, hash_root=checked.hash_root, hints=checked.hints,
                       max_total_tokens=checked.total_tokens, tenant=request.tenant)
        if images is not None:
            seq.images, seq.rope = images
            seq.prompt_keys = prompt_keys(checked.prompt, seq.images, self.vision.spatial_merge_size)
        keys = seq.cache_tokens
        if request.page_hashes:
            self.cache.adopt_hashes(seq, request.page_hashes)
        self._requests[request_id] = seq
        hint, plan = request.fetch, None
        if fetch and hint is not None and hint.holder != self.worker_id and request.page_hashes:
            ps = self.spec.page_size
            tail = tuple(keys[hint.depth * ps:hint.depth * ps + hint.tail]) if hint.tail else ()
            before = tuple(keys[(hint.depth - 1) * ps:hint.depth * ps]) if hint.depth >= 2 else ()
            plan = self.fetches.plan(request.page_hashes, len(checked.prompt), hint.depth, tail, checked.hash_root,
                                     before)
        if plan is not None:  # held until the holder's export is delivered
            seq.fetch_pending = True
            self.fetches.hold(request_id, plan)
        compiled = None if params.grammar is None else self.sampler.grammars.prepare(params.grammar)
        if compiled is not None and not compiled.done():  # held back while its grammar compiles, in the
            seq.grammar_pending = True                       # background: a slow grammar stalls no other
            compiled.add_done_callback(lambda _: self._grammar_compiled(seq))
        if seq.grammar_pending or seq.fetch_pending:
            self._held.append(seq)
        else:
            self.scheduler.add(seq)
        self.stats.prompt_tokens += len(checked.prompt)
        return plan

    def deliver_fetch(self, request_id: str, export: ResumeExport | str | None) -> None:
        """What a peer fetch for a held request brought (`add`): the holder's export, or why
        there is none (a fallback reason: "timeout", "holder_failed", "evicted"; None: nothing
        was asked). Safe from any thread: it is adopted at the start of the next step, before
        the request is scheduled, so fetching and admitting cross to the engine's thread once."""
        self.fetches.deliver(request_id, export)
        if self.on_runnable is not None:
            self.on_runnable()

    def _grammar_compiled(self, seq: Sequence) -> None:
        """On the compiling thread: the sequence may be scheduled at the next step (a compile that
        failed faults it at its first sample); wakes whoever steps the engine (`on_runnable`)."""
        seq.grammar_pending = False
        if self.on_runnable is not None:
            self.on_runnable()

    def _release_held(self) -> None:
        """Held sequences whose grammars compiled and whose fetches arrived join the scheduler's queue."""
        for seq in [s for s in self._held if not (s.grammar_pending or s.fetch_pending)]:
            self._held.remove(seq)
            if seq.status is not Status.FINISHED:
                self.scheduler.add(seq)

    def abort(self, request_id: str) -> RequestOutput | None:
        """Ends a request and frees what it holds; returns its final output (None if unknown)."""
        seq = self._requests.pop(request_id, None)
        if seq is None:
            return None
        if seq in self._held:
            self._held.remove(seq)
            self.fetches.drop(request_id)
        self.scheduler.finish(seq, "abort")
        return RequestOutput.of(seq, [], [], self.worker_id)

    def pause(self, request_id: str, paused: bool = True) -> None:
        """Stops (or, with `paused` False, resumes) computing a request whose reader is behind:
        it keeps its slot and pages meanwhile. Unknown ids are ignored (it may have finished)."""
        seq = self._requests.get(request_id)
        if seq is not None:
            seq.paused = paused
