"""API keys and the tenants they name: who is asking, so tenants never share a cached page.

A tenant is an id (`[A-Za-z0-9._-]`, 1 to 64 characters) with one or more keys (several: a key
being rotated). Keys come from, all together:
- `--api-key` values (repeatable; `api_keys` in app args): `TENANT:KEY`, or a bare `KEY` of the
  tenant `default` (a value with a `:` is always read as `TENANT:KEY`);
- `CAIRN_API_KEY`, when nothing else gives keys: one bare key, the tenant `default`;
- a keys file (`--api-keys-file`): one `TENANT:KEY` per line, blank lines and `#` comments
  ignored. Errors name the line, never the key.
No key may belong to two tenants. Keys are kept only as SHA-256 digests and compared in
constant time: `tenant_of` hashes the token, compares it with every key's digest with
`hmac.compare_digest` and stops early for none, so neither timing nor length tells a guess
apart. No key is ever logged or put in a message.

What a request may see (`routes.build_app`): /v1 needs a tenant's key, and the handler reads
`request.state.tenant_id` (who) and `request.state.tenant` (whose cache: the tenant id, which
roots its page hashes, or None for all when `shared_cache_tenants` is set). /openapi.json needs
a tenant's key or the metrics key; /metrics needs the metrics key if one is set, else a tenant's
key; /health is always open. With no keys at all, everything is open.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import re
from collections.abc import Iterable
from pathlib import Path

DEFAULT_TENANT = "default"
TENANT_ID = re.compile(r"[A-Za-z0-9._-]{1,64}")


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


class Tenants:
    """Tenant ids by API key (kept as digests)."""

    def __init__(self, keys: Iterable[tuple[str, str]] = ()):
        """`keys`: (tenant id, key) pairs."""
        self._digests: list[tuple[bytes, str]] = []
        seen: dict[bytes, str] = {}
        for n, (tenant, key) in enumerate(keys, 1):
            if not TENANT_ID.fullmatch(tenant):
                raise ValueError(f"API key {n}: tenant id {tenant!r} is not 1 to 64 of [A-Za-z0-9._-]")
            if not key or key != key.strip():
                raise ValueError(f"API key {n} (tenant {tenant}): empty, or starts or ends with whitespace")
            digest = _digest(key)
            if seen.get(digest, tenant) != tenant:
                raise ValueError(f"API key {n}: the same key is given to tenants {seen[digest]} and {tenant}")
            seen[digest] = tenant
            self._digests.append((digest, tenant))

    @classmethod
    def load(cls, api_keys: str | Iterable[str] | None = None, keys_file: str | Path | None = None,
             environ: dict[str, str] | None = None) -> "Tenants":
        """The tenants of `api_keys` (`TENANT:KEY` or bare `KEY` values) and `keys_file`; with
        neither, `CAIRN_API_KEY` (from `environ`, default os.environ) as the tenant `default`."""
        values = [api_keys] if isinstance(api_keys, str) else list(api_keys or ())
        pairs = [parse_key(v) for v in values]
        if keys_file is not None:
            pairs += read_keys_file(keys_file)
        if not pairs:
            env_key = (os.environ if environ is None else environ).get("CAIRN_API_KEY") or None
            if env_key is not None:
                pairs = [(DEFAULT_TENANT, env_key)]
        return cls(pairs)

    def __bool__(self) -> bool:
        return bool(self._digests)

    def __len__(self) -> int:
        return len(self._digests)

    def __repr__(self) -> str:  # never the keys
        return f"Tenants({len(set(t for _, t in self._digests))} tenants, {len(self._digests)} keys)"

    @property
    def ids(self) -> frozenset[str]:
        return frozenset(t for _, t in self._digests)

    def tenant_of(self, token: str) -> str | None:
        """The tenant whose key `token` is, or None; in time independent of which key matched."""
        digest, found = _digest(token), None
        for known, tenant in self._digests:
            if hmac.compare_digest(digest, known):
                found = tenant
        return found


def parse_key(value: str) -> tuple[str, str]:
    """`TENANT:KEY` -> (tenant, key); a bare `KEY` -> ("default", key)."""
    tenant, sep, key = value.partition(":")
    return (tenant, key) if sep else (DEFAULT_TENANT, value)


def read_keys_file(path: str | Path) -> list[tuple[str, str]]:
    """(tenant, key) pairs of a keys file: `TENANT:KEY` per line; `#` comments, blank lines."""
    pairs = []
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        tenant, sep, key = line.partition(":")
        if not sep or not tenant.strip() or not key.strip():
            raise ValueError(f"{path}:{n}: expected TENANT:KEY")
        pairs.append((tenant.strip(), key.strip()))
    return pairs
