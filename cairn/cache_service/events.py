"""What a worker tells the index about its cache, and the versioned msgpack form it travels in.

Design rule 8: every change of what a worker holds is an event; the engine loop drains them into
`EventBatch`es numbered 0, 1, 2, ... per worker (`EventStream`). Hashes are the 16-byte page
hashes of `cairn.cache_service.hashing`; a state is keyed by the hash of the page it ends.

The contract with the index (`cairn.cache_service.index.CacheIndex`):
- Batches of one worker are applied in seq order. A missing seq (a gap) means the index no longer
  knows what the worker holds: it stops trusting that worker and asks for a resync.
- A batch whose first event is `AllCleared` is a snapshot: a full, self-contained picture of the
  worker, accepted at any seq. The worker answers a resync request with `EventStream.snapshot`.
- A worker that (re)starts opens its stream with a snapshot (an empty one is just AllCleared), so
  an index that knew an earlier life of the same worker id forgets it.

Media (design rule 8, and the host tier of `cairn.workers.cache.host_tier`): a worker keeps what it holds
on its device or, demoted there, in its host memory. A page or state is resident on a worker in
exactly one medium; `PagesStored` / `StateStored` name it (`DEVICE` or `HOST`), and storing one
that is already resident in the other medium moves it there (a demotion or a promotion).
Removing one removes it from whichever medium holds it.

Wire form (EVENTS_VERSION = 2): a msgpack array
    [version, worker_id, seq, ts, [[tag, field, ...], ...]]
with hashes as msgpack bin and a medium as an int (0 device, 1 host). Tags: 0 PagesStored
[0, hashes, parent|nil, medium], 1 PagesRemoved [1, hashes], 2 StateStored [2, hash, medium],
3 StateRemoved [3, hash], 4 AllCleared [4]. Version 1 (a worker from before the host tier) is
read too: its PagesStored and StateStored have no medium field and mean the device.
`EventBatch.decode` refuses anything else (garbage, truncation, another version, a wrong-typed
field, an unknown tag or medium, a hash that is not 16 bytes) with `EventDecodeError`, and with
no other exception type: bytes from the network cannot crash the index.
"""

from __future__ import annotations

import reprlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import msgpack

from cairn.cache_service.hashing import DIGEST_BYTES

EVENTS_VERSION = 2
READABLE_VERSIONS = (1, 2)

DEVICE, HOST = "device", "host"  # where a worker holds a page or state (the medium)
MEDIA = (DEVICE, HOST)  # wire form: the index in this tuple


class EventDecodeError(ValueError):
    """The bytes are not a version-1 event batch. The sender is at fault; nothing was applied."""


@dataclass(frozen=True)
class PagesStored:
    """Consecutive pages of one chain, in order; `parent` is the hash of the page before
    hashes[0] (None: hashes[0] is the first page of its chain). `medium`: where they now are."""
    hashes: tuple[bytes, ...]
    parent: bytes | None = None
    medium: str = DEVICE


@dataclass(frozen=True)
class PagesRemoved:
    hashes: tuple[bytes, ...]


@dataclass(frozen=True)
class StateStored:
    """A recurrent-state checkpoint at the end of page `page_hash`, now in `medium`."""
    page_hash: bytes
    medium: str = DEVICE


@dataclass(frozen=True)
class StateRemoved:
    page_hash: bytes


@dataclass(frozen=True)
class AllCleared:
    """The worker dropped everything it held."""


Event = PagesStored | PagesRemoved | StateStored | StateRemoved | AllCleared

_PAGES_STORED, _PAGES_REMOVED, _STATE_STORED, _STATE_REMOVED, _ALL_CLEARED = range(5)
_ARITY = {2: {_PAGES_STORED: 3, _PAGES_REMOVED: 1, _STATE_STORED: 2, _STATE_REMOVED: 1, _ALL_CLEARED: 0},
          1: {_PAGES_STORED: 2, _PAGES_REMOVED: 1, _STATE_STORED: 1, _STATE_REMOVED: 1, _ALL_CLEARED: 0}}


def _encode_event(event: Event) -> list:
    match event:
        case PagesStored(hashes, parent, medium):
            return [_PAGES_STORED, list(hashes), parent, MEDIA.index(medium)]
        case PagesRemoved(hashes):
            return [_PAGES_REMOVED, list(hashes)]
        case StateStored(page_hash, medium):
            return [_STATE_STORED, page_hash, MEDIA.index(medium)]
        case StateRemoved(page_hash):
            return [_STATE_REMOVED, page_hash]
        case AllCleared():
            return [_ALL_CLEARED]
    raise TypeError(f"expected an Event, got {type(event).__name__}")


def _show(value: object) -> str:
    return reprlib.repr(value)  # bounded: a hostile batch must not make a huge error message


def _is_hash(value: object) -> bool:
    return type(value) is bytes and len(value) == DIGEST_BYTES


def _is_int(value: object) -> bool:
    return type(value) is int  # bool is an int subclass; a bool here is a wrong type


def _hashes(value: object) -> tuple[bytes, ...]:
    if type(value) is not list or not all(_is_hash(h) for h in value):
        raise EventDecodeError(f"expected a list of {DIGEST_BYTES}-byte hashes, got {_show(value)}")
    return tuple(value)


