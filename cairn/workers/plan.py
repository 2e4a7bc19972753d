"""What one engine step computes, copies and stores: the scheduler writes a `StepPlan`, the
runner carries it out, the scheduler's `postprocess` reads it back. Plain data, no torch.

- `Segment`: one sequence's tokens this step (a decode is a segment of one), with the offsets
  inside it where a state is to be taken (`ckpt_slots`). A verify segment (speculative decoding,
  cairn.workers.speculative) is a decode followed by `drafts` drafted tokens (`Sequence.draft`): it
  samples at each of its 1 + drafts positions, and its states after each offset are kept in
  `states` until the scheduler knows how many of its tokens stand (cairn.workers.speculative.verify_slots.settle).
- `Commit`: a state the step leaves in a checkpoint slot, stored after the step.
- `PageTableWrite`: a change to one row of the runner's page table (pages taken, a twin's page
  swapped in), applied before the step.
- `BlockCopy`: one arena block copied before the step (`kind` says between which tiers; the
  runner makes them in order, first of all).
- `Commit.slot` and checkpoint slots are `cairn.workers.slot.Slot`s: a device slot (an int) or a
  `HostSlot` (host blocks), so no id's sign means anything.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

from cairn.workers.slot import Slot

if TYPE_CHECKING:
    from cairn.workers.sequence import Sequence

# BlockCopy kinds: from which blocks to which
MOVE = "move"        # device -> device: a cached page moved to empty an arena group
COPY = "copy"        # device -> device: a cached page's K/V, the head of a new page (copy-on-write)
DEMOTE = "demote"    # device -> host: evicted from the device, kept on the host
PROMOTE = "promote"  # host -> device: brought back for a request
IMPORT = "import"    # staging row -> device: fetched from a peer (cairn.workers.cache.transfer)
IMPORT_HOST = "import_host"  # staging row -> host: fetched, no device room (cairn.workers.cache.host_adoption)
COPY_KINDS = (MOVE, COPY, DEMOTE, PROMOTE, IMPORT, IMPORT_HOST)


class BlockCopy(NamedTuple):
    kind: str  # one of COPY_KINDS
    src: int  # block (or staging row, for IMPORT) read
    dst: int  # block written


@dataclass(slots=True)
class PageTableWrite:
    row: int  # the sequence's row of the runner's page table
    start: int  # index (pages) of the first page written
    page_ids: list[int]


@dataclass(slots=True)
class Segment:
    seq: Sequence
    start: int  # tokens computed before this step
    num_tokens: int  # tokens computed in this step
    ckpt_slots: dict[int, list[int]] = field(default_factory=dict)  # offset inside -> slots to fill
    drafts: int = 0  # drafted tokens after its first one (`seq.draft[:drafts]`), each sampled at
    verify: bool = False  # a speculating sequence's decode: its checkpoints wait for `verify_slots.settle`
    states: list[int] = field(default_factory=list)  # slots taking the state after offsets 1..drafts

    @property
    def end(self) -> int:
        return self.start + self.num_tokens

    @property
    def samples(self) -> bool:
        return self.end - self.drafts == self.seq.num_tokens


@dataclass
class Commit:
    seq: Sequence
    slot: Slot
    position: int  # tokens the state has seen (a page boundary, or inside a page: sub-page)
    kinds: set[str]


@dataclass
class StepPlan:
    decodes: list[Segment] = field(default_factory=list)
    prefills: list[Segment] = field(default_factory=list)
    fresh_state_slots: list[int] = field(default_factory=list)  # zero these before the step
    restores: list[tuple[int, int]] = field(default_factory=list)  # (checkpoint slot, seq slot), before
    snapshots: list[tuple[int, int]] = field(default_factory=list)  # (seq slot, checkpoint slot), after
    host_snapshots: list[tuple[int, tuple[int, ...]]] = field(default_factory=list)  # (seq slot, host blocks), after
    commits: list[Commit] = field(default_factory=list)  # checkpoints to store after the step
    preempted: list[Sequence] = field(default_factory=list)
    page_table_writes: list[PageTableWrite] = field(default_factory=list)  # apply before the step
    block_copies: list[BlockCopy] = field(default_factory=list)  # first of all, in order
    promotions_for_now: bool = False  # a segment of this step reads what this step promotes from the host
    # planned ahead (async scheduling): decodes reaching a page boundary, whose checkpoints are
    # planned once the tokens before them are read (`async_scheduling.plan_deferred`)
    deferred: list[Segment] = field(default_factory=list)
    lookahead: list[Sequence] = field(default_factory=list)  # decodes whose next page waits likewise

    @property
    def segments(self) -> list[Segment]:
        return self.decodes + self.prefills

    @property
    def prefilling(self) -> bool:
        """A segment of it computes more than a decode (a verify segment, a decode with its drafts,
        is not a prefill)."""
        return any(not s.verify for s in self.prefills)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.segments)

    def drop(self, seq: Sequence, state_slot: int | None, checkpoint_slots: set[Slot]) -> None:
        """Removes everything of `seq` from this plan (it failed while the plan was made):
        its segment, and the copies into or out of its state slot or its checkpoint slots."""
        self.decodes = [s for s in self.decodes if s.seq is not seq]
        self.prefills = [s for s in self.prefills if s.seq is not seq]
        self.commits = [c for c in self.commits if c.seq is not seq]
        touched = checkpoint_slots | ({state_slot} if state_slot is not None else set())
        self.restores = [(a, b) for a, b in self.restores if b not in touched]
        self.snapshots = [(a, b) for a, b in self.snapshots if a not in touched and b not in touched]
        self.host_snapshots = [(a, b) for a, b in self.host_snapshots if a not in touched]
        self.fresh_state_slots = [slot for slot in self.fresh_state_slots if slot not in touched]

    def sampling_sequences(self) -> list[Sequence]:
        """The sequences whose segment reaches their last token: they sample, in plan order."""
        return [s.seq for s in self.decodes + self.prefills if s.samples]

    def sampling_rows(self) -> list[tuple[Sequence, int]]:
        """(sequence, offset) of every row the step samples, in the order of its logits: one per
        sampling segment, 1 + drafts for a verify segment (offset: its output tokens before the
        row's, past those the sequence has)."""
        return [(s.seq, j) for s in self.decodes + self.prefills if s.samples for j in range(s.drafts + 1)]

    def __bool__(self) -> bool:
        return bool(self.decodes or self.prefills)
