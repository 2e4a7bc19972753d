"""Where an `image_url` content part's bytes come from, and what the server refuses to read.

`ImageSources(allow, max_bytes, timeout_s).read(url, param)` returns the image's bytes or raises a
400 naming `param` (the content part):
- `data:` URLs with an `image/*` media type (or none) and base64 data: decoded, refused past
  `max_bytes` before decoding (from the base64 length), or when the data is not base64;
- `http(s)://` and `file:///` URLs only under a prefix of `allow` (`APIOptions.image_url_allow`,
  empty by default: a server that fetches whatever URL a client names is an SSRF hole). A fetch
  follows no redirect (one could leave the allowed prefix), stops reading past `max_bytes`, and
  gives up after `timeout_s`; a file's real path (symlinks and `..` resolved) must lie under the
  prefix's directory, and is opened without following a link, a regular file only; a URL with a
  dot segment or a NUL, raw or percent-encoded, is refused before anything is read. The time
  limit is checked as bytes arrive: a server that sends nothing times out after `timeout_s`, one
  that trickles is cut off at the next bytes past it;
- anything else (other schemes, a URL under no allowed prefix) is refused, naming the prefixes
  allowed.
Blocking: it runs on the ingress's prepare threads (`prep_pool`), never on the event loop.
"""

from __future__ import annotations

import base64
import binascii
import http.client
import os
import re
import stat
import time
import urllib.error
import urllib.parse
import urllib.request

from cairn.cluster.api.api_errors import bad_request

_DATA = re.compile(r"data:(?P<type>[^;,]*)(?P<params>(?:;[^;,]*)*),(?P<data>.*)", re.DOTALL)


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, req, fp, code, msg, headers, newurl):
        raise urllib.error.HTTPError(req.full_url, code, f"redirects to {newurl}: not followed", headers, fp)


class ImageSources:
    def __init__(self, allow: tuple[str, ...] = (), max_bytes: int = 20 << 20, timeout_s: float = 10.0):
        self.allow, self.max_bytes, self.timeout_s = allow, max_bytes, timeout_s
        self._opener = urllib.request.build_opener(_NoRedirect)

    def read(self, url: str, param: str) -> bytes:
        if url.startswith("data:"):
            return self._data(url, param)
        if not any(url.startswith(prefix) for prefix in self.allow):
            allowed = f"this server reads only data: URLs and URLs under {list(self.allow)}" if self.allow else \
                "this server reads only data: URLs (base64 images); remote and local URLs are off"
            raise bad_request(f"{param}: image URL {url[:80]!r} is not allowed: {allowed}", param)
        path = urllib.parse.unquote(urllib.parse.urlsplit(url).path)
        if "\x00" in path or any(part in (".", "..") for part in path.split("/")):
            raise bad_request(f"{param}: image URL {url[:80]!r} has a dot segment or a NUL: not read", param)
        if url.startswith("file:///"):
            return self._file(path, url, param)
        return self._fetch(url, param)

    def _data(self, url: str, param: str) -> bytes:
        m = _DATA.fullmatch(url)
        if m is None or ";base64" not in m["params"].lower():
            raise bad_request(f"{param}: expected a base64 data URL (data:image/png;base64,...)", param)
        if m["type"] and not m["type"].lower().startswith("image/"):
            raise bad_request(f"{param}: a data URL of type {m['type']!r} is not an image", param)
        data = re.sub(r"\s+", "", m["data"])
        if len(data) // 4 * 3 > self.max_bytes + 2:
            raise self._too_large(param, len(data) // 4 * 3)
        try:
            out = base64.b64decode(data, validate=True)
        except (binascii.Error, ValueError):
            raise bad_request(f"{param}: the data URL's data is not valid base64", param) from None
        if len(out) > self.max_bytes:
            raise self._too_large(param, len(out))
        return out

    def _file(self, path: str, url: str, param: str) -> bytes:
        path = os.path.realpath(path)
        roots = [os.path.realpath(urllib.parse.unquote(p[len("file://"):])) for p in self.allow
                 if p.startswith("file:///")]
        if not any(path.startswith(root.rstrip("/") + "/") for root in roots):
            raise bad_request(f"{param}: {url[:80]!r} leaves the directories this server reads images from", param)
        try:  # the resolved path, opened without following a link swapped in since, a regular file only
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
            with os.fdopen(fd, "rb") as f:
                if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                    raise bad_request(f"{param}: {url[:80]!r} is not a regular file", param)
                out = f.read(self.max_bytes + 1)
        except OSError as e:
            raise bad_request(f"{param}: cannot read {url[:80]!r} ({e.strerror})", param) from None
        if len(out) > self.max_bytes:
            raise self._too_large(param, len(out))
        return out

    def _fetch(self, url: str, param: str) -> bytes:
        deadline = time.monotonic() + self.timeout_s
        chunks, size = [], 0
        try:
            with self._opener.open(url, timeout=self.timeout_s) as response:
                while size <= self.max_bytes:
                    if time.monotonic() > deadline:
                        raise TimeoutError
                    chunk = response.read1(min(1 << 16, self.max_bytes + 1 - size))  # what has arrived
                    if not chunk:
                        break
                    chunks.append(chunk)
                    size += len(chunk)
        except TimeoutError:
            raise bad_request(f"{param}: fetching {url[:80]!r} took longer than {self.timeout_s:g} s", param) from None
        except (urllib.error.URLError, http.client.HTTPException, OSError, ValueError) as e:
            raise bad_request(f"{param}: cannot fetch {url[:80]!r} ({getattr(e, 'reason', e)})", param) from None
        if size > self.max_bytes:
            raise self._too_large(param, size)
        return b"".join(chunks)

    def _too_large(self, param: str, size: int):
        return bad_request(f"{param}: the image is {size} bytes; this server accepts at most {self.max_bytes} "
                           f"(max_image_bytes)", param)
