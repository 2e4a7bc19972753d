"""Multi-turn chats against each checkpoint policy: hit tokens vs the oracle, prefill work, TTFT.

Workloads, on the `bench` demo model (or `tiny` with --quick) of the architecture `--arch`
(qwen3_next, qwen3_5 or qwen3_5_moe: each with its own chat template), the model's own outputs
fed back as a client would:
- thinking-drop: thinking on; the client splits each answer into reasoning (first half) and
  content (second half); the demo template drops earlier turns' reasoning, so each new prompt
  rewrites history a few tokens before the previous prompt ended;
- echo: the client sends each turn back verbatim (token ids), as agent loops do;
- agent: tools in the system prompt, one user request, then rounds of the assistant's text with a
  tool call and the tool's result (traces.tool_round), each sent back as messages: the template
  renders the call after the model's text, so each prompt extends the previous one from where
  the model's answer turned into a call.
Conversations share a system prompt; all are open at once and advance turn by turn. The trace
(prompts, hints, output lengths) is recorded once per workload and replayed identically for every
policy: `exact` (today's exact-length behaviour), `all`, `interval`, `end_branch`, and `cairn`.

Each policy runs twice: with memory to spare, and under one shared budget (pages + states) sized
so that pages and checkpoints compete: the last round's sequences fit, plus 10% more pages and
two checkpoints per conversation. The oracle hit of a request (traces.Oracle, to the token) is
its longest common prefix with everything seen before it (earlier rounds' prompts and outputs,
this round's earlier prompts), capped at n - 1: unlimited memory and a state at every token.
Printed per policy: prefill tokens computed, hit tokens and their ratio to the oracle,
checkpoints stored, state memory peak, median TTFT per turn.
Writes benchmarks/out/multiturn.png (hit tokens per turn). Not a test: nothing is asserted.

The host tier (`--device-budget F --host-budget H`): the `cairn` policy with memory to spare
measures what the cache needs (its arena bytes once every round ran, nothing ever evicted); then
it runs with a device budget of F times that, without a host tier and with one of H times the
device budget (cairn.workers.cache.host_tier). Printed for each: hit tokens / oracle, tokens computed (prompt
tokens recomputed, preemptions' recomputation included, and decodes), the last turn's median
TTFT, and what moved between the tiers. Goal: >= 0.97 of the oracle with the tier.

Usage: python3 benchmarks/multiturn.py [--arch qwen3_5] [--convs 16] [--turns 6] [--quick]
                                      [--device-budget 0.25 --host-budget 4]
  --quick: the tiny demo model, 4 conversations, 3 turns, one thread: checks that the script runs.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's packages

import torch  # noqa: E402
from tokenizers import Tokenizer  # noqa: E402

from cairn.cluster.api.chat_template import ChatTemplate  # noqa: E402
from plotting import pyplot, save  # noqa: E402  (benchmarks/plotting.py)
from traces import AGENT_TOOLS, MULTITURN_WORDS, Oracle, sentence, tool_round  # noqa: E402  (benchmarks/traces.py)
from cairn.workers import Engine, SamplingParams  # noqa: E402
from cairn.workers.demo import demo_model_dir  # noqa: E402
from cairn.workers.engine_metrics import EngineMetrics  # noqa: E402

POLICIES = ["exact", "all", "interval", "end_branch", "cairn"]


@dataclass
class Request:
    conv: int
    turn: int
    prompt: list[int]
    hints: list[int]
    output_len: int
    oracle: int = 0


@dataclass
class Result:
    policy: str
    hit: dict[int, int] = field(default_factory=dict)  # turn -> hit tokens
    oracle: dict[int, int] = field(default_factory=dict)
    prefill: int = 0
    ttft: dict[int, list[float]] = field(default_factory=dict)
    checkpoints: int = 0
    state_peak: int = 0
    seconds: float = 0.0
    computed: int = 0  # tokens the engine computed (prefill, recomputation, decode)
    metrics: EngineMetrics | None = None  # the engine's, at the end
    cached: dict[tuple[int, int], int] = field(default_factory=dict)  # (conv, turn) -> cached_tokens


class Client:
    """Renders conversations like an ingress: template, tokens, checkpoint hints."""

    def __init__(self, model_dir: Path):
        self.tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
        self.template = ChatTemplate.from_dir(model_dir)

    def encode(self, messages: list[dict], tools: list[dict] | None = None) -> tuple[list[int], list[int]]:
        text, starts = self.template.message_starts(messages, tools=tools)
        enc = self.tok.encode(text, add_special_tokens=False)
        ends = [e for _, e in enc.offsets]
        hints = [sum(1 for e in ends if e <= c) for c in starts]
        return enc.ids, hints

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True)


def record_trace(engine: Engine, client: Client, workload: str, convs: int, turns: int,
                 system_words: int, user_words: int, answer_tokens: int) -> list[list[Request]]:
    """Runs the conversations once and records each round's requests (what every policy replays),
    each with its oracle hit: everything seen before it is earlier rounds' whole sequences and
    this round's earlier prompts (all of a round's prompts are sent before any answer)."""
    rng = torch.Generator().manual_seed(1)
    oracle = Oracle(page_tokens=1)  # exact, to the token

    def text(n_words: int, per_sentence: int) -> str:
        return " ".join(sentence(rng, per_sentence, MULTITURN_WORDS) for _ in range(n_words // per_sentence))

    system = {"role": "system", "content": text(system_words, 12)}
    tools = AGENT_TOOLS if workload == "agent" else None
    messages = [[system] for _ in range(convs)]
    echo_ids: list[list[int] | None] = [None] * convs
    rounds = []
    params = SamplingParams(max_tokens=answer_tokens, temperature=0, ignore_eos=True)
    for turn in range(1, turns + 1):
        reqs = []
        for c in range(convs):
            user = {"role": "user", "content": text(user_words, 10)}
            if workload != "agent" or turn == 1:  # an agent's later rounds end with a tool result
                messages[c].append(user)
            if workload == "echo" and echo_ids[c] is not None:
                suffix, _ = client.encode([user])  # the new user turn + generation prompt, as tokens
                prompt = echo_ids[c] + client.tok.encode("<|im_end|>\n", add_special_tokens=False).ids + suffix
                hints = [len(echo_ids[c])]
            else:
                prompt, hints = client.encode(messages[c], tools)
            reqs.append(Request(c, turn, prompt, hints, answer_tokens, oracle=oracle.hit_tokens(prompt)))
        outs = engine.generate([r.prompt for r in reqs], params)
        for r, out in zip(reqs, outs):
            half = len(out.token_ids) // 2
            if workload == "thinking-drop":
                messages[r.conv].append({"role": "assistant", "content": client.decode(out.token_ids[half:]),
                                         "reasoning_content": client.decode(out.token_ids[:half])})
            elif workload == "agent":
                messages[r.conv] += tool_round(rng, r.turn, client.decode(out.token_ids), MULTITURN_WORDS)
            else:
                messages[r.conv].append({"role": "assistant", "content": client.decode(out.token_ids)})
                echo_ids[r.conv] = r.prompt + out.token_ids
        rounds.append(reqs)
        for r, out in zip(reqs, outs):
            r.output_len = len(out.token_ids)
            oracle.insert(r.prompt + out.token_ids)
    return rounds


def replay(engine: Engine, rounds: list[list[Request]], policy: str) -> Result:
    res = Result(policy)
    start = time.perf_counter()
    for reqs in rounds:
        ids = {}
        sent = time.perf_counter()
        for r in reqs:
            rid = engine.add_request(r.prompt, SamplingParams(max_tokens=r.output_len, temperature=0, ignore_eos=True),
                                     checkpoint_hints=r.hints)
            ids[rid] = r
        first: dict[str, float] = {}
        while engine.has_unfinished():
            for out in engine.step():
                if out.request_id not in first:
                    first[out.request_id] = time.perf_counter() - sent
                if out.finished:
                    r = ids[out.request_id]
                    res.cached[(r.conv, r.turn)] = out.cached_tokens
                    res.hit[r.turn] = res.hit.get(r.turn, 0) + out.cached_tokens
                    res.oracle[r.turn] = res.oracle.get(r.turn, 0) + r.oracle
                    res.prefill += len(r.prompt) - out.cached_tokens
        for rid, r in ids.items():
            res.ttft.setdefault(r.turn, []).append(first[rid])
        engine.check()
    res.seconds = time.perf_counter() - start
    res.checkpoints = int(engine.metrics().checkpoints_stored_total)
    res.state_peak = engine.cache.stats.state_bytes_peak
    res.computed = engine.stats.computed_tokens
    res.metrics = engine.metrics()
    return res


def tier_report(workload: str, model_dir: Path, rounds: list[list[Request]], engine_opts: dict, spare: int,
                device_share: float, host_share: float, turns: int) -> None:
    """The host tier against none, at a device budget of `device_share` of what the cache needs."""
    roomy = Engine.from_pretrained(model_dir, cache_policy="cairn", cache_memory_bytes=spare, **engine_opts)
    base = replay(roomy, rounds, "cairn")
    need = roomy.cache.used_bytes  # nothing was evicted: everything it kept
    device = int(device_share * need)
    # As many sequences run at once as the device holds whole (the longest of the last round,
    # pages and state): else the budget measures preemption, not caching. Both runs share it.
    layout, ps = roomy.layout, roomy.spec.page_size
    longest = max(-(-(len(r.prompt) + r.output_len) // ps) + layout.slot_blocks for r in rounds[-1])
    running = max(1, min(engine_opts["max_num_seqs"], device // layout.block_bytes // longest))
    opts = dict(engine_opts, max_num_seqs=running)
    runs = [("memory to spare", base)]
    for name, host in (("device only", 0), (f"+ host tier {host_share:g}x", int(host_share * device))):
        engine = Engine.from_pretrained(model_dir, cache_policy="cairn", cache_memory_bytes=device,
                                        host_cache_bytes=host, **opts)
        runs.append((name, replay(engine, rounds, "cairn")))
    print(f"\n== {workload}: host tier; the cache needs {need / 2**20:.1f} MiB, device budget "
          f"{device / 2**20:.1f} MiB ({device_share:g}x), {running} sequences at once ==")
    print(f"{'run':20s} {'hit':>8s} {'oracle':>8s} {'ratio':>6s} {'computed':>9s} {'turn-' + str(turns) + ' TTFT':>11s} "
          f"{'promoted':>9s} {'from host':>9s} {'MiB to host':>11s} {'MiB back':>9s} {'no slot':>7s}")
    for name, r in runs:
        hit, oracle, m = sum(r.hit.values()), sum(r.oracle.values()), r.metrics
        print(f"{name:20s} {hit:8d} {oracle:8d} {hit / max(oracle, 1):6.3f} {r.computed:9d} "
              f"{statistics.median(r.ttft[turns]):10.3f}s {m.pages_promoted_total:9d} "
              f"{m.checkpoints_from_host_total:9d} {m.bytes_to_host_total / 2**20:11.1f} "
              f"{m.bytes_to_device_total / 2**20:9.1f} {m.checkpoints_without_slot_total:7d}")
    without, with_tier = runs[1][1], runs[2][1]
    ratio = sum(with_tier.hit.values()) / max(sum(with_tier.oracle.values()), 1)
    print(f"with the tier: {ratio:.3f} of the oracle (goal >= 0.97), "
          f"{sum(with_tier.hit.values()) / max(sum(without.hit.values()), 1):.2f}x the device-only hit tokens; "
          f"turn-{turns} median TTFT {statistics.median(without.ttft[turns]) / statistics.median(with_tier.ttft[turns]):.2f}x "
          f"lower than device only")


def report(workload: str, setting: str, results: list[Result], turns: int) -> None:
    print(f"\n== {workload}, {setting} ==")
    print(f"{'policy':11s} {'prefill':>8s} {'hit':>8s} {'oracle':>8s} {'ratio':>6s} {'ckpts':>6s} "
          f"{'state MiB':>9s} {'run s':>6s}  median TTFT per turn (s)")
    for r in results:
        hit, oracle = sum(r.hit.values()), sum(r.oracle.values())
        ttft = " ".join(f"{statistics.median(r.ttft[t]):.2f}" for t in range(1, turns + 1))
        print(f"{r.policy:11s} {r.prefill:8d} {hit:8d} {oracle:8d} {hit / max(oracle, 1):6.3f} {r.checkpoints:6d} "
              f"{r.state_peak / 2**20:9.1f} {r.seconds:6.1f}  {ttft}")
    by = {r.policy: r for r in results}
    exact_t, cairn_t = statistics.median(by["exact"].ttft[turns]), statistics.median(by["cairn"].ttft[turns])
    best_base = max((r for r in results if r.policy != "cairn"),
                    key=lambda r: sum(r.hit.values()))
    ratio = sum(by["cairn"].hit.values()) / max(sum(best_base.hit.values()), 1)
    print(f"turn-{turns} median TTFT: exact {exact_t:.2f}s, cairn {cairn_t:.2f}s ({exact_t / cairn_t:.1f}x lower); "
          f"cairn hit tokens / best baseline ({best_base.policy}): {ratio:.2f}x")


def plot(all_results: dict[tuple[str, str], list[Result]], turns: int) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, axes = plt.subplots(1, len(all_results), figsize=(5 * len(all_results), 4), squeeze=False)
    for ax, ((workload, setting), results) in zip(axes[0], all_results.items()):
        xs = list(range(1, turns + 1))
        ax.plot(xs, [results[0].oracle.get(t, 0) for t in xs], "k--", label="oracle")
        for r in results:
            ax.plot(xs, [r.hit.get(t, 0) for t in xs], marker="o", label=r.policy)
        ax.set_title(f"{workload}, {setting}")
        ax.set_xlabel("turn")
        ax.set_ylabel("hit tokens (all conversations)")
        ax.legend(fontsize=8)
    save(fig, "multiturn.png")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--convs", type=int, default=16)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--system-words", type=int, default=180)
    parser.add_argument("--user-words", type=int, default=40)
    parser.add_argument("--answer-tokens", type=int, default=32)
    parser.add_argument("--workloads", default="thinking-drop,echo,agent")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--arch", default="qwen3_next", choices=("qwen3_next", "qwen3_5", "qwen3_5_moe"),
                        help="the demo model's architecture")
    parser.add_argument("--quick", action="store_true", help="tiny model, 4 conversations, 3 turns, one thread")
    parser.add_argument("--device-budget", type=float, default=None, metavar="F",
                        help="host tier mode: the device budget as a share of what the cache needs (module doc)")
    parser.add_argument("--host-budget", type=float, default=4.0, metavar="H",
                        help="host tier mode: the host tier as a multiple of the device budget")
    args = parser.parse_args()
    size, spare = "bench", 2**31  # bytes: "memory to spare", where nothing is ever evicted
    if args.quick:  # 64 MiB is still far more than the tiny model's short chats use, and quick to allocate
        size, spare, args.convs, args.turns, args.system_words, args.threads = "tiny", 2**26, 4, 3, 60, 1
    torch.set_num_threads(args.threads)
    model_dir = demo_model_dir(size, args.arch)
    client = Client(model_dir)
    engine_opts = dict(max_num_seqs=max(args.convs, 4), max_num_batched_tokens=2048)
    probe = Engine.from_pretrained(model_dir, **engine_opts)
    page_b, ckpt_b = probe.layout.block_bytes, probe.layout.slot_blocks * probe.layout.block_bytes
    all_results = {}
    for workload in args.workloads.split(","):
        rounds = record_trace(Engine.from_pretrained(model_dir, cache_policy="all", cache_memory_bytes=spare,
                                                     **engine_opts),
                              client, workload, args.convs, args.turns, args.system_words, args.user_words,
                              args.answer_tokens)
        if args.device_budget is not None:
            tier_report(workload, model_dir, rounds, engine_opts, spare, args.device_budget, args.host_budget,
                        args.turns)
            continue
        # The last round's sequences must fit while they run, pages and running states (else the
        # budget measures preemption, not caching). Slack beyond them: 10% more pages and two
        # checkpoints per conversation, which dead branches' pages and every policy's
        # checkpoints compete for.
        final_pages = sum(-(-(len(r.prompt) + r.output_len) // probe.spec.page_size) for r in rounds[-1])
        pages = int(1.1 * final_pages)
        budget = pages * page_b + (len(rounds[-1]) + 2 * args.convs) * ckpt_b
        settings = {"memory to spare": spare,
                    f"budget {budget / 2**20:.1f} MiB = {pages} pages + {len(rounds[-1])} running and "
                    f"{2 * args.convs} checkpoint states": budget}
        for setting, nbytes in settings.items():
            results = []
            for policy in POLICIES:
                engine = Engine.from_pretrained(model_dir, cache_policy=policy, cache_memory_bytes=nbytes, **engine_opts)
                results.append(replay(engine, rounds, policy))
            report(workload, setting, results, args.turns)
            all_results[(workload, setting.split(" =")[0])] = results
    if args.device_budget is not None:
        return
    print(f"\nmodel: {size} {args.arch} demo; {args.convs} conversations open at once, {args.turns} turns; "
          f"page {page_b / 1024:.0f} KiB, state slot {ckpt_b / 1024:.0f} KiB "
          f"(= {ckpt_b // page_b} pages of the arena)")
    plot(all_results, args.turns)


if __name__ == "__main__":
    main()
