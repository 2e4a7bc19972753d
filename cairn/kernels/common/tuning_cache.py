"""The autotune choices of this process's kernels, kept on disk beside Triton's cache, so that a
restarted replica tunes nothing it tuned before.

Triton keeps compiled kernels on disk (`triton.knobs.cache.dir`, ~/.triton/cache by default), but
an autotuned kernel's choice lives in its `Autotuner.cache` (key values -> config) and is lost with
the process: a restart benchmarks every config again. `save()` writes every tuned kernel's
choices (`triton_helpers.tuned` lists them in `TUNED`) to one JSON file, `load()` reads them back
into the tuners; a choice whose config is no longer among the kernel's candidates is skipped.

The file: `$CAIRN_TUNING_DIR` (default: `cairn-tuning` beside Triton's cache folder), named by what
makes a choice valid: the GPU's name, torch's and Triton's versions. Compiled Triton only (the
interpreter tunes nothing); both return how many choices they moved.
"""

from __future__ import annotations

import json
import logging
import os
import re
from pathlib import Path

log = logging.getLogger(__name__)
TUNED: list = []  # every autotuned kernel of ours (triton.runtime.autotuner.Autotuner), by triton_helpers.tuned


def path() -> Path:
    import torch
    import triton

    folder = os.environ.get("CAIRN_TUNING_DIR") or str(Path(triton.knobs.cache.dir).parent / "cairn-tuning")
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    name = re.sub(r"[^A-Za-z0-9.+-]+", "_", f"{gpu}-torch{torch.__version__}-triton{triton.__version__}")
    return Path(folder) / f"{name}.json"


def _name(tuner) -> str:
    fn = tuner.fn
    return f"{fn.fn.__module__}.{fn.fn.__qualname__}"


def _config(config) -> dict:
    return dict(kwargs=dict(config.kwargs), num_warps=config.num_warps, num_stages=config.num_stages)


def _read(file: Path) -> dict:
    if not file.exists():
        return {}
    try:
        return json.loads(file.read_text())
    except (OSError, ValueError) as e:  # a damaged file costs a retune, not a start
        log.warning("ignoring the autotune choices in %s: %s", file, e)
        return {}


def save() -> int:
    """Writes every tuned kernel's choices (merged over what the file held); returns how many."""
    file = path()
    held = _read(file)
    for tuner in TUNED:
        choices = held.setdefault(_name(tuner), {})
        for key, config in tuner.cache.items():
            choices[json.dumps(list(key))] = _config(config)
    file.parent.mkdir(parents=True, exist_ok=True)
    partial = file.with_suffix(f".{os.getpid()}.tmp")
    partial.write_text(json.dumps(held, indent=1, sort_keys=True))
    partial.replace(file)  # whole or not at all, whoever reads it meanwhile
    return sum(len(v) for v in held.values())


def load() -> int:
    """Puts the file's choices back into the tuners (those not tuned yet in this process);
    returns how many it put back."""
    held = _read(path())
    loaded = 0
    for tuner in TUNED:
        for key, chosen in held.get(_name(tuner), {}).items():
            match = next((c for c in tuner.configs if _config(c) == chosen), None)
            key = tuple(json.loads(key))
            if match is not None and key not in tuner.cache:
                tuner.cache[key] = match
                loaded += 1
    return loaded
