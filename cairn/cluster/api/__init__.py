"""The OpenAI-compatible HTTP API, without Ray: the same app serves one in-process engine
(`engine_client.LocalEngineClient`, `server.serve_in_process`) and is the Ray Serve ingress
(`cairn.cluster.app`), knowing engines only through `engine_client.EngineClient`.

Reading order: `routes` (build_app: the endpoints), `api_options` (`APIOptions`: everything the app
is told but the keys), `protocol` (request models) and `responses`
(response models), `serving` (what both generation endpoints share: prompts, sampling,
admission, running, counting), `reply` (what they share past that: the answer, streamed or
whole), `chat_completions` and `completions`, then the
pieces they use: `limits` (what one request may ask, checked while its body is parsed),
`prep_pool` (the threads that do the work before the engine), `prompts` (that work: `chat_template`,
`tokenizer`, `special_tokens`), `choice` (one choice's text, stop strings via `stop_strings`,
reasoning via `reasoning`, tool calls via `tool_calls` and `tool_call_formats`, logprobs),
`fanout` (n choices over several engine requests), `sse`, `api_errors`, `middleware`, `api_metrics`, `server`.
"""

from cairn.cluster.api.limits import APILimits
from cairn.cluster.api.api_options import DEFAULT_MAX_BODY_BYTES, DEFAULT_MAX_WAITING, APIOptions
from cairn.cluster.api.routes import build_app

__all__ = ["DEFAULT_MAX_BODY_BYTES", "DEFAULT_MAX_WAITING", "APILimits", "APIOptions", "build_app"]
