"""The hybrid prefix cache as a user meets it through the engine: history rewritten by a chat
template still hits, divergence keeps the pages before it, a resumed request computes what a
cold one computes, hashes agree across processes, and the event stream tells the truth."""

import subprocess
import sys

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer

from cairn.cache_service.hashing import page_hashes, root_hash
from cairn.cache_service.index import CacheIndex
from cairn.cluster.api.chat_template import ChatTemplate
from cairn.workers import Engine, SamplingParams
from tests.support.paths import REPO
from tests.support.stepping import drain, finish, run_alone

PS = 16
GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=1)


@pytest.fixture(scope="module")
def chat(tiny_model_dir):
    tok = Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json"))
    template = ChatTemplate.from_dir(tiny_model_dir)
    return lambda messages: tok.encode(template.render(messages), add_special_tokens=False).ids, tok


def first_turn():
    return [{"role": "system", "content": "You answer questions about stone piles. " * 6},
            {"role": "user", "content": "How do I build a cairn that lasts through winter storms? " * 3}]


def second_turn(answer_text: str):
    return first_turn() + [
        {"role": "assistant", "content": "Stack flat stones, widest first.",
         "reasoning_content": "The user wants durable cairns. " + answer_text},
        {"role": "user", "content": "And how tall?"}]


@pytest.mark.parametrize("policy", ["cairn", "all"])
def test_thinking_drop_turn_two_resumes_near_turn_ones_prompt_end(tiny_model_dir, chat, policy):
    render, tok = chat
    engine = Engine.from_pretrained(tiny_model_dir, cache_policy=policy, num_pages=128)
    p1 = render(first_turn())
    out1 = engine.generate([p1], GREEDY)[0]
    assert out1.cached_tokens == 0
    p2 = render(second_turn(tok.decode(out1.token_ids)))
    assert p2[:len(p1)] == p1 and p2[:len(p1) + len(out1.token_ids)] != p1 + out1.token_ids
    out2 = engine.generate([p2], GREEDY)[0]
    assert out2.cached_tokens >= len(p1) - engine.options.tail_guard - PS
    assert engine.stats.cached_tokens == out2.cached_tokens


def test_thinking_drop_turn_two_gets_nothing_under_exact_matching(tiny_model_dir, chat):
    render, tok = chat
    engine = Engine.from_pretrained(tiny_model_dir, cache_policy="exact", num_pages=128)
    p1 = render(first_turn())
    out1 = engine.generate([p1], GREEDY)[0]
    out2 = engine.generate([render(second_turn(tok.decode(out1.token_ids)))], GREEDY)[0]
    assert out2.cached_tokens == 0


@pytest.mark.parametrize("policy", ["cairn", "exact", "end_branch"])
def test_a_client_echoing_the_whole_turn_resumes_at_its_last_page(tiny_model_dir, chat, policy):
    render, _ = chat
    engine = Engine.from_pretrained(tiny_model_dir, cache_policy=policy, num_pages=128)
    p1 = render(first_turn())
    out1 = engine.generate([p1], SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))[0]
    p2 = p1 + out1.token_ids + render([{"role": "user", "content": "go on"}])
    out2 = engine.generate([p2], GREEDY)[0]
    assert out2.cached_tokens >= len(p1) + len(out1.token_ids) - PS


def prompt(n, seed, vocab=200):
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_divergence_inside_page_k_resumes_at_the_divergence_attention_only(hf_checkpoint):
    """The 7 tokens of page 3 before the divergence come from a's page 3, copied into b's own."""
    engine = Engine.from_pretrained(hf_checkpoint("attention_only"), num_pages=64)
    assert not engine.config.recurrent
    a = prompt(6 * PS + 5, seed=1)
    engine.generate([a], GREEDY)
    b = list(a)
    b[3 * PS + 7] = (b[3 * PS + 7] + 1) % 200  # inside page 3 (0-based)
    warm = engine.generate([b], GREEDY)[0]
    assert warm.cached_tokens == 3 * PS + 7
    cold = Engine.from_pretrained(hf_checkpoint("attention_only"), num_pages=64).generate([b], GREEDY)[0]
    assert warm.token_ids == cold.token_ids
    torch.testing.assert_close(torch.tensor([lp.logprob for lp in warm.logprobs]),
                               torch.tensor([lp.logprob for lp in cold.logprobs]), atol=1e-4, rtol=0)
    # a's last page never filled; kept as a partial page when a ended, its head is copied back
    assert engine.generate([a], GREEDY)[0].cached_tokens == len(a) - 1
    engine.check()


