"""The cairn policy's kinds earn their keep: a kind whose checkpoints are never resumed from stops
being admitted (but for exploration), one that is keeps being admitted, and no kind is judged
before the hits it could earn can have come back, however many conversations are in flight. The
verdicts bind only under pressure: with room in the cache, a kind judged idle is still admitted,
so the next workload that needs it finds its checkpoints. A prompt's targets are thinned to what
is worth a state: near positions fold into one, and under pressure only the end, the newest hint
and branch points are taken.""" 

from cairn.workers.cache.checkpoint_policy import (BRANCH, CONTENT, HINT, INTERVAL, POLICY_KINDS, PROMPT_END, TAIL,
                                                   CheckpointPolicy)
from cairn.workers.engine_options import CACHE_POLICIES

CONVERSATIONS, SETTLE = 64, 4 * 16  # the engine's settle_after: 4 x max_num_seqs (16 here)


def round_robin(policy: CheckpointPolicy, rounds: int, room: bool = False) -> list[dict[str, int]]:
    """64 conversations, one request each per round: every request asks for a hint, a tail and a
    prompt-end checkpoint, and resumes from its conversation's previous hint checkpoint (the
    templates of this workload part at message starts). Per round, how many of each were admitted."""
    last_hint: dict[int, int] = {}  # conversation -> the clock its hint checkpoint was stored at
    counts = []
    for _ in range(rounds):
        admitted = {HINT: 0, TAIL: 0, PROMPT_END: 0}
        for c in range(CONVERSATIONS):
            if c in last_hint:
                policy.record_hit({HINT}, last_hint.pop(c))
            for kind in (HINT, TAIL, PROMPT_END):
                if policy.admit({kind}, room=room):
                    admitted[kind] += 1
                    if kind == HINT:
                        last_hint[c] = policy.clock
        counts.append(admitted)
    return counts


def test_no_kind_is_refused_before_the_conversations_in_flight_can_come_back():
    """192 admission decisions pass before any conversation's second turn: three times the
    settle window a handful of conversations would need. The first round keeps every checkpoint."""
    counts = round_robin(CheckpointPolicy("cairn", settle_after=SETTLE), rounds=1)
    assert counts[0] == {HINT: CONVERSATIONS, TAIL: CONVERSATIONS, PROMPT_END: CONVERSATIONS}


def test_kinds_that_are_never_resumed_from_stop_being_admitted_and_the_one_that_is_stays():
    counts = round_robin(CheckpointPolicy("cairn", settle_after=SETTLE), rounds=8)
    last = counts[-1]
    assert last[HINT] == CONVERSATIONS, counts
    assert last[TAIL] <= CONVERSATIONS // 5 and last[PROMPT_END] <= CONVERSATIONS // 5, counts


def test_every_cache_policy_an_engine_option_may_name_has_its_kinds_and_no_other_has():
    assert sorted(POLICY_KINDS) == sorted(CACHE_POLICIES)


def test_baselines_admit_their_kinds_always():
    policy = CheckpointPolicy("interval", settle_after=SETTLE)
    assert all(policy.admit({"interval"}) == {"interval"} for _ in range(1000))


def test_with_room_in_the_cache_a_kind_judged_idle_is_admitted_and_judged_again_once_room_runs_out():
    policy = CheckpointPolicy("cairn", settle_after=SETTLE)
    round_robin(policy, rounds=8)  # tail and prompt_end judged idle
    roomy = round_robin(policy, rounds=2, room=True)
    assert roomy[-1] == {HINT: CONVERSATIONS, TAIL: CONVERSATIONS, PROMPT_END: CONVERSATIONS}, roomy
    tight = round_robin(policy, rounds=4)
    assert tight[-1][TAIL] <= CONVERSATIONS // 5 and tight[-1][PROMPT_END] <= CONVERSATIONS // 5, tight


PS = 16


def test_a_hinted_prompts_end_is_one_checkpoint_at_the_replys_hint_with_every_kind_that_asked():
    # Qwen3.5's generation prompt opens <think>, which history drops: the reply's hint lies two
    # tokens before the end, between the tail (n - 4) and the prompt's end, and a message starts
    # at 101, its content at 104: each pair is one checkpoint, at the deeper known position.
    policy, n = CheckpointPolicy(), 200
    targets = policy.prompt_targets(n, PS, 0, 0, hints=(101, 104, n - 2))
    thinned = policy.thin(targets, PS, hinted=True, pressure=False)
    assert thinned[n - 2] == {TAIL, PROMPT_END, HINT}
    assert thinned[104] == {HINT} and 101 not in thinned
    assert n not in thinned and n - 4 not in thinned
    assert thinned[96] == {HINT} and thinned[192] == {HINT}  # page boundaries stay, with memory to spare


