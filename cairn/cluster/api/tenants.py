"""API keys and the tenants they name: who is asking, so tenants never share a cached page.

A tenant is an id (`[A-Za-z0-9._-]`, 1 to 64 characters) with one or more keys (several: a key
being rotated). Keys come from, all together:
- `--api-key` values (repeatable; `api_keys` in app args): `TENANT:KEY`, or a bare `KEY`, which
  is a tenant of its own: `key-` and 12 hex digits of a hash of the key (`bare_tenant_id`), never
  the key (a value with a `:` is always read as `TENANT:KEY`; one name given to two keys is one
  tenant, on purpose);
- `CAIRN_API_KEY`, when nothing else gives keys: one bare key, the tenant `default`;
- a keys file (`--api-keys-file`): one `TENANT:KEY` per line, then, optionally and separated by
  whitespace, that tenant's limits as `NAME=VALUE` (`cairn.cluster.api.quotas.TenantLimits`:
  `requests_per_minute=60 tokens_per_minute=200000`); blank lines and `#` comments ignored.
  Errors name the line, never the key. A key holds no whitespace;
- digests (`api_key_digests`: `TENANT:sha256:HEX`, what `Tenants.digests()` writes): how keys
  travel through Ray Serve, which logs every application argument (`cairn serve` and
  `cairn.cluster.app.build_application` turn keys into digests before Serve sees them).
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
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cairn.cluster.api.quotas import LIMIT_FIELDS

DEFAULT_TENANT = "default"
TENANT_ID = re.compile(r"[A-Za-z0-9._-]{1,64}")
DIGEST = re.compile(r"sha256:([0-9a-f]{64})")


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


def key_digest(key: str) -> str:
    """The form a key travels in: `sha256:` and the hex digest."""
    return "sha256:" + _digest(key).hex()


def bare_tenant_id(key: str) -> str:
    """The tenant id of a key given without one: derived from the key by a hash of its own (not the
    key's digest), so neither the id nor a metric labelled with it gives the key away."""
    return "key-" + hashlib.sha256(b"cairn tenant id\0" + key.encode()).hexdigest()[:12]


@dataclass(frozen=True)
class Caller:
    """Who asks one request: `tenant_id` (None without keys) for quotas, fair scheduling and
    metrics, and `cache`, the tenant whose page hashes it roots (None: shared by all)."""

    tenant_id: str | None = None
    cache: str | None = None

    @property
    def label(self) -> str:
        """The tenant's name in metrics: its id, or `default` without keys."""
        return self.tenant_id or DEFAULT_TENANT


class Tenants:
    """Tenant ids by API key (kept as digests), and the limits given beside the keys."""

    def __init__(self, keys: Iterable[tuple[str, str]] = (), digests: Iterable[tuple[str, str]] = (),
                 limits: Mapping[str, Mapping[str, Any]] | None = None):
        """`keys`: (tenant id, key) pairs; `digests`: (tenant id, `sha256:HEX`) pairs; `limits`:
        per tenant id, `TenantLimits` fields."""
        self._digests: list[tuple[bytes, str]] = []
        self.limits = {t: dict(v) for t, v in (limits or {}).items()}
        seen: dict[bytes, str] = {}

        def add(n: int, tenant: str, digest: bytes) -> None:
            if not TENANT_ID.fullmatch(tenant):
                raise ValueError(f"API key {n}: tenant id {tenant!r} is not 1 to 64 of [A-Za-z0-9._-]")
            if seen.get(digest, tenant) != tenant:
                raise ValueError(f"API key {n}: the same key is given to tenants {seen[digest]} and {tenant}")
            seen[digest] = tenant
            self._digests.append((digest, tenant))

        n = 0
        for n, (tenant, key) in enumerate(keys, 1):
            if not key or key != key.strip():
                raise ValueError(f"API key {n} (tenant {tenant}): empty, or starts or ends with whitespace")
            add(n, tenant, _digest(key))
        for m, (tenant, digest) in enumerate(digests, n + 1):
            found = DIGEST.fullmatch(digest)
            if found is None:
                raise ValueError(f"API key {m} (tenant {tenant}): a digest is sha256: and 64 lowercase hex digits")
            add(m, tenant, bytes.fromhex(found.group(1)))

    @classmethod
    def load(cls, api_keys: str | Iterable[str] | None = None, keys_file: str | Path | None = None,
             environ: dict[str, str] | None = None, api_key_digests: Iterable[str] = ()) -> "Tenants":
        """The tenants of `api_keys` (`TENANT:KEY` or bare `KEY` values), `api_key_digests`
        (`TENANT:sha256:HEX`) and `keys_file`; with none of them, `CAIRN_API_KEY` (from
        `environ`, default os.environ) as the tenant `default`."""
        values = [api_keys] if isinstance(api_keys, str) else list(api_keys or ())
        pairs = [parse_key(v) for v in values]
        digests = [parse_digest(d) for d in api_key_digests]
        limits: dict[str, dict[str, Any]] = {}
        if keys_file is not None:
            for tenant, key, fields in read_keys_file(keys_file):
                pairs.append((tenant, key))
                if fields:
                    limits.setdefault(tenant, {}).update(fields)
        if not pairs and not digests:
            env_key = (os.environ if environ is None else environ).get("CAIRN_API_KEY") or None
            if env_key is not None:
                pairs = [(DEFAULT_TENANT, env_key)]
        return cls(pairs, digests, limits)

    def __bool__(self) -> bool:
        return bool(self._digests)

    def __len__(self) -> int:
        return len(self._digests)

    def __repr__(self) -> str:  # never the keys
        return f"Tenants({len(set(t for _, t in self._digests))} tenants, {len(self._digests)} keys)"

    @property
    def ids(self) -> frozenset[str]:
        return frozenset(t for _, t in self._digests)

    def digests(self) -> list[str]:
        """Every key as `TENANT:sha256:HEX`, for `api_key_digests`."""
        return [f"{tenant}:sha256:{digest.hex()}" for digest, tenant in self._digests]

    def tenant_of(self, token: str) -> str | None:
        """The tenant whose key `token` is, or None; in time independent of which key matched."""
        digest, found = _digest(token), None
        for known, tenant in self._digests:
            if hmac.compare_digest(digest, known):
                found = tenant
        return found


def parse_key(value: str) -> tuple[str, str]:
    """`TENANT:KEY` -> (tenant, key); a bare `KEY` -> (its own derived tenant id, key)."""
    tenant, sep, key = value.partition(":")
    return (tenant, key) if sep else (bare_tenant_id(value), value)


def parse_digest(value: str) -> tuple[str, str]:
    """`TENANT:sha256:HEX` -> (tenant, `sha256:HEX`)."""
    tenant, sep, digest = value.partition(":")
    if not sep:
        raise ValueError("an API key digest is TENANT:sha256:HEX")
    return tenant, digest


def read_keys_file(path: str | Path) -> list[tuple[str, str, dict[str, int]]]:
    """(tenant, key, limits) of a keys file: `TENANT:KEY [NAME=VALUE ...]` per line; `#`
    comments, blank lines. A limit is a `TenantLimits` field and a whole number."""
    entries = []
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        tenant, sep, rest = line.partition(":")
        words = rest.split()
        if not sep or not tenant.strip() or not words:
            raise ValueError(f"{path}:{n}: expected TENANT:KEY")
        fields: dict[str, int] = {}
        for word in words[1:]:
            name, eq, value = word.partition("=")
            if not eq or name not in LIMIT_FIELDS or not value.isdigit():
                raise ValueError(f"{path}:{n}: after TENANT:KEY, expected limits NAME=VALUE with NAME one of "
                                 f"{', '.join(LIMIT_FIELDS)} and VALUE a whole number")
            fields[name] = int(value)
        entries.append((tenant.strip(), words[0], fields))
    return entries