def test_divergence_inside_page_k_keeps_the_k_pages_before_it_hybrid(tiny_model_dir):
    engine = Engine.from_pretrained(tiny_model_dir, cache_policy="all", num_pages=64)
    a = prompt(6 * PS + 5, seed=2)
    engine.generate([a], GREEDY)
    b = list(a)
    b[3 * PS + 7] = (b[3 * PS + 7] + 1) % 200
    assert engine.generate([b], GREEDY)[0].cached_tokens == 3 * PS
    # With the deepest checkpoint gone, the next one down is used (never zero while one exists).
    root = engine.spec.hash_root()
    hashes = page_hashes(a, PS, root)
    assert engine.cache.remove_checkpoint(hashes[2])
    c = list(a)
    c[3 * PS + 9] = (c[3 * PS + 9] + 3) % 200
    assert engine.generate([c], GREEDY)[0].cached_tokens == 2 * PS
    for j in (2, 1, 0):
        engine.cache.remove_checkpoint(hashes[j])
    assert engine.generate([c[:3 * PS] + [5, 6, 7]], GREEDY)[0].cached_tokens == 0


def test_cached_tokens_is_reported_for_every_request_zero_included(tiny_model_dir):
    engine = Engine.from_pretrained(tiny_model_dir, num_pages=64)
    outs = engine.generate([prompt(40, 3), prompt(3, 4)], GREEDY)
    assert [o.cached_tokens for o in outs] == [0, 0]


@pytest.fixture(scope="module")
def warm_and_cold(tiny_model_dir):
    return {policy: Engine.from_pretrained(tiny_model_dir, cache_policy=policy, num_pages=512, max_num_seqs=4)
            for policy in ("all", "cairn")}


def common_prefix(a: list[int], b: list[int]) -> int:
    k = 0
    while k < min(len(a), len(b)) and a[k] == b[k]:
        k += 1
    return k


def cairn_resume(base_len: int, limit: int) -> int:
    """Where the `cairn` policy resumes a prompt that shares `limit` tokens (capped at n - 1) with
    an unhinted earlier prompt of `base_len` tokens run alone with GREEDY: the deepest of that
    prompt's checkpoints at or under `limit` (design rule 6: `tail` n - 4, `prompt_end` n, the
    finish capture at the last page boundary it computed), a position inside a page usable when
    the earlier sequence computed K/V up to it (a whole page, or its last page, kept partial when
    it ended inside it: the head copied), and nothing inside the first page."""
    computed = base_len + GREEDY.max_tokens - 1
    finish = computed // PS * PS
    usable = [p for p in (base_len - 4, base_len, finish) if PS <= p <= limit and p <= computed]
    return max(usable, default=0)


