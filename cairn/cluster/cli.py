"""The `cairn` command line.

Contract: `main(argv)` parses `argv` (default `sys.argv[1:]`), runs one subcommand and returns
its exit status (0 on success; argparse exits with 2 on bad usage). Each subcommand imports
what it needs inside its own function, so `cairn --help` and `cairn demo-model` never import
Ray or the engine. Output meant for scripts goes to stdout, one value per line.

Subcommands:
- `demo-model OUT_DIR [--arch qwen3_next|qwen3_5|qwen3_5_moe] [--size tiny|bench] [--seed N]
  [--mtp random|trained] [--vision]` — write a random-weight checkpoint (see `cairn.workers.demo`),
  with an MTP head if asked (trained: `cairn.workers.demo.speculative_training`), vision-language
  with a random tower if asked (Qwen3.5 only), and print the directory.
- `generate [--model DIR|ID] --prompt TEXT [--chat] [--max-tokens N] [--temperature T]` — load
  the checkpoint (default: the tiny demo model) into an in-process engine, print a completion
  (greedy unless --temperature says otherwise, unlike the API: see its --help).
- `serve [--model DIR|ID] [--replicas N] [--address A] [--config YAML] [--routing YAML] ...` —
  Ray Serve replicas behind the HTTP API (see `cairn.cluster.deploy`): deploys --config, default
  cairn/configs/local.yaml, with the flags given written over it; `--replicas 1` alone runs one
  in-process engine. Its engine flags (`--max-num-seqs`, `--cache-memory-bytes`, ...) become one
  `EngineOptions` once: here for the in-process engine (a bad value: status 2, naming the
  option, before anything loads), else where the app is built from the config they are written
  into (`cairn.cluster.app.app_builder`).

`--model` takes a checkpoint directory or a Hugging Face id, `org/name[@revision]`
(`cairn.workers.model_source`): one that resolves to nothing is refused before anything is loaded or
Ray is started, with status 2 and a message naming the id and the cache looked in.
"""

import argparse
import sys
from collections.abc import Callable, Sequence

TOOL_CALL_PARSERS = ("auto", "qwen3_json", "qwen3_xml", "none")  # cairn.cluster.api.tool_call_formats' (not imported here)
GENERATE_TEMPERATURE = 0.0  # `cairn generate`'s: greedy, so a debugging run is reproducible
SAMPLING_SHOWN = ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                  "repetition_penalty")  # the defaults `serve --help` states


def _api_default(name: str) -> str:
    """The API's default for the sampling field `name`: `SamplingParams`' (a plain module, no engine)."""
    from cairn.workers.sampling_params import DEFAULTS

    return f"{DEFAULTS[name]:g}"


def _add_demo_model(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "demo-model", help="write a random-weight hybrid checkpoint in Hugging Face layout",
        description="Write a random-weight checkpoint of a supported architecture (config, "
                    "safetensors, tokenizer with chat template, generation config) into OUT_DIR.",
    )
    parser.add_argument("out_dir", metavar="OUT_DIR",
                        help="directory to write (created if missing)")
    parser.add_argument("--size", choices=("tiny", "bench"), default="tiny",
                        help="tiny: for tests (~0.25M params); bench: for CPU benchmarks (~31M)")
    parser.add_argument("--arch", choices=("qwen3_next", "qwen3_5", "qwen3_5_moe"), default="qwen3_next",
                        help="qwen3_next: Qwen3-Next; qwen3_5: Qwen3.5/3.6 dense; qwen3_5_moe: Qwen3.5/3.6 MoE")
    parser.add_argument("--seed", type=int, default=0, help="weight seed (same seed, same bytes)")
    parser.add_argument("--mtp", choices=("random", "trained"), default=None,
                        help="with an MTP head (mtp.* tensors) for speculative decoding (serve --speculative-tokens): "
                             "random weights, or trained on CPU in minutes (the model trained a little on the demo "
                             "corpus, the head to its distribution over its greedy continuations, so drafts are "
                             "kept at a realistic rate)")
    parser.add_argument("--vision", action="store_true",
                        help="a vision-language checkpoint (qwen3_5 / qwen3_5_moe): the published layout with a "
                             "random vision tower, the vision tokens and preprocessor_config.json")
    parser.set_defaults(run=_demo_model)


