"""One inference engine per device: model, page and state pools, scheduler, runner, sampler.

Public surface: `Engine` (synchronous, batch `generate`), `EngineFront` (the asyncio front end: streams tokens per
request, abortable), `EngineSpec` (the facts a deployment shares), `SamplingParams`,
`RequestOutput` and `TokenLogprob`, `EngineOptions`, the errors `RequestRejected`
(`SamplingParamError`: a sampling field's), `EngineOptionError` (an engine option's) and
`EngineError`, `ModelSource` (a checkpoint directory or a Hugging Face id) and `demo_model_dir`.
No Ray here.

Imported lazily (PEP 562): `from cairn.workers import Engine` loads the engine, and with it torch, but
importing a plain module (`cairn.workers.spec`, `cairn.workers.sampling_params`) loads only that module, so
code that makes plans and routes (`cairn.cluster.routing`, the ingress's request models) stays free of
torch.
"""

from __future__ import annotations

from cairn.workers.lazy import lazy_exports

_WHERE = {
    "EngineFront": "cairn.workers.engine_front", "demo_model_dir": "cairn.workers.demo", "Engine": "cairn.workers.engine",
    "RequestOutput": "cairn.workers.output", "EngineError": "cairn.workers.engine_errors",
    "RequestRejected": "cairn.workers.engine_errors", "SamplingParamError": "cairn.workers.engine_errors",
    "ModelNotFound": "cairn.workers.model_source", "ModelSource": "cairn.workers.model_source",
    "EngineOptions": "cairn.workers.engine_options", "EngineOptionError": "cairn.workers.engine_options",
    "MAX_SEED": "cairn.workers.sampling_params", "SamplingParams": "cairn.workers.sampling_params",
    "TokenLogprob": "cairn.workers.sequence", "EngineSpec": "cairn.workers.spec",
}
__all__ = sorted(_WHERE)


__getattr__, __dir__ = lazy_exports(__name__, _WHERE)
