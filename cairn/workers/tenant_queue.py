"""The waiting sequences, by tenant, and the shares of one step among tenants: `TenantQueue`,
`fair_shares`.

A shared engine serves tenants (the `tenant` a request carries; None is one tenant for all) who
must not starve each other, so the scheduler asks here whose turn it is:
- `TenantQueue` keeps each tenant's waiting sequences in arrival order (a preempted one goes back
  to the head of its own tenant's queue). `head(running)` is the next to admit: the head of the
  queue of the tenant running the fewest sequences, the earliest arrival among equals. With one
  tenant that is first come, first served; with `budgets`, only tenants with tokens left count.
- `fair_shares(demands, budget)` splits a step's token budget max-min fairly (water-filling): a
  tenant asking less than an equal share gets what it asks, the rest is split among the others.
- `slot_share(tenants, max_num_seqs)` is the sequence slots each tenant with work is owed; the
  scheduler preempts, one a step, the newest sequence of a tenant above it for a tenant below it.
- `share_among_tenants(...)` is a step's sharing, with more than one tenant at work: the slots
  first (the preemptions above), then the step's tokens by `fair_shares`; `fair_order(running)`
  serves running sequences with tenants taking turns.
Plain Python over sequences; no torch.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping

from cairn.workers.sequence import Sequence


class TenantQueue:
    def __init__(self) -> None:
        self._queues: dict[str | None, deque[Sequence]] = {}
        self._len = 0

    def append(self, seq: Sequence) -> None:
        self._queues.setdefault(seq.tenant, deque()).append(seq)
        self._len += 1

    def appendleft(self, seq: Sequence) -> None:
        self._queues.setdefault(seq.tenant, deque()).appendleft(seq)
        self._len += 1

    def remove(self, seq: Sequence) -> None:
        """Raises ValueError if `seq` is not waiting."""
        queue = self._queues.get(seq.tenant)
        if queue is None:
            raise ValueError("not waiting")
        queue.remove(seq)
        self._len -= 1
        if not queue:
            del self._queues[seq.tenant]

    def head(self, running: Mapping[str | None, int],
             budgets: Mapping[str | None, int] | None = None) -> Sequence | None:
        """The next sequence to admit, given how many sequences each tenant runs; with `budgets`,
        only of a tenant with tokens left in it (None: none has)."""
        best, best_key = None, None
        for tenant, queue in self._queues.items():
            if budgets is not None and budgets.get(tenant, 0) <= 0:
                continue
            key = (running.get(tenant, 0), queue[0].arrival)
            if best_key is None or key < best_key:
                best, best_key = queue[0], key
        return best

    def tenants(self) -> Iterable[str | None]:
        return self._queues.keys()

    def by_tenant(self) -> Mapping[str | None, deque[Sequence]]:
        """Each tenant's waiting sequences, in order (read, never written, by the caller)."""
        return self._queues

    def __len__(self) -> int:
        return self._len

    def __bool__(self) -> bool:
        return self._len > 0

    def __iter__(self) -> Iterator[Sequence]:
        for queue in list(self._queues.values()):
            yield from queue


def fair_shares(demands: Mapping[str | None, int], budget: int) -> dict[str | None, int]:
    """Max-min fair split of `budget` tokens among tenants asking `demands` tokens."""
    shares: dict[str | None, int] = {}
    pending = sorted(demands, key=lambda t: demands[t])
    left = budget
    while pending:
        each = left // len(pending)
        tenant = pending[0]
        if demands[tenant] <= each:
            shares[tenant] = demands[tenant]
            left -= demands[tenant]
            pending.pop(0)
            continue
        extra = left - each * len(pending)  # the remainder, one token each to the first
        for k, tenant in enumerate(pending):
            shares[tenant] = each + (1 if k < extra else 0)
        break
    return shares


def slot_share(tenants: int, max_num_seqs: int) -> int:
    """Sequence slots each of `tenants` tenants with work is owed (at least one)."""
    return max(1, max_num_seqs // max(1, tenants))


def running_by_tenant(running: Iterable[Sequence]) -> dict[str | None, int]:
    counts: dict[str | None, int] = {}
    for seq in running:
        counts[seq.tenant] = counts.get(seq.tenant, 0) + 1
    return counts


def share_among_tenants(running: list[Sequence], waiting: TenantQueue, max_num_seqs: int, budget: int,
                        preempt: Callable[[Sequence], None]) -> dict[str | None, int] | None:
    """With more than one tenant at work: first, when every sequence slot is taken, each tenant
    with waiting work below its share of the slots takes one from the tenant most above its share
    (its newest sequence is preempted, by `preempt`); then the step's token `budget` is split
    max-min fairly by what each tenant could compute now. None with one tenant."""
    tenants = {seq.tenant for seq in running}
    tenants.update(waiting.tenants())
    if len(tenants) <= 1:
        return None
    counts = running_by_tenant(running)
    if waiting and len(running) >= max_num_seqs:
        share = slot_share(len(tenants), max_num_seqs)
        for needy in sorted((t for t in waiting.tenants() if counts.get(t, 0) < share),
                            key=lambda t: counts.get(t, 0)):
            rich = max(counts, key=counts.__getitem__)
            if counts[rich] <= share:
                break
            preempt(next(seq for seq in reversed(running) if seq.tenant == rich))
            counts[rich] -= 1
    demands: dict[str | None, int] = {}
    for seq in running:
        if not seq.paused:
            demands[seq.tenant] = demands.get(seq.tenant, 0) + min(seq.num_uncomputed, budget)
    free = max_num_seqs - len(running)
    if free > 0:
        for tenant, queue in waiting.by_tenant().items():
            ask = sum(seq.num_uncomputed for _, seq in zip(range(free), queue))
            demands[tenant] = demands.get(tenant, 0) + ask
    return fair_shares({t: min(d, budget) for t, d in demands.items()}, budget)


def fair_order(running: list[Sequence]) -> list[Sequence]:
    """Running sequences, tenants taking turns, each tenant's oldest first: its last is the newest
    sequence of the tenant running the most, the first a page shortage preempts."""
    by_tenant: dict[str | None, list[Sequence]] = {}
    for seq in running:
        by_tenant.setdefault(seq.tenant, []).append(seq)
    queues = list(by_tenant.values())
    return [q[k] for k in range(max(map(len, queues), default=0)) for q in queues if k < len(q)]
