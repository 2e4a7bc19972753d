"""Where things are, wherever a test file sits in tests/: the repository's root, its configs."""

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TESTS = REPO / "tests"
SUPPORT = TESTS / "support"
CONFIGS = REPO / "cairn" / "configs"
