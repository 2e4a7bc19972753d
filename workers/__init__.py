"""One inference engine per device: model, page and state pools, scheduler, runner, sampler.

Public surface: `Engine` (synchronous, batch `generate`), `AsyncEngine` (streams tokens per
request, abortable), `SamplingParams`, `RequestOutput`. No Ray here.
"""

from workers.async_engine import AsyncEngine, EngineError
from workers.engine import Engine, RequestOutput
from workers.sampling_params import SamplingParams

__all__ = ["AsyncEngine", "Engine", "EngineError", "RequestOutput", "SamplingParams"]
