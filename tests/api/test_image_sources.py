"""What `ImageSources` reads and refuses (cairn.cluster.api.image_sources), as a 400 naming the
content part: data URLs, allow-listed files (no link out of the directory, no FIFO, no dot
segment or NUL), allow-listed http URLs (no redirect, a time limit that a trickling server
cannot stretch), and nothing else."""

import base64
import http.server
import os
import threading
import time

import pytest

from cairn.cluster.api.api_errors import APIError
from cairn.cluster.api.image_sources import ImageSources

PART = "messages[0].content[1]"


def refused(sources: ImageSources, url: str, match: str) -> None:
    with pytest.raises(APIError) as e:
        sources.read(url, PART)
    assert e.value.status == 400 and e.value.param == PART and match in e.value.message, e.value.message


def test_a_data_url_is_read_and_bad_ones_are_refused():
    sources = ImageSources(max_bytes=16)
    assert sources.read("data:image/png;base64," + base64.b64encode(b"12345").decode(), PART) == b"12345"
    refused(sources, "data:image/png;base64,@@", "not valid base64")
    refused(sources, "data:text/plain;base64,AAAA", "not an image")
    refused(sources, "data:image/png," + "A" * 8, "base64 data URL")
    refused(sources, "data:image/png;base64," + base64.b64encode(b"x" * 40).decode(), "max_image_bytes")


def test_files_only_under_the_allowed_directory_and_only_regular_ones(tmp_path):
    allowed, outside = tmp_path / "allowed", tmp_path / "outside"
    allowed.mkdir()
    outside.mkdir()
    (allowed / "a.png").write_bytes(b"pixels")
    (outside / "secret").write_bytes(b"secret")
    (allowed / "link").symlink_to(outside / "secret")
    os.mkfifo(allowed / "fifo")
    sources = ImageSources(allow=(allowed.as_uri() + "/",))
    assert sources.read((allowed / "a.png").as_uri(), PART) == b"pixels"
    refused(sources, (allowed / "link").as_uri(), "leaves the directories")
    refused(sources, allowed.as_uri() + "/../outside/secret", "dot segment")
    refused(sources, allowed.as_uri() + "/%2e%2e/outside/secret", "dot segment")
    refused(sources, allowed.as_uri() + "/a%00.png", "NUL")
    refused(sources, (allowed / "fifo").as_uri(), "not a regular file")
    refused(sources, (outside / "secret").as_uri(), "not allowed")
    refused(sources, "https://example.com/cat.png", "not allowed")


class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        if self.path.startswith("/ok/redirect"):
            self.send_response(302)
            self.send_header("Location", "/elsewhere/cat.png")
            self.end_headers()
        elif self.path.startswith("/ok/slow"):
            self.send_response(200)
            self.end_headers()
            for _ in range(40):  # a byte every 0.1 s: 4 s in all
                self.wfile.write(b"x")
                self.wfile.flush()
                time.sleep(0.1)
        else:
            self.send_response(200)
            self.end_headers()
            self.wfile.write(b"image bytes")

    def log_message(self, *args):
        pass


@pytest.fixture
def server():
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()


def test_an_allowed_url_is_fetched_without_redirects_within_its_time(server):
    sources = ImageSources(allow=(server + "/ok/",), timeout_s=1.0)
    assert sources.read(server + "/ok/cat.png", PART) == b"image bytes"
    refused(sources, server + "/ok/redirect", "not followed")
    refused(sources, server + "/elsewhere/cat.png", "not allowed")
    refused(sources, server + "/ok/../elsewhere/cat.png", "dot segment")
    began = time.monotonic()
    refused(sources, server + "/ok/slow", "longer than 1 s")
    assert time.monotonic() - began < 2.0