def _demo_model(args: argparse.Namespace) -> int:
    from cairn.workers.demo import write_demo_model

    if args.vision and args.arch == "qwen3_next":
        print("cairn demo-model: --vision needs --arch qwen3_5 or qwen3_5_moe (Qwen3-Next has no vision tower)",
              file=sys.stderr)
        return 2
    out = write_demo_model(args.out_dir, size=args.size, seed=args.seed, arch=args.arch, mtp=args.mtp == "random",
                           vision=args.vision)
    if args.mtp == "trained":
        from cairn.workers.demo.speculative_training import train_for_speculation

        accuracy = train_for_speculation(out, seed=args.seed, log=lambda line: print(line, file=sys.stderr))
        print(f"the MTP head's first draft matches the target on {accuracy:.0%} of held-out continuations",
              file=sys.stderr)
    print(out)
    return 0


DTYPE_CHOICES = ("auto", "bfloat16", "float32", "float16")  # cairn.workers.precision's, without importing workers
DTYPE_HELP = ("weights and activations (auto: the checkpoint's dtype on CUDA; on CPU, bfloat16 where the "
              "processor computes it natively (AVX512-BF16, AMX), else float32)")


def _add_generate(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "generate", help="print one completion from the engine (a debugging aid)",
        description="Load a checkpoint into the engine in this process and print one completion.")
    parser.add_argument("--model", help="checkpoint directory or Hugging Face id, org/name[@revision] (default: "
                                        "the tiny demo model, written to $CAIRN_HOME on first use)")
    parser.add_argument("--prompt", required=True, help="prompt text")
    parser.add_argument("--chat", action="store_true",
                        help="send the prompt as one user message through the model's chat template")
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens to generate at most (default: 64)")
    parser.add_argument("--temperature", type=float, default=GENERATE_TEMPERATURE,
                        help=f"in [0, 2] (default: {GENERATE_TEMPERATURE:g}, greedy, so a debugging run is "
                             f"reproducible; the API's default is {_api_default('temperature')})")
    parser.add_argument("--seed", type=int, default=None, help="makes a sampled run reproducible")
    parser.add_argument("--dtype", default="auto", choices=DTYPE_CHOICES,
                        help=DTYPE_HELP)
    parser.set_defaults(run=_generate)


def _generate(args: argparse.Namespace) -> int:
    from tokenizers import Tokenizer

    from cairn.workers import Engine, EngineOptions, ModelSource, SamplingParams, demo_model_dir

    try:
        model_dir = ModelSource.parse(args.model).local_dir() if args.model else demo_model_dir("tiny")
    except (OSError, ValueError) as e:
        print(f"cairn generate: {e}", file=sys.stderr)
        return 2
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    text = args.prompt
    if args.chat:
        from cairn.cluster.api.chat_template import ChatTemplate

        text = ChatTemplate.from_dir(model_dir).render([{"role": "user", "content": args.prompt}])
    engine = Engine.from_pretrained(model_dir, EngineOptions(dtype=args.dtype))
    try:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed)
        out = engine.generate([tokenizer.encode(text, add_special_tokens=False).ids], params)[0]
    except ValueError as e:
        print(f"cairn generate: {e}", file=sys.stderr)
        return 2
    print(tokenizer.decode(out.token_ids, skip_special_tokens=False))
    return 0


