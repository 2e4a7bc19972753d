"""Cache events survive the wire exactly, and nothing malformed gets past decode as anything but
EventDecodeError."""

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cairn.cache_service.events import (DEVICE, EVENTS_VERSION, HOST, MEDIA, AllCleared, EventBatch, EventDecodeError,
                                  EventStream, PagesRemoved, PagesStored, StateRemoved, StateStored)

hashes = st.binary(min_size=16, max_size=16)
hash_tuples = st.lists(hashes, max_size=8).map(tuple)
events = st.one_of(
    st.builds(PagesStored, hash_tuples, st.none() | hashes, st.sampled_from(MEDIA)),
    st.builds(PagesRemoved, hash_tuples),
    st.builds(StateStored, hashes, st.sampled_from(MEDIA)),
    st.builds(StateRemoved, hashes),
    st.builds(AllCleared),
)
batches = st.builds(
    EventBatch,
    worker_id=st.text(min_size=1, max_size=20),
    seq=st.integers(0, 2**64 - 1),
    ts=st.floats(allow_nan=False),
    events=st.lists(events, max_size=10).map(tuple),
)
H1, H2 = b"\x01" * 16, b"\x02" * 16


def good_body() -> list:
    return [EVENTS_VERSION, "w0", 3, 1.5, [[0, [H1, H2], None, 1], [1, [H1]], [2, H2, 0], [3, H2], [4]]]


def pack(body: object) -> bytes:
    return msgpack.packb(body, use_bin_type=True)


@given(batches)
def test_every_batch_round_trips_exactly(batch):
    assert EventBatch.decode(batch.encode()) == batch


def test_a_well_formed_body_decodes_to_every_event_type():
    batch = EventBatch.decode(pack(good_body()))
    assert batch == EventBatch("w0", 3, 1.5, (PagesStored((H1, H2), None, HOST), PagesRemoved((H1,)),
                                                StateStored(H2, DEVICE), StateRemoved(H2), AllCleared()))


def test_a_version_1_batch_from_a_worker_without_a_host_tier_means_the_device():
    body = [1, "w0", 3, 1.5, [[0, [H1, H2], None], [2, H2], [4]]]
    batch = EventBatch.decode(pack(body))
    assert batch.events == (PagesStored((H1, H2), None, DEVICE), StateStored(H2, DEVICE), AllCleared())
    body[4][0].append(1)  # version 1 has no medium field
    with pytest.raises(EventDecodeError):
        EventBatch.decode(pack(body))


@pytest.mark.parametrize("medium", [2, -1, "host", None, True, 1.0])
def test_an_unknown_medium_is_refused(medium):
    with pytest.raises(EventDecodeError):
        EventBatch.decode(pack(mutate((4, 0), [0, [H1], None, medium])))
    with pytest.raises(EventDecodeError):
        EventBatch.decode(pack(mutate((4, 2), [2, H2, medium])))


def test_the_wire_form_is_compact():
    batch = EventBatch("w0", 7, 0.0, (PagesStored(tuple(bytes([i]) * 16 for i in range(100)), None),))
    assert len(batch.encode()) < 100 * 18 + 40  # bin8 header (2 B) per hash, a few bytes of framing


@pytest.mark.parametrize("data", [b"", b"\xc1", b"\x93\x01\x02", b"not msgpack at all", "a str", None, 5])
def test_garbage_is_refused(data):
    with pytest.raises(EventDecodeError):
        EventBatch.decode(data)


def test_every_truncation_of_a_batch_is_refused():
    data = pack(good_body())
    for n in range(len(data)):
        with pytest.raises(EventDecodeError):
            EventBatch.decode(data[:n])


def test_trailing_bytes_are_refused():
    with pytest.raises(EventDecodeError):
        EventBatch.decode(pack(good_body()) + b"\x00")


@pytest.mark.parametrize("version", [0, 3, True, 1.0, "1", None])
def test_another_version_is_refused(version):
    body = good_body()
    body[0] = version
    with pytest.raises(EventDecodeError, match="version"):
        EventBatch.decode(pack(body))


def mutate(path: tuple, value: object) -> list:
    body = good_body()
    target = body
    for i in path[:-1]:
        target = target[i]
    target[path[-1]] = value
    return body


