"""Attention KV pages: which page ids are free and who holds the rest.

Plain Python, no tensors: the runner owns the KV tensors, this pool owns the ids. A page is held
by reference count; `release` drops one reference per page, and a page whose count reaches zero
returns to the free queue. A sequence releases its pages tail first, so when cached pages join
this pool (prefix cache) the shared head of a chain is reused last.

A refused allocation is a result (`can_allocate` is False), never an exception: the scheduler
waits or preempts. Integrity: `free + held == total`, checked by `check()`.
"""

from __future__ import annotations

from collections import deque


class PagePool:
    def __init__(self, num_pages: int, page_size: int):
        if num_pages < 1:
            raise ValueError(f"num_pages must be >= 1, got {num_pages}")
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.num_pages = num_pages
        self.page_size = page_size
        self._free: deque[int] = deque(range(num_pages))
        self._refs: dict[int, int] = {}

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_held(self) -> int:
        return len(self._refs)

    def pages_for_tokens(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def can_allocate(self, num_pages: int) -> bool:
        return num_pages <= len(self._free)

    def allocate(self, num_pages: int) -> list[int]:
        if not self.can_allocate(num_pages):
            raise RuntimeError(f"allocate({num_pages}) with {len(self._free)} free pages; call can_allocate first")
        pages = [self._free.popleft() for _ in range(num_pages)]
        for p in pages:
            self._refs[p] = 1
        return pages

    def release(self, pages: list[int]) -> None:
        for p in reversed(pages):  # tail first
            refs = self._refs[p] - 1
            if refs:
                self._refs[p] = refs
            else:
                del self._refs[p]
                self._free.append(p)

    def check(self) -> None:
        if len(self._free) + len(self._refs) != self.num_pages or set(self._free) & set(self._refs):
            raise AssertionError(f"page pool corrupt: free={len(self._free)} held={len(self._refs)} "
                                 f"total={self.num_pages}")