def _add_serve(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "serve", help="serve the OpenAI-compatible HTTP API (Ray Serve replicas, cache-affinity routing)",
        description="Start (or join, with --address) Ray, deploy the engine replicas and the HTTP "
                    "ingress, print the endpoint, serve until Ctrl-C. What is deployed is the Serve "
                    "config --config (default: cairn/configs/local.yaml, 2 CPU replicas of the demo model "
                    "on 127.0.0.1:8000); the flags given override it. --replicas 1 without "
                    "--address/--config runs one engine in this process instead (debugging). A request "
                    "that leaves a sampling field out (or null) gets its default: "
                    + ", ".join(f"{name} {_api_default(name)}" for name in SAMPLING_SHOWN) + ".")
    parser.add_argument("--model", help="checkpoint directory or Hugging Face id, org/name[@revision], resolved on "
                                        "every node (default: the config's; local.yaml: the tiny demo model)")
    parser.add_argument("--replicas", type=int, default=None, help="engine replicas (local.yaml: 2)")
    parser.add_argument("--address", default=None, help="join this Ray cluster (e.g. auto) instead of starting one")
    parser.add_argument("--config", default=None, help="a Serve config YAML (cairn/configs/serve.yaml); "
                                                       "default: cairn/configs/local.yaml")
    parser.add_argument("--routing", default=None, help="routing YAML (cairn/configs/routing.yaml)")
    parser.add_argument("--host", default=None, help="HTTP host (local.yaml: 127.0.0.1)")
    parser.add_argument("--port", type=int, default=None, help="HTTP port (local.yaml: 8000)")
    parser.add_argument("--api-key", action="append", default=None, metavar="[TENANT:]KEY",
                        help="require 'Authorization: Bearer KEY' on /v1, /metrics and /openapi.json; "
                             "repeat for more tenants; a bare KEY is a tenant of its own, named key-<hash> "
                             "(default: $CAIRN_API_KEY, the tenant 'default', else none)")
    parser.add_argument("--api-keys-file", default=None, metavar="PATH",
                        help="a file of 'TENANT:KEY [NAME=VALUE ...]' lines, the values that tenant's limits "
                             "(as --tenant-limit); # comments; on a cluster it must exist on the ingress's node")
    parser.add_argument("--tenant-limit", action="append", default=None, metavar="NAME=VALUE",
                        help="every tenant's quota of cairn.cluster.api.quotas.TenantLimits (with keys only), e.g. "
                             "max_requests=64, requests_per_minute=600, tokens_per_minute=200000; repeat for more")
    parser.add_argument("--metrics-key", default=None, help="the only key that opens /metrics (default: any "
                                                            "tenant's key)")
    parser.add_argument("--shared-cache-tenants", action="store_true", default=None,
                        help="let all tenants share cached pages (default: each tenant its own)")
    parser.add_argument("--public-system-prompt", action="append", default=None, metavar="FILE",
                        help="a file holding a system prompt whose pages every tenant shares when a chat "
                             "opens with it (repeat for more)")
    parser.add_argument("--image-url-allow", action="append", default=None, metavar="PREFIX",
                        help="a URL prefix (http(s)://host/path/ or file:///dir/) image_url parts may name besides "
                             "data: URLs (repeat for more; none by default)")
    parser.add_argument("--max-header-bytes", type=int, default=None, help="request line and headers (32768)")
    parser.add_argument("--header-timeout", type=float, default=None, metavar="S",
                        help="seconds to send a request's headers (10; in-process only: Serve's proxy has none)")
    parser.add_argument("--body-timeout", type=float, default=None, metavar="S",
                        help="seconds to send a request's body (60)")
    parser.add_argument("--stream-stall-timeout", type=float, default=None, metavar="S",
                        help="seconds a streamed response waits for its client to read before it is ended and its "
                             "sequences freed (30; in-process only)")
    parser.add_argument("--keep-alive-timeout", type=float, default=None, metavar="S",
                        help="seconds an idle connection stays open (in-process: 5; Serve: http_options)")
    parser.add_argument("--request-timeout", type=float, default=None, metavar="S",
                        help="end-to-end limit per request, from its arrival to its last token (a 408); on Ray, "
                             "Serve's http_options.request_timeout_s, which the ingress enforces too, so a client's "
                             "x-request-timeout-seconds header cannot lift it")
    parser.add_argument("--max-body-bytes", type=int, default=None, help="request body (8 MiB)")
    parser.add_argument("--api-limit", action="append", default=None, metavar="NAME=VALUE",
                        help="a per-request limit of cairn.cluster.api.limits.APILimits, e.g. max_messages=512; "
                             "repeat for more")
    parser.add_argument("--special-tokens-in-content", action="store_true", default=None,
                        help="let special-token strings typed in messages become control tokens (off: "
                             "they are text)")
    parser.add_argument("--tool-call-parser", default=None, choices=TOOL_CALL_PARSERS,
                        help="how the model writes tool calls: auto (read from its chat template), qwen3_json "
                             "(Qwen3, Qwen3-Next), qwen3_xml (Qwen3.5, Qwen3-Coder), none (return them as text)")
    parser.add_argument("--served-model-name", default=None,
                        help="model id clients send (default: the Hugging Face id, or the folder's name)")
    parser.add_argument("--num-cpus", type=float, default=None, help="CPUs per engine replica (local.yaml: 0.5)")
    parser.add_argument("--num-gpus", type=float, default=None, help="GPUs per engine replica (1 on GPU nodes)")
    parser.add_argument("--max-num-seqs", type=int, default=None, help="sequences an engine runs at once (64)")
    parser.add_argument("--cache-memory-bytes", type=int, default=None)
    parser.add_argument("--cache-policy", default=None, help="cairn | exact | all | interval | end_branch")
    parser.add_argument("--memory-utilization", type=float, default=None, metavar="F",
                        help="CUDA: size the cache from what each GPU has left after the weights, up to this "
                             "fraction of its memory (instead of --cache-memory-bytes)")
    parser.add_argument("--host-cache-bytes", type=int, default=None, metavar="BYTES",
                        help="host tier per replica: what the device cache evicts is kept in host memory (pinned "
                             "on CUDA) up to this many bytes, and brought back when cheaper than recomputing (0: off)")
    parser.add_argument("--dtype", default=None, choices=DTYPE_CHOICES,
                        help=DTYPE_HELP)
    parser.add_argument("--tensor-parallel-size", type=int, default=None, metavar="N",
                        help="devices one engine replica spans (1); a replica is then N bundles of --num-cpus and "
                             "--num-gpus on one node")
    parser.add_argument("--enforce-eager", action="store_true", default=None,
                        help="CUDA: run decode steps eagerly instead of replaying CUDA graphs captured at batch "
                             "sizes 1, 2, 4, 8, 16, ... --max-num-seqs (graphs are the default on CUDA; CPU is "
                             "always eager)")
    parser.add_argument("--speculative-tokens", type=int, default=None, metavar="K", dest="num_speculative_tokens",
                        help="speculative decoding: the checkpoint's MTP head drafts K tokens (1-4) after each "
                             "sequence's last, and one step verifies them (outputs unchanged; off by default)")
    parser.add_argument("--speculative-max-seqs", type=int, default=None, metavar="N", dest="speculative_max_num_seqs",
                        help="speculative decoding: a step verifies at most N x K drafted tokens (default N: "
                             "--max-num-seqs), each holding a copy of its sequence's recurrent state, so N x K states "
                             "of memory are set aside")
    parser.add_argument("--async-scheduling", action="store_true", default=None,
                        help="plan and launch each decode step before the last one's tokens are read back, so the "
                             "host's work hides behind the device's (one device per replica; outputs unchanged; "
                             "off by default until timed on a GPU)")
    parser.set_defaults(run=_serve)


