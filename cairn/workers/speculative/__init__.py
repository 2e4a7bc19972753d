"""Speculative decoding: who drafts, what a verify step keeps, what is counted. This package is
its room: `drafts` (the runs the drafter sees, the drafter protocol, held-back passes), `mtp_drafter`
(the engine's drafter, the checkpoint's MTP head), `draft_sampling` (drafts drawn by the rows' own
rules, rejection sampling), `verify_slots` (the spare state slots a verify segment takes and
settles), `acceptance` (which drafted tokens stand: the rule, once), `verifier` (a verify step's
second half, which the engine hands its scheduler, sampler and runner), `gate` (when drafts pay),
`totals` (what is counted).

With `EngineOptions.num_speculative_tokens` k > 0, a running sequence carries up to k tokens
drafted after its last one (`Sequence.draft`). The scheduler makes its next decode a verify
segment: that token and the drafted ones, computed in one forward with the other sequences'
prefills and decodes, each position sampled (`cairn.workers.plan.Segment.drafts`), the state
after each offset kept in a free slot (`verify_slots.take_states`). Then:

1. `acceptance.kept_tokens`: every row is sampled as the sequence's output token of its index
   would be without speculation (the sampler's rules, and its uniform at (key, output index): the
   request's seed, or the key the sampler gave the sequence; `Sampler.sample`'s `offsets`); the
   drafted tokens equal to the draws before them stand, then the first draw that differs (or the
   bonus after all of them): the rule of one-at-a-time decoding over the draws, on the host
   (tests/support/acceptance_oracle.py holds a batched torch form of it as the tests' oracle).
   The drafts are drawn by the row's own rules from the head's logits (`Sampler.draft_tokens`,
   `draft_sampling`; a greedy row's is the argmax):
   - a seeded row's with the uniform its verify row draws with: every output token is then the
     very draw k = 0 makes at its index, and a seeded request gives its k = 0 tokens wherever the
     logits are the same; a draft stands where the head's and the target's inverse CDFs agree at
     that uniform;
   - an unseeded row's with a uniform of its own, from the head's distribution q, which its
     verify row tests by rejection sampling (the draft d kept with probability min(1, p(d) /
     q(d)); else a draw from the residual max(0, p - q), which never draws d, so the rule above
     ends there): each token is distributed as the target's, and a draft stands at sum(min(p,
     q)), the most any test can keep.
   The tokens kept also end at the first that stops the sequence (a stop id, EOS, its length).
2. `verify_slots.settle`: the segment ends after its kept tokens; the state after its last kept
   token is copied back into the sequence's slot from the slot that kept it (the rollback), the
   checkpoints at the page boundaries the kept tokens reach are planned then, and the other
   slots go back. K/V written for rejected positions lies past the sequence's computed tokens:
   the next step writes those positions again, and no page holding them is whole, so none is
   registered. The prefix cache, its tiers and the router see only kept tokens.
3. The drafter proposes the next drafts (`Drafter.propose`): the engine's is the checkpoint's
   MTP head (cairn.workers.speculative.mtp_drafter), which also runs over every position the step
   kept (its own K/V at them). It runs when the next step begins, after the step's tokens went
   out (`Verifier.propose`): a prompt's first token does not wait for the head's pass over it,
   nor, for a prompt computed over several steps, over its earlier chunks (`held_back`).

When drafts are worth it is measured (`gate.SpeculationGate`, `EngineOptions.speculative_adaptive`):
the engine drafts only while decode steps with drafts give more tokens per second than steps
without, at the current number of running sequences. Drafts never take a prompt's tokens: a
step verifies them beside prompt chunks only where the token budget held every chunk whole
(`verify_slots.take_states`).

Every row drafts, whatever its sampling parameters: a drafted row is sampled as its output
index would be, after the drafted tokens before it (they are its output there, if it is kept at
all): penalties count them (`TokenCounts.scratch`; the kept ones are counted after the step), a
grammar's matcher steps through them and rolls back (`Grammars.mask`'s `draft`). What a step
counts: `totals.SpeculationTotals`, vLLM's numbers (drafts, drafted tokens, accepted tokens in all
and by position; mean acceptance length = 1 + accepted / drafts).
"""
