"""The cairn policy's kinds earn their keep: a kind whose checkpoints are never resumed from stops
being admitted (but for exploration), one that is keeps being admitted, and no kind is judged
before the hits it could earn can have come back, however many conversations are in flight. The
verdicts bind only under pressure: with room in the cache, a kind judged idle is still admitted,
so the next workload that needs it finds its checkpoints."""

from workers.checkpoint_policy import HINT, PROMPT_END, TAIL, CheckpointPolicy

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
