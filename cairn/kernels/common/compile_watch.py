"""How many Triton kernels this process has compiled: the count a warmed-up engine must not raise.

A Triton kernel compiles once per specialisation: its constexprs, its launch options (warps,
stages), its arguments' types, and the attributes Triton specialises on (an integer argument
equal to 1 or divisible by 16, a pointer aligned to 16 bytes), unless the kernel names the argument
in `do_not_specialize` (or, for a pointer's alignment, `do_not_specialize_on_alignment`); an autotuned kernel also tunes (compiling each config) once per value of
its key. A compile inside a request's step costs that request seconds, so `cairn.workers.engine`
compiles every specialisation a step can take at start (`Engine.warm_up`), and a compile after
that is a bug: the engine logs it and exports the count (`kernel_compiles_total` in /metrics).

`install(interpreted)` (idempotent; triton_helpers calls it on import with whether this process
runs Triton interpreted, its `INTERPRETED`, so every launcher of ours has it):
- compiled Triton: Triton's `jit_post_compile_hook` (triton.knobs.runtime), chained to any hook
  set before it, counts every in-process compile (from Triton's disk cache or not);
- interpreted Triton (the CPU tests): nothing compiles, so every launch computes the key a
  compiled launch would compile under (the rules above, and an autotuned kernel's key values),
  and a key not seen before counts. The CPU tests assert through this what a GPU would compile.

`compiles()` is the count so far; `seen()` the (kernel, key) pairs in order, to tell what
compiled late.
"""

from __future__ import annotations

import inspect
import threading

import torch

_lock = threading.Lock()
_seen: list[tuple[str, str]] = []
_keys: set[tuple[str, str]] = set()
_installed = False


def compiles() -> int:
    return len(_seen)


def seen() -> list[tuple[str, str]]:
    with _lock:
        return list(_seen)


def _note(kernel: str, key: str, fresh_only: bool) -> None:
    with _lock:
        if fresh_only and (kernel, key) in _keys:
            return
        _keys.add((kernel, key))
        _seen.append((kernel, key))


def install(interpreted: bool) -> None:
    global _installed
    if _installed:
        return
    _installed = True
    if interpreted:
        _watch_interpreted()
    else:
        _watch_compiled()


def _watch_compiled() -> None:
    from triton import knobs

    before = knobs.runtime.jit_post_compile_hook

    def hook(*, key, repr, fn, compile, is_manual_warmup, already_compiled):
        _note(fn.name, str(key), fresh_only=False)
        if before is not None:
            return before(key=key, repr=repr, fn=fn, compile=compile, is_manual_warmup=is_manual_warmup,
                          already_compiled=already_compiled)
        return None

    knobs.runtime.jit_post_compile_hook = hook


def _watch_interpreted() -> None:
    from triton.runtime.interpreter import InterpretedFunction

    run = InterpretedFunction.run

    def watched(self, *args, grid, warmup, **kwargs):
        _note(self.fn.__qualname__, specialisation(self, args, kwargs), fresh_only=True)
        return run(self, *args, grid=grid, warmup=warmup, **kwargs)

    InterpretedFunction.run = watched


def _argument(value, specialise: bool, align: bool) -> tuple:
    """What Triton compiles a non-constexpr argument's value into: its type and attributes."""
    if isinstance(value, torch.Tensor):
        return ("*", str(value.dtype), align and value.data_ptr() % 16 == 0)
    if isinstance(value, bool):
        return ("u1",)
    if isinstance(value, int):
        kind = "i32" if -2**31 <= value < 2**31 else "i64"
        return (kind, value == 1, value % 16 == 0) if specialise else (kind,)
    if isinstance(value, float):
        return ("fp32",)
    return (repr(value),)


def specialisation(kernel, args: tuple, kwargs: dict) -> str:
    """The key an interpreted launch of `kernel` (a triton InterpretedFunction) would compile
    under if compiled (see the module doc)."""
    params = list(inspect.signature(kernel.fn).parameters.values())
    bound = dict(zip((p.name for p in params), args)) | kwargs
    fixed = set(kernel.kwargs.get("do_not_specialize") or ())
    unaligned = set(kernel.kwargs.get("do_not_specialize_on_alignment") or ())
    tune_key = getattr(kernel, "tune_key", ())
    parts = []
    for p in params:
        if p.name not in bound:
            continue
        value = bound[p.name]
        if "constexpr" in str(p.annotation) or p.name in tune_key:
            parts.append(f"{p.name}={value!r}")
        else:
            parts.append(f"{p.name}:{_argument(value, p.name not in fixed, p.name not in unaligned)}")
    launch = {k: v for k, v in kwargs.items() if k in ("num_warps", "num_stages")}
    return ", ".join(parts) + (f" {launch}" if launch else "")
