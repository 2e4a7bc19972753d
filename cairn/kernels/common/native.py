"""Builds and loads the CPU kernels (each op folder's `cairn/kernels/<op>/*.cpp`, over the shared
`native.h` beside this module) for this machine, once per process, as one library.

Contract: `library()` returns True once the ops are registered as `torch.ops.cairn_cpu.*`, and
False where they cannot be (no C++ compiler, or the build failed; `CAIRN_NATIVE_CPU=0` in the
environment turns them off), having warned once with the reason: the CPU path then runs the ops'
torch modules and, where an op has none, its reference as the slow fallback
(`cairn.kernels.common.dispatch`). `build_error()` says why it is off.
- The sources compile with torch's extension builder (`torch.utils.cpp_extension.load`, ninja),
  `-O3 -march=native` and OpenMP (torch's own runtime at run time: `at::parallel_for` shares
  torch's intra-op threads), into $CAIRN_KERNEL_CACHE/<name> (default ~/.cache/cairn-kernels: a
  machine's build, apart from $CAIRN_HOME's models, which tests point elsewhere). About
  20 s the first time; after that the built library is loaded directly (`torch.ops.load_library`,
  milliseconds: importing the builder alone costs about 80 ms), the builder called only if that
  fails. The engine's runner loads it when it is made (`cairn.kernels.load_native`), so neither the
  build nor the load falls in a request.
- The library's name carries a hash of the sources, the flags and this CPU's instruction-set
  flags, so an edited source or another CPU model (a shared home directory) builds its own
  library instead of loading one compiled for something else. Concurrent builders (replicas
  starting together) wait on the builder's lock.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
import warnings
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
SOURCES = sorted(HERE.parent.glob("*/*.cpp"))  # file names are unique across the op folders (one object each)
HEADERS = sorted(HERE.glob("*.h"))
FLAGS = ["-O3", "-march=native", "-mprefer-vector-width=512", "-fopenmp", "-fno-math-errno"]
log = logging.getLogger(__name__)

_lock = threading.Lock()
_state: dict[str, object] = {}


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def library_name() -> str:
    digest = hashlib.sha256()
    for path in SOURCES + HEADERS:
        digest.update(path.name.encode() + path.read_bytes())
    digest.update(" ".join(FLAGS).encode() + _cpu_flags().encode() + torch.__version__.encode())
    return f"cairn_cpu_{digest.hexdigest()[:16]}"


def library() -> bool:
    """Whether the CPU kernels are loaded (building them on first call)."""
    if "ok" in _state:
        return bool(_state["ok"])
    with _lock:
        if "ok" not in _state:
            _state["ok"] = _load()
    return bool(_state["ok"])


def build_error() -> str | None:
    """Why the CPU kernels are off (None while they are on or not yet asked for)."""
    return _state.get("error")  # type: ignore[return-value]


def build_directory(name: str) -> Path:
    return Path(os.environ.get("CAIRN_KERNEL_CACHE") or Path.home() / ".cache" / "cairn-kernels") / name


def _load() -> bool:
    if os.environ.get("CAIRN_NATIVE_CPU", "1").strip() == "0":
        _state["error"] = "CAIRN_NATIVE_CPU=0"
        return False
    name = library_name()
    built = build_directory(name) / f"{name}.so"
    if built.exists() and not (built.parent / "lock").exists():  # built, and no builder at work on it
        try:
            torch.ops.load_library(str(built))
            return True
        except OSError as e:  # a build cut short: build again
            log.warning("the built CPU kernels at %s did not load (%s); building them again", built, e)
    try:
        from torch.utils import cpp_extension

        log.info("building the CPU kernels into %s (about 20 s, once)", built.parent)
        built.parent.mkdir(parents=True, exist_ok=True)
        cpp_extension.load(name=name, sources=[str(p) for p in SOURCES], extra_cflags=FLAGS,
                           extra_include_paths=[str(HERE)], build_directory=str(built.parent),
                           is_python_module=False, verbose=False)
        return True
    except Exception as e:  # no compiler, a failed build: the torch references run instead
        _state["error"] = f"{type(e).__name__}: {e}"[:2000]
        warnings.warn(f"cairn's CPU kernels did not build ({_state['error'][:300]}); the CPU path runs the "
                      f"torch references instead", RuntimeWarning, stacklevel=3)
        return False
