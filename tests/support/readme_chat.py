"""The README's first-screen chat: its code and the block it printed, as the README shows them.

`tests/test_readme_commands.py` runs it against one engine (`cairn serve --replicas 1`) and
`tests/ray/test_cluster.py` against `cairn serve`'s two replicas behind the router: both must
print the block exactly."""

from __future__ import annotations

import re
import subprocess
import sys

from tests.support.paths import REPO

README_URL = "http://127.0.0.1:8000/v1"
_CHAT = re.compile(r"^```python\n(from openai import OpenAI\n.*?)^```\n\n```text\n(.*?)^```\n", re.S | re.M)


def readme_chat() -> tuple[str, str, int]:
    """(the chat's code, the block shown after it, the README's line where that block ends)."""
    readme = (REPO / "README.md").read_text()
    (match,) = _CHAT.finditer(readme)
    code, shown = match.groups()
    return code, shown, readme[:match.end()].count("\n")


def run_readme_chat(url: str, env: dict, api_key: str = "none", timeout_s: float = 180) -> subprocess.CompletedProcess:
    """Runs the chat as written, against `url` (`.../v1`) with `api_key`; its stdout is what it printed."""
    code, _, _ = readme_chat()
    assert code.count(f'"{README_URL}"') == 1 and code.count('api_key="none"') == 1, code
    code = code.replace(README_URL, url).replace('api_key="none"', f"api_key={api_key!r}")
    return subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=timeout_s)