def _hash(value: object) -> bytes:
    if not _is_hash(value):
        raise EventDecodeError(f"expected a {DIGEST_BYTES}-byte hash, got {_show(value)}")
    return value


def _medium(fields: list, at: int) -> str:
    """The medium field at `at`, or the device where the version has none."""
    if len(fields) <= at:
        return DEVICE
    value = fields[at]
    if not _is_int(value) or not 0 <= value < len(MEDIA):
        raise EventDecodeError(f"expected a medium 0..{len(MEDIA) - 1}, got {_show(value)}")
    return MEDIA[value]


def _decode_event(item: object, version: int) -> Event:
    if type(item) is not list or not item or not _is_int(item[0]):
        raise EventDecodeError(f"expected an event [tag, field, ...], got {_show(item)}")
    tag, fields, arity = item[0], item[1:], _ARITY[version]
    if tag not in arity:
        raise EventDecodeError(f"unknown event tag {tag}")
    if len(fields) != arity[tag]:
        raise EventDecodeError(f"event tag {tag} expects {arity[tag]} fields, got {len(fields)}")
    if tag == _PAGES_STORED:
        parent = None if fields[1] is None else _hash(fields[1])
        return PagesStored(_hashes(fields[0]), parent, _medium(fields, 2))
    if tag == _PAGES_REMOVED:
        return PagesRemoved(_hashes(fields[0]))
    if tag == _STATE_STORED:
        return StateStored(_hash(fields[0]), _medium(fields, 1))
    if tag == _STATE_REMOVED:
        return StateRemoved(_hash(fields[0]))
    return AllCleared()


@dataclass(frozen=True)
class EventBatch:
    worker_id: str
    seq: int
    ts: float
    events: tuple[Event, ...]

    @property
    def is_snapshot(self) -> bool:
        """The batch is a full, self-contained picture of the worker (it opens with AllCleared)."""
        return bool(self.events) and isinstance(self.events[0], AllCleared)

    def encode(self) -> bytes:
        body = [EVENTS_VERSION, self.worker_id, self.seq, self.ts, [_encode_event(e) for e in self.events]]
        return msgpack.packb(body, use_bin_type=True)

    @classmethod
    def decode(cls, data: bytes) -> EventBatch:
        try:
            body = msgpack.unpackb(data, raw=False, use_list=True, strict_map_key=True)
        except Exception as e:  # msgpack raises several unrelated types for bad input
            raise EventDecodeError(f"not a msgpack event batch: {type(e).__name__}: {e}") from None
        if type(body) is not list or len(body) != 5:
            raise EventDecodeError(f"expected [version, worker_id, seq, ts, events], got {_show(body)}")
        version, worker_id, seq, ts, events = body
        if not _is_int(version) or version not in READABLE_VERSIONS:
            raise EventDecodeError(f"expected events version {READABLE_VERSIONS}, got {_show(version)}")
        if type(worker_id) is not str or not worker_id:
            raise EventDecodeError(f"expected a non-empty worker_id string, got {_show(worker_id)}")
        if not _is_int(seq) or seq < 0:
            raise EventDecodeError(f"expected seq as an int >= 0, got {_show(seq)}")
        if type(ts) is not float and not _is_int(ts):
            raise EventDecodeError(f"expected ts as a number, got {_show(ts)}")
        if type(events) is not list:
            raise EventDecodeError(f"expected a list of events, got {_show(events)}")
        return cls(worker_id, seq, float(ts), tuple(_decode_event(e, version) for e in events))


class EventStream:
    """A worker's outgoing side: stamps its events into batches numbered 0, 1, 2, ..."""

    def __init__(self, worker_id: str, clock: Callable[[], float] = time.time):
        if not isinstance(worker_id, str) or not worker_id:
            raise ValueError(f"expected a non-empty worker_id string, got {worker_id!r}")
        self.worker_id = worker_id
        self._clock = clock
        self._next_seq = 0

    @property
    def next_seq(self) -> int:
        return self._next_seq

    def batch(self, events: Sequence[Event]) -> EventBatch:
        out = EventBatch(self.worker_id, self._next_seq, float(self._clock()), tuple(events))
        self._next_seq += 1
        return out

    def snapshot(self, pages: Sequence[tuple[bytes, bytes | None]], states: Sequence[bytes],
                 host_pages: Sequence[tuple[bytes, bytes | None]] = (), host_states: Sequence[bytes] = ()
                 ) -> EventBatch:
        """Everything the worker holds, as one self-contained batch: AllCleared, the pages as
        (hash, parent) pairs (runs where each page's parent is the previous page become one
        PagesStored; list parents before children to get long runs), then the states; first
        what is on the device, then what is on the host."""
        events: list[Event] = [AllCleared()]
        for medium, media_pages in ((DEVICE, pages), (HOST, host_pages)):
            run: list[bytes] = []
            run_parent: bytes | None = None
            for page_hash, parent in media_pages:
                if run and parent == run[-1]:
                    run.append(page_hash)
                    continue
                if run:
                    events.append(PagesStored(tuple(run), run_parent, medium))
                run, run_parent = [page_hash], parent
            if run:
                events.append(PagesStored(tuple(run), run_parent, medium))
        events.extend(StateStored(h) for h in states)
        events.extend(StateStored(h, HOST) for h in host_states)
        return self.batch(events)