@settings(max_examples=120, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(data=st.data())
@pytest.mark.parametrize("policy", ["all", "cairn"])
def test_a_resumed_request_hits_where_the_policy_says_and_computes_what_a_cold_one_computes(warm_and_cold, policy,
                                                                                            data):
    """Each example alone (the cache cleared first, its own salt): a prompt, then one sharing a
    drawn prefix with it. The second resumes exactly where its policy's checkpoints allow (`all`:
    every page boundary; `cairn`: `cairn_resume`) and computes what a cold request computes."""
    engine = warm_and_cold[policy]
    engine.clear_cache()
    base_len = data.draw(st.integers(PS + 2, 5 * PS), label="base")
    base = data.draw(st.lists(st.integers(0, 500), min_size=base_len, max_size=base_len), label="tokens")
    keep = data.draw(st.integers(1, base_len), label="shared")
    tail = data.draw(st.lists(st.integers(0, 500), min_size=1, max_size=2 * PS), label="tail")
    second = base[:keep] + tail
    limit = min(common_prefix(base, second), len(second) - 1)
    salt = f"resume-{engine.stats.steps}"
    run_alone(engine, base, GREEDY, salt)
    warm = run_alone(engine, second, GREEDY, salt)
    cold = run_alone(engine, second, GREEDY, salt + "-cold")
    expected = limit // PS * PS if policy == "all" else cairn_resume(base_len, limit)
    assert (warm.cached_tokens, cold.cached_tokens) == (expected, 0), (base_len, keep, limit)
    assert warm.token_ids == cold.token_ids
    torch.testing.assert_close(torch.tensor([lp.logprob for lp in warm.logprobs]),
                               torch.tensor([lp.logprob for lp in cold.logprobs]), atol=1e-4, rtol=0)
    engine.check()


@settings(max_examples=60, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(data=st.data())
def test_a_request_resumed_inside_a_page_computes_what_a_cold_one_computes(warm_and_cold, data):
    """A prompt, a sibling parting from it at `keep` (it leaves a branch checkpoint exactly
    there), then a second sibling parting at `keep` too: it resumes exactly at `keep`, mostly
    inside a page (the K/V of that page's head copied from a cached page, the state a sub-page
    checkpoint), and computes what a cold request computes. Where the first prompt never
    computed that page whole, the first sibling cannot see where it parts (no page holds the
    tokens to compare): the second resumes at least at the page floor (the first prompt's finish
    capture) and at most at `keep`. Each example alone: the cache cleared first, its own salt."""
    engine = warm_and_cold["cairn"]
    engine.clear_cache()
    base_len = data.draw(st.integers(PS + 2, 5 * PS), label="base")
    base = data.draw(st.lists(st.integers(0, 500), min_size=base_len, max_size=base_len), label="tokens")
    keep = data.draw(st.integers(PS + 1, base_len), label="shared")
    rest = [data.draw(st.lists(st.integers(0, 500), min_size=0, max_size=2 * PS), label=f"tail{i}") for i in (1, 2)]
    parted = base[keep] if keep < base_len else 0
    first, second = ([(parted + i) % 501] + r for i, r in zip((1, 2), rest))
    salt = f"inside-{engine.stats.steps}"
    for p in (base, base[:keep] + first):
        run_alone(engine, p, GREEDY, salt)
    warm = run_alone(engine, base[:keep] + second, GREEDY, salt)
    cold = run_alone(engine, base[:keep] + second, GREEDY, salt + "-cold")
    seen_whole = keep % PS == 0 or (keep // PS + 1) * PS <= base_len + GREEDY.max_tokens - 1
    if seen_whole:
        assert warm.cached_tokens == keep, (base_len, keep)
    else:
        assert keep // PS * PS <= warm.cached_tokens <= keep, (base_len, keep)
    assert cold.cached_tokens == 0
    assert warm.token_ids == cold.token_ids
    torch.testing.assert_close(torch.tensor([lp.logprob for lp in warm.logprobs]),
                               torch.tensor([lp.logprob for lp in cold.logprobs]), atol=1e-4, rtol=0)
    engine.check()


HASH_SCRIPT = """
import sys
from cairn.cache_service.hashing import page_hashes, root_hash
print(",".join(h.hex() for h in page_hashes(list(range(100)), 16, root_hash("model-x", 16, "salt"))))
"""


def test_hash_chains_are_equal_in_two_processes():
    here = ",".join(h.hex() for h in page_hashes(list(range(100)), 16, root_hash("model-x", 16, "salt")))
    other = subprocess.run([sys.executable, "-c", HASH_SCRIPT], capture_output=True, text=True, check=True,
                           env={"PYTHONHASHSEED": "123", "PATH": ""}, cwd=str(REPO))
    assert other.stdout.strip() == here
    assert len(here.split(",")) == 100 // 16


def test_different_cache_salts_never_share_a_page(tiny_model_dir):
    engine = Engine.from_pretrained(tiny_model_dir, cache_policy="all", num_pages=64)
    p = prompt(5 * PS, 9)

    def run(salt):
        return run_alone(engine, p, GREEDY, salt).cached_tokens

    assert run("alice") == 0
    assert run("bob") == 0
    assert run(None) == 0
    assert run("alice") > 0
    assert page_hashes(p, PS, engine.spec.hash_root("alice"))[0] != page_hashes(p, PS, engine.spec.hash_root("bob"))[0]


def replay_matches(engine, index):
    batch = engine.drain_events()
    if batch is not None:
        assert index.apply(batch.encode())
    pages, states = engine.cache.snapshot()
    got_pages, got_states = index.contents(engine.events.worker_id)
    assert got_pages == {h for h, _ in pages}
    assert got_states == set(states)


@pytest.mark.parametrize("policy", ["cairn", "all"])
def test_an_event_stream_replayed_into_an_index_equals_the_workers_contents(tiny_model_dir, policy):
    # A budget so small that pages and checkpoints are evicted all the time.
    engine = Engine.from_pretrained(tiny_model_dir, cache_policy=policy, num_pages=24, max_checkpoints=6,
                                    max_num_seqs=3, max_num_batched_tokens=48)
    index = CacheIndex()
    g = torch.Generator().manual_seed(5)
    shared = prompt(2 * PS, 11)
    for i in range(14):
        p = shared + torch.randint(0, 300, (int(torch.randint(1, 3 * PS, (1,), generator=g)),), generator=g).tolist()
        engine.add_request(p, SamplingParams(max_tokens=int(torch.randint(1, 20, (1,), generator=g)),
                                             temperature=0, ignore_eos=True))
        if i % 3 == 2:
            drain(engine, each=lambda _: (engine.check(), replay_matches(engine, index)))
    drain(engine, each=lambda _: replay_matches(engine, index))
    assert engine.cache.stats.pages_evicted > 0
    engine.clear_cache()
    replay_matches(engine, index)
    assert index.contents(engine.events.worker_id) == (frozenset(), frozenset())
    assert index.workers_needing_resync() == set()


def run_conversations(engine, workload: str, turns: int = 10, convs: int = 2):
    """Token-level multi-turn chats. `drop`: the previous answer's first half is rewritten away
    (Qwen3's thinking drop: history diverges at the previous prompt's end); `drop_guarded`: the
    previous prompt's last 3 tokens are rewritten too (a generation prompt that opened a think
    block); `echo`: everything is sent back verbatim."""
    g = torch.Generator().manual_seed(3)
    history = [prompt(3 * PS, 20 + c) for c in range(convs)]
    for _ in range(turns):
        outs = engine.generate(history, SamplingParams(max_tokens=2 * PS, temperature=0, ignore_eos=True))
        for c, out in enumerate(outs):
            if workload == "echo":
                history[c] = history[c] + out.token_ids
            elif workload == "drop":
                history[c] = history[c] + out.token_ids[PS:]
            else:
                history[c] = history[c][:-3] + out.token_ids[PS:]
            history[c] += torch.randint(0, 400, (PS + 3,), generator=g).tolist()
    return engine.metrics()


@pytest.mark.parametrize("workload, pays, idle", [
    ("drop", "prompt_end", ["finish"]),
    ("drop_guarded", "tail", ["finish", "prompt_end"]),
    ("echo", "finish", ["tail", "prompt_end"]),
])
def test_each_checkpoint_kind_earns_its_keep(tiny_model_dir, workload, pays, idle):
    # Each workload reuses one kind; once its checkpoints have settled it stops paying for kinds
    # it never hits (exploration aside): 60 requests finish; 8 admissions judge a kind, each
    # settles 16 decisions later (4 x max_num_seqs). Verdicts bind under pressure only: 8
    # checkpoints for 3 conversations asking for up to five kinds a turn.
    engine = Engine.from_pretrained(tiny_model_dir, num_pages=1024, max_num_seqs=4, max_checkpoints=8)
    m = run_conversations(engine, workload, turns=20, convs=3)
    assert m.checkpoint_hits_total[pays] >= 45
    for kind in idle:
        assert m.checkpoint_hits_total[kind] == 0
        assert m.checkpoints_admitted_total[kind] <= 24


@pytest.mark.parametrize("policy", ["cairn", "all"])
def test_a_prompt_arriving_beside_a_twin_waits_a_step_and_resumes_where_they_part(tiny_model_dir, policy):
    engine = Engine.from_pretrained(tiny_model_dir, cache_policy=policy, num_pages=128, max_num_batched_tokens=512)
    shared = prompt(6 * PS + 5, 30)
    a, b = shared + prompt(10, 31), shared + prompt(12, 32)
    out_a, out_b = engine.generate([a, b], GREEDY)
    assert (out_a.cached_tokens, out_b.cached_tokens) == (0, 6 * PS)
    cold = Engine.from_pretrained(tiny_model_dir, num_pages=128).generate([b], GREEDY)[0]
    assert out_b.token_ids == cold.token_ids


def test_exact_matching_does_not_make_twins_wait(tiny_model_dir):
    engine = Engine.from_pretrained(tiny_model_dir, cache_policy="exact", num_pages=128, max_num_batched_tokens=512)
    shared = prompt(6 * PS + 5, 30)
    engine.add_request(shared + [1], GREEDY)
    engine.add_request(shared + [2], GREEDY)
    engine.step()
    assert len(engine.scheduler.running) == 2


def test_the_engines_cache_tensors_are_views_of_one_arena_no_larger_than_its_budget(tiny_model_dir):
    budget = 40 * 8192 + 100  # 40 page-sized blocks of the tiny model, and change
    engine = Engine.from_pretrained(tiny_model_dir, cache_memory_bytes=budget, max_num_seqs=4)
    arena = engine.runner.arena
    assert arena.numel() <= budget and engine.cache.budget_bytes == arena.numel()
    start, end = arena.data_ptr(), arena.data_ptr() + arena.numel()
    caches = engine.runner.caches
    for t in [t for kv in caches.kv for t in kv] + [caches.conv_states, caches.ssm_states]:
        assert t.untyped_storage().data_ptr() == arena.untyped_storage().data_ptr(), "a view of the arena"
        last = t.data_ptr() + sum((n - 1) * s for n, s in zip(t.shape, t.stride())) * t.element_size()
        assert start <= t.data_ptr() and last + t.element_size() <= end


def test_in_a_tight_arena_pages_and_states_share_blocks_and_resumed_equals_cold(tiny_model_dir):
    """12 blocks (four groups of three) for pages, running states and checkpoints at once: slots
    are carved out of groups pages left, and nothing computed lands on another's blocks."""
    tight = Engine.from_pretrained(tiny_model_dir, cache_policy="all", cache_memory_bytes=12 * 8192,
                                   max_num_seqs=2, max_num_batched_tokens=24)
    roomy = Engine.from_pretrained(tiny_model_dir, cache_policy="all", num_pages=256)
    base = prompt(2 * PS + 3, seed=11)
    turns = [base] + [base[:k] + prompt(5 + k % 7, seed=k) for k in (2 * PS + 3, 20, PS, 2 * PS, 7, 2 * PS + 1)]
    hits = 0
    for i in range(0, len(turns), 2):
        batch = turns[i:i + 2]
        got, want = tight.generate(batch, GREEDY), roomy.generate(batch, GREEDY)
        assert [o.token_ids for o in got] == [o.token_ids for o in want]
        hits += sum(o.cached_tokens for o in got)
        tight.check()
    assert hits > 0 and tight.cache.stats.pages_evicted > 0
    assert tight.cache.pages.num_held == 0 and not tight.cache.running_slots


def test_the_exact_baseline_stores_every_finished_chat_under_pressure_whatever_its_hints(tiny_model_dir):
    # The ingress hints a chat's reply head two tokens before its end, whatever the policy; only
    # `cairn` reads that as "the template rewrites the reply" and skips the finish capture. The
    # `exact` baseline's one kind is that capture: at its cap of two, each chat still stores its
    # end (evicting the coldest), and its echo resumes there.
    engine = Engine.from_pretrained(tiny_model_dir, cache_policy="exact", num_pages=256, max_checkpoints=2)
    chats = [prompt(3 * PS + 5, seed=40 + i) for i in range(4)]
    outs = []
    for p in chats:
        rid = engine.add_request(p, GREEDY, checkpoint_hints=[len(p) - 2])
        outs.append(finish(engine, [rid])[rid])
    assert engine.cache.stats.by_kind["end"]["stored"] == 4
    echo = chats[-1] + outs[-1].token_ids + [7]
    assert engine.generate([echo], GREEDY)[0].cached_tokens > 0


@pytest.mark.parametrize("hint", [3 * PS, 3 * PS + 5], ids=["at-a-boundary", "inside-page-3"])
def test_a_hint_is_checkpointed_and_a_prompt_edited_there_resumes_exactly_there(tiny_model_dir, hint):
    """The ingress hints where a message starts; the engine stores a state there (and at the page
    boundary before it). The same prompt with that message edited resumes exactly at the hint:
    cached_tokens is 3 pages for a hint at the end of page 2, the hint itself for one inside page
    3. Without the hint (the control) nothing stored lies under the edit: it resumes at 0."""
    engine = Engine.from_pretrained(tiny_model_dir, num_pages=256)
    p = prompt(6 * PS, 21)
    edited = p[:hint] + [(t + 1) % 200 for t in p[hint:]]
    got = {}
    for salt, hints in (("hinted", [hint]), ("control", [])):
        rid = engine.add_request(p, GREEDY, hash_root=engine.spec.hash_root(salt), checkpoint_hints=hints)
        finish(engine, [rid])
        rid = engine.add_request(edited, GREEDY, hash_root=engine.spec.hash_root(salt), checkpoint_hints=hints)
        got[salt] = finish(engine, [rid])[rid].cached_tokens
    assert got == {"hinted": hint, "control": 0}
    if hint % PS:  # the hint's page boundary holds a whole-page state too (what a host tier or a fetch takes)
        before = p[:hint - 2] + [(t + 1) % 200 for t in p[hint - 2:]]  # edited just before the hint
        rid = engine.add_request(before, GREEDY, hash_root=engine.spec.hash_root("hinted"), checkpoint_hints=[hint])
        assert finish(engine, [rid])[rid].cached_tokens == hint // PS * PS
