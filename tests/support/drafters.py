"""A drafter for tests of speculative decoding (cairn.workers.speculative): it drafts from known
continuations, so a test controls which drafted tokens the target keeps."""

import random


class ScriptedDrafter:
    """Drafts, for a sequence whose tokens begin one of `continuations` (each a whole sequence:
    prompt and output), the tokens that follow there; each drafted token is replaced by another
    with probability `wrong` (1.0: every draft is wrong, so a greedy target rejects it), from a
    seeded stream. A sequence no continuation begins gets random tokens."""

    def __init__(self, continuations: list[list[int]], vocab: int, wrong: float = 0.0, seed: int = 0):
        self.continuations, self.vocab, self.wrong = continuations, vocab, wrong
        self.rng = random.Random(seed)
        self.proposed = 0
        self.asked: set[tuple[int, ...]] = set()  # prompts of the sequences asked for drafts

    def propose(self, runs) -> None:
        for run in runs:
            seq = run.segment.seq
            seq.draft = []
            if not run.want:
                continue
            self.asked.add(tuple(seq.prompt_token_ids))
            tokens = seq.token_ids
            known = next((c for c in self.continuations if c[:len(tokens)] == tokens), None)
            for j in range(run.want):
                n = len(tokens) + j
                token = known[n] if known is not None and n < len(known) else self.rng.randrange(self.vocab)
                if self.rng.random() < self.wrong:
                    token = (token + 1 + self.rng.randrange(self.vocab - 1)) % self.vocab
                seq.draft.append(token)
            self.proposed += run.want