def test_a_hinted_prompts_end_folds_to_its_end_when_the_template_parts_elsewhere():
    # A tool round: the hint of the reply lies far back (the query's start), so the next prompt
    # extends this one: its end is kept, exact, and the tail folds into it.
    policy, n = CheckpointPolicy(), 300
    thinned = policy.thin(policy.prompt_targets(n, PS, 120, 120, hints=(100, 250)), PS, hinted=True, pressure=False)
    assert thinned[n] == {TAIL, PROMPT_END}


def test_a_prompt_without_hints_keeps_its_targets_apart():
    policy = CheckpointPolicy(interval_pages=4)
    targets = policy.prompt_targets(200, PS, 0, 0)
    assert set(targets) == {64, 128, 192, 196, 200}
    assert policy.thin(targets, PS, hinted=False, pressure=False) == targets
    assert set(policy.thin(targets, PS, hinted=False, pressure=True)) == {196, 200}  # the intervals go


def test_under_pressure_a_prompt_keeps_its_end_its_newest_hint_and_where_it_branched():
    policy, n = CheckpointPolicy(interval_pages=4), 300
    targets = policy.prompt_targets(n, PS, 40, 150, hints=(60, 90, 200, 203, n - 2))
    assert {INTERVAL} <= set().union(*targets.values())
    thinned = policy.thin(targets, PS, hinted=True, pressure=True)
    assert thinned == {n - 2: {TAIL, PROMPT_END, HINT}, 203: {HINT}, 150: {BRANCH}}


def test_baselines_take_their_targets_as_they_are():
    for name in ("all", "exact", "interval"):
        policy = CheckpointPolicy(name)
        targets = policy.prompt_targets(300, PS, 0, 0, hints=(100, 298))
        assert policy.thin(targets, PS, hinted=True, pressure=True) == targets


def test_a_twins_branch_point_stays_exact_and_the_first_page_folds_like_any_other():
    # A twin waits to resume where it parts from this prompt, at a page boundary: a hint two
    # tokens later does not move it. Inside page 0 (a state keyed by the chain's hash root), the
    # tail, a hint and the prompt's end fold into one at the hint, as anywhere.
    policy = CheckpointPolicy()
    targets = {64: {BRANCH}, 66: {HINT}, 12: {TAIL}, 14: {HINT}, 16: {PROMPT_END}}
    for pressure in (False, True):
        assert policy.thin(targets, PS, hinted=True, pressure=pressure) == {64: {BRANCH}, 66: {HINT},
                                                                            14: {TAIL, HINT, PROMPT_END}}


def test_the_newest_messages_text_gets_its_page_boundaries_with_memory_to_spare_only():
    # An edit of the newest message later parts from this prompt inside its text, where no
    # template says: its whole pages get states, clear of the end, so such an edit resumes at
    # most a page short of where it parts. Under pressure they go first.
    policy, n = CheckpointPolicy(), 200
    targets = policy.prompt_targets(n, PS, 0, 0, hints=(101, 104, n - 2))
    # its pages 112..192, but 192 (a hint's page boundary) is wanted already: four of the five left
    assert {p for p, kinds in targets.items() if kinds == {CONTENT}} == {112, 128, 160, 176}
    spare = policy.thin(targets, PS, hinted=True, pressure=False)
    assert all(spare[p] == {CONTENT} for p in (112, 128, 160, 176))
    assert spare[n - 2] == {TAIL, PROMPT_END, HINT}, "the end still folds whole"
    assert not {p for p, kinds in policy.thin(targets, PS, hinted=True, pressure=True).items() if CONTENT in kinds}
    assert not {k for kinds in CheckpointPolicy("all").prompt_targets(n, PS, 0, 0, hints=(104,)).values() for k in kinds
                if k == CONTENT}, "the baselines take none"


def test_a_long_message_gets_a_few_content_checkpoints_spread_over_it_not_one_a_page():
    policy, n = CheckpointPolicy(), 6000
    targets = policy.prompt_targets(n, PS, 0, 0, hints=(10, n - 2))
    content = sorted(p for p, kinds in targets.items() if kinds == {CONTENT})
    assert len(content) == policy.content_pages == 4
    assert content[0] == 16 and content[-1] >= n - 3 * PS, f"spread over the whole message: {content}"
    gaps = [b - a for a, b in zip(content, content[1:])]
    assert max(gaps) - min(gaps) <= PS, f"evenly: {content}"
