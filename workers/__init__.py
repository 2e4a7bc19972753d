"""One inference engine per device: model, page and state pools, scheduler, runner, sampler.

Public surface: `Engine` (synchronous, batch `generate`), `AsyncEngine` (streams tokens per
request, abortable), `EngineSpec` (the facts a deployment shares), `SamplingParams`,
`RequestOutput` and `TokenLogprob`, the errors `RequestRejected` and `EngineError`,
`ModelSource` (a checkpoint directory or a Hugging Face id) and `demo_model_dir`. No Ray here.

Imported lazily (PEP 562): `from workers import Engine` loads the engine, and with it torch, but
importing a plain module (`workers.spec`, `workers.sampling_params`) loads only that module, so
code that makes plans and routes (`cluster.routing`, the ingress's request models) stays free of
torch.
"""

from __future__ import annotations

from workers.lazy import lazy_exports

_WHERE = {
    "AsyncEngine": "workers.async_engine", "demo_model_dir": "workers.demo", "Engine": "workers.engine",
    "RequestOutput": "workers.output", "EngineError": "workers.errors", "RequestRejected": "workers.errors",
    "ModelNotFound": "workers.model_source", "ModelSource": "workers.model_source",
    "EngineOptions": "workers.options", "MAX_SEED": "workers.sampling_params",
    "SamplingParams": "workers.sampling_params", "TokenLogprob": "workers.sequence", "EngineSpec": "workers.spec",
}
__all__ = sorted(_WHERE)


__getattr__, __dir__ = lazy_exports(__name__, _WHERE)
