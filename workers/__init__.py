"""One inference engine per device: model, page and state pools, scheduler, runner, sampler.

Public surface: `Engine` (synchronous, batch `generate`), `AsyncEngine` (streams tokens per
request, abortable), `EngineSpec` (the facts a deployment shares), `SamplingParams`,
`RequestOutput` and `TokenLogprob`, the errors `RequestRejected` and `EngineError`,
`ModelSource` (a checkpoint directory or a Hugging Face id) and `demo_model_dir`. No Ray here.
"""

from workers.async_engine import AsyncEngine
from workers.demo import demo_model_dir
from workers.engine import Engine, RequestOutput
from workers.errors import EngineError, RequestRejected
from workers.model_source import ModelNotFound, ModelSource
from workers.options import EngineOptions
from workers.sampling_params import MAX_SEED, SamplingParams
from workers.sequence import TokenLogprob
from workers.spec import EngineSpec

__all__ = ["MAX_SEED", "AsyncEngine", "Engine", "EngineError", "EngineOptions", "EngineSpec", "ModelNotFound",
           "ModelSource", "RequestOutput", "RequestRejected", "SamplingParams", "TokenLogprob", "demo_model_dir"]
