"""The page hash is a persistent format: the indexes in Redis and every replica's cache are keyed
by it. A golden vector, computed here without the hashing module or msgpack (the bytes are written
by hand from the documented layout), so that a change to the hash cannot silently orphan what is
persisted: changing it means bumping HASH_VERSION and this vector together."""

import hashlib

from cairn.cache_service.hashing import HASH_VERSION, page_hashes, root_hash


def blake(data: bytes) -> bytes:
    return hashlib.blake2b(data, digest_size=16).digest()


def fixstr(s: str) -> bytes:
    raw = s.encode()
    assert len(raw) < 32
    return bytes([0xA0 | len(raw)]) + raw


def by_hand(fingerprint: str, page_size: int, pages: list[list[int]]) -> list[bytes]:
    """msgpack by hand: ["cairn-pages", 1, fingerprint, page_size, nil] for the root, then
    [parent as bin 8, [token, ...]] per page (tokens under 128: positive fixints)."""
    assert HASH_VERSION == 1 and page_size < 128
    prev = blake(bytes([0x95]) + fixstr("cairn-pages") + bytes([0x01]) + fixstr(fingerprint) + bytes([page_size, 0xC0]))
    out = []
    for tokens in pages:
        assert len(tokens) < 16 and all(0 <= t < 128 for t in tokens)
        prev = blake(bytes([0x92, 0xC4, 16]) + prev + bytes([0x90 | len(tokens)]) + bytes(tokens))
        out.append(prev)
    return out


# fingerprint "golden-model", page size 4, no salt, no tenant; tokens 1..12 make three pages
GOLDEN_ROOT = "e86aa615de8ebc04ac43ce9c777700cd"
GOLDEN = ["308d2af5f3ce2c357e1ea7211ac8c225", "2befef64243574a605b028d72708268d", "7dbe2f9b96561adc265d703d2007c122"]


def test_the_page_hash_is_the_documented_format_and_the_golden_vector():
    tokens = list(range(1, 13))
    root = root_hash("golden-model", 4)
    got = page_hashes(tokens, 4, root)
    assert got == by_hand("golden-model", 4, [tokens[0:4], tokens[4:8], tokens[8:12]])
    assert root.hex() == GOLDEN_ROOT and [h.hex() for h in got] == GOLDEN
    assert page_hashes(tokens[:11], 4, root) == got[:2]  # a partial page has no hash
