"""The one page hash every process uses (design rule 1).

A chain over whole pages: a root from (model fingerprint, page size, cache_salt, tenant), then
h_i = H(h_{i-1}, tokens of page i), with H = blake2b (16-byte digest) over a msgpack encoding.
A hash names a page *and everything before it*, so equal hashes mean equal prefixes (up to a
2^-128 collision). Nothing here depends on the process, the machine or Python's `hash()`:
the ingress, every worker and the index compute identical values.

Partial pages have no chain hash: a prompt of n tokens has n // page_size page hashes. (A
sequence's last page kept for partial matches gets a key of its own, `partial_page_hash`, which
no prompt's chain contains.) Requests with
different `cache_salt` values, or from different tenants, get different roots, so they never
share a page.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import msgpack

DIGEST_BYTES = 16
WORD = 1 << 31  # tokens in [-WORD, WORD) roll into a sub-page key as 4 bytes
HASH_VERSION = 1


def _digest(payload: object) -> bytes:
    return hashlib.blake2b(msgpack.packb(payload, use_bin_type=True), digest_size=DIGEST_BYTES).digest()


def root_hash(model_fingerprint: str, page_size: int, cache_salt: str | None = None,
              tenant: str | None = None) -> bytes:
    """The chain's root: what a hash of page 0 builds on. `tenant` (who is asking, from the API
    key) and `cache_salt` (a subdivision the request chooses) each give chains of their own, so
    different tenants never share a page, in the engine, the index or the router."""
    parts = ["cairn-pages", HASH_VERSION, model_fingerprint, page_size, cache_salt]
    if tenant is not None:  # no tenant: the roots of deployments without keys stay what they were
        parts.append(["tenant", tenant])
    return _digest(parts)


def next_page_hash(parent: bytes, page_tokens: Sequence[int]) -> bytes:
    return _digest([parent, list(page_tokens)])


def partial_page_hash(parent: bytes, tokens: Sequence[int]) -> bytes:
    """The key of a partial page: a sequence's last page, kept with K/V for `tokens` (fewer than
    a page) after the page `parent` (a hash root before page 0). Tagged apart from
    `next_page_hash`, so it never names a whole page nor the sub-page checkpoint at its end."""
    return _digest(["cairn-partial", parent, list(tokens)])


def sub_state_keys(base: bytes, tokens: Sequence[int]) -> list[bytes]:
    """The index's names of the sub-page states after each of `tokens` inside a page: key t - 1
    names the state t tokens into the page whose chain continues from `base`
    (`branch_root(floor, root)`: the request's own root, as a sub-page checkpoint is keyed). A
    rolling hash, one short digest a token, so a router names every position of a page in one
    pass: k_0 = H(["cairn-sub", base]), k_t = blake2b(k_{t-1} + token as 4 little-endian bytes)
    (a key outside 32 bits, an image token's (cairn.workers.vision.image_input): 0xff then 8 bytes).
    The checkpoint store keys a sub-page checkpoint otherwise (`next_page_hash` of its tail)."""
    key = _digest(["cairn-sub", base])
    out = []
    for token in tokens:
        token = int(token)
        word = token.to_bytes(4, "little", signed=True) if -WORD <= token < WORD else \
            b"\xff" + token.to_bytes(8, "little", signed=True)  # an image's key: 9 bytes, no 4-byte one's
        key = hashlib.blake2b(key + word, digest_size=DIGEST_BYTES).digest()
        out.append(key)
    return out


def branch_root(shared_parent: bytes, root: bytes) -> bytes:
    """Where a chain leaves a prefix shared across roots: the parent of the first page after a
    public prefix (hashed under the shared root) is this, so every page after it is again the
    request's own (its tenant's, its salt's)."""
    return _digest(["cairn-branch", shared_parent, root])


def page_hashes(token_ids: Sequence[int], page_size: int, root: bytes, start: int = 0,
                parent: bytes | None = None) -> list[bytes]:
    """Hashes of whole pages `start`, `start+1`, ... of `token_ids` (units: pages).

    Continuing a chain: pass the hash of page `start - 1` as `parent` (root when start == 0).
    """
    prev = root if start == 0 else parent
    if prev is None:
        raise ValueError("page_hashes from start > 0 needs the parent hash of page start - 1")
    out = []
    for i in range(start, len(token_ids) // page_size):
        prev = next_page_hash(prev, token_ids[i * page_size:(i + 1) * page_size])
        out.append(prev)
    return out


def fingerprint(config: Mapping[str, Any], weight_files: Sequence[tuple[str, int]] = ()) -> str:
    """Names a model's behaviour: its config (as config.json holds it) and the (name, size) of its
    weight files. Every model fingerprint is made here, so pages of different models never meet."""
    return _digest([json.dumps(config, sort_keys=True, default=list), sorted(weight_files)]).hex()


def model_fingerprint(model_dir: str | Path) -> str:
    """The fingerprint of a checkpoint directory: its config.json and the names and sizes of its
    weight files. Two copies of the same checkpoint agree; a different model, or a retrained one
    with a different config, does not share pages."""
    model_dir = Path(model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    return fingerprint(config, [(p.name, p.stat().st_size) for p in model_dir.glob("*.safetensors")])