@pytest.mark.parametrize("path,value", [
    ((1,), 7), ((1,), b"w0"), ((1,), ""),          # worker_id
    ((2,), "3"), ((2,), -1), ((2,), 3.0), ((2,), True),  # seq
    ((3,), "1.5"), ((3,), None), ((3,), False),      # ts
    ((4,), {"a": 1}), ((4,), None),                  # events
    ((4, 0), [0, H1, None, 0]),                      # hashes not a list
    ((4, 0), [0, [H1, "x" * 16], None, 0]),          # a hash that is a str
    ((4, 0), [0, [H1, b"short"], None, 0]),          # a hash of the wrong length
    ((4, 0), [0, [H1], b"short", 0]),                # bad parent
    ((4, 0), [0, [H1], None]),                       # missing field (the medium)
    ((4, 1), [1, [H1], None]),                       # extra field
    ((4, 2), [2, [H2], 0]),                          # state hash inside a list
    ((4, 2), [2, H2]),                               # no medium
    ((4, 3), [3, None]),
    ((4, 4), [4, 0]),
    ((4, 4), []), ((4, 4), "AllCleared"), ((4, 4), [True]),  # not [tag, ...]
])
def test_a_wrong_typed_field_is_refused(path, value):
    with pytest.raises(EventDecodeError):
        EventBatch.decode(pack(mutate(path, value)))


@pytest.mark.parametrize("tag", [5, -1, 99, 2**40])
def test_an_unknown_tag_is_refused(tag):
    with pytest.raises(EventDecodeError, match="unknown event tag"):
        EventBatch.decode(pack(mutate((4, 4), [tag])))


def test_a_top_level_that_is_not_a_five_element_array_is_refused():
    for body in [good_body()[:4], good_body() + [0], {"v": 1}, 1, "x", None]:
        with pytest.raises(EventDecodeError):
            EventBatch.decode(pack(body))


msgpack_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**63, 2**64 - 1) | st.floats() | st.text(max_size=5)
    | st.binary(max_size=20) | st.sampled_from([H1, 0, 1, 4, EVENTS_VERSION]),
    lambda inner: st.lists(inner, max_size=6) | st.dictionaries(st.text(max_size=3), inner, max_size=3),
    max_leaves=30,
)


@settings(max_examples=300)
@given(st.binary(max_size=64) | msgpack_values.map(pack)
       | st.lists(msgpack_values, min_size=5, max_size=5).map(lambda b: pack([EVENTS_VERSION] + b[1:])))
def test_decode_raises_nothing_but_event_decode_error(data):
    try:
        assert isinstance(EventBatch.decode(data), EventBatch)
    except EventDecodeError:
        pass


def test_a_stream_numbers_its_batches_from_zero():
    stream = EventStream("w0", clock=lambda: 42.0)
    first, second = stream.batch([StateStored(H1)]), stream.batch([])
    assert (first.seq, second.seq) == (0, 1)
    assert first == EventBatch("w0", 0, 42.0, (StateStored(H1),))
    assert not first.is_snapshot and not second.is_snapshot


def test_a_snapshot_opens_with_all_cleared_and_coalesces_chain_runs():
    stream = EventStream("w0", clock=lambda: 0.0)
    stream.batch([])
    a, b, c, x, y = (bytes([i]) * 16 for i in range(5))
    snap = stream.snapshot([(a, None), (b, a), (c, b), (x, b), (y, None)], states=[c, x])
    assert snap.seq == 1 and snap.is_snapshot
    assert snap.events == (AllCleared(), PagesStored((a, b, c), None), PagesStored((x,), b),
                           PagesStored((y,), None), StateStored(c), StateStored(x))


def test_a_snapshot_lists_the_device_then_the_host():
    a, b, c, x = (bytes([i]) * 16 for i in range(4))
    snap = EventStream("w0", clock=lambda: 0.0).snapshot([(a, None), (b, a)], [a], host_pages=[(c, b), (x, c)],
                                                         host_states=[x])
    assert snap.events == (AllCleared(), PagesStored((a, b), None), PagesStored((c, x), b, HOST),
                           StateStored(a), StateStored(x, HOST))


def test_an_empty_snapshot_is_just_all_cleared():
    snap = EventStream("w0").snapshot([], [])
    assert snap.events == (AllCleared(),) and snap.is_snapshot and snap.seq == 0


def test_events_nobody_drains_are_bounded_and_the_next_drain_is_a_snapshot(tiny_model_dir, monkeypatch):
    from cairn.cache_service.index import CacheIndex
    from cairn.workers import Engine, SamplingParams
    from cairn.workers.cache.event_queue import EventQueue

    monkeypatch.setattr(EventQueue, "MAX_QUEUED", 8)
    engine = Engine.from_pretrained(tiny_model_dir, num_pages=256)
    engine.drain_events()  # the introduction
    engine.generate([list(range(20 + i, 80 + i)) for i in range(6)], SamplingParams(max_tokens=2))
    assert len(engine.cache.events) <= 8, "an engine nobody drains does not grow"
    batch = engine.drain_events()
    assert batch.is_snapshot, "events were dropped: the index must be told everything again"
    pages, states = engine.cache.snapshot()
    index = CacheIndex()
    index.apply(batch)
    assert index.contents(engine.events.worker_id) == (frozenset(h for h, _ in pages), frozenset(states))