def _serve(args: argparse.Namespace) -> int:
    if args.replicas == 1 and not args.address and not args.config:
        from dataclasses import replace

        from cairn.cluster.api.api_options import APIOptions
        from cairn.cluster.api.http_limits import HTTPLimits
        from cairn.cluster.api.limits import APILimits
        from cairn.cluster.api.quotas import TenantLimits
        from cairn.cluster.api.server import serve_in_process
        from cairn.cluster.api.tenants import Tenants
        from cairn.cluster.deploy import (api_limit_flags, engine_option_flags, http_limit_flags,
                                          public_prompt_flags, tenant_limit_flags)
        from cairn.workers import ModelSource
        from cairn.workers.engine_options import SERVED

        try:
            engine_options = replace(SERVED, **engine_option_flags(args))  # checked here, compiled before serving
            tenants = Tenants.load(args.api_key, args.api_keys_file)
            options = APIOptions(
                served_model_name=args.served_model_name,
                http_limits=HTTPLimits(**http_limit_flags(args, in_process=True)),
                api_limits=APILimits(**api_limit_flags(args)), tenant_limits=TenantLimits(**tenant_limit_flags(args)),
                shared_cache_tenants=bool(args.shared_cache_tenants),
                special_tokens_in_content=bool(args.special_tokens_in_content),
                public_system_prompts=tuple(public_prompt_flags(args)),
                image_url_allow=tuple(args.image_url_allow or ()),
                tool_call_parser=args.tool_call_parser or "auto", request_timeout_s=args.request_timeout,
                **({"max_body_bytes": args.max_body_bytes} if args.max_body_bytes else {}))
            model = None
            if args.model:  # resolved now, so an id that resolves to nothing fails before the engine loads
                source = ModelSource.parse(args.model)
                model = str(source.pinned(source.local_dir()))
        except (OSError, ValueError) as e:
            print(f"cairn serve: {e}", file=sys.stderr)
            return 2
        host, port = args.host or "127.0.0.1", args.port or 8000
        print(f"cairn: one in-process engine on http://{host}:{port}/v1 (Ctrl-C to stop)", flush=True)
        serve_in_process(model, options, host=host, port=port, tenants=tenants, metrics_key=args.metrics_key,
                         engine_options=engine_options)
        return 0
    from cairn.cluster.deploy import serve_forever

    return serve_forever(args)


COMMANDS: tuple[Callable[[argparse._SubParsersAction], None], ...] = (_add_demo_model, _add_generate, _add_serve)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="cairn",
        description="Serve hybrid LLMs with prefix caching that survives chat templates.",
    )
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add in COMMANDS:
        add(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
