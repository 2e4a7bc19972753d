"""Engine steps timed on a device: a full-size engine over random bf16 weights, every step shape of
step_limit.STEPS run the first time and warm, and one warm step's kernels under torch.profiler.

- `full_engine(cfg, device, max_seqs)`: the model built on the meta device and cast to bf16 there,
  then materialised on `device` (no fp32 copy ever exists: Qwen3.5-35B-A3B is 70 GB in bf16, 139 in
  fp32) and filled with N(0, 0.02). Every parameter is bf16, as the loader casts a checkpoint; the
  rotary frequencies, a buffer no checkpoint holds, are recomputed in fp32 as the loader does.
- `StepDriver(engine)` brings its engine to a step's shape (`enter`: the last shape's sequences
  aborted, `decodes` new ones started from 8-token prompts and stepped until each decodes) and runs
  the step (`run`): the step's prompts added (fresh random tokens: nothing hits the prefix cache),
  the one `engine.step()` that takes them beside the decodes timed, the prompts aborted, so every
  run starts from the same state. A step that did not give every sequence of the shape a token
  (a prompt left half done) raises: the time would be another step's.
- `measure(driver, steps, repeats)`: for each step in order, in one engine, its first run (the first
  time this engine ran that shape, after `Engine.warm_up` and the steps before it: compiles
  included, what a user's first such request pays), one more run untimed, then `repeats` warm runs.
- `profile(driver, step, top)`: one warm run of `step` (after two) under torch.profiler, CUDA
  activity only: its `top` kernels by GPU time, with their launch count.
"""

from __future__ import annotations

import statistics
import time
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass

import torch

from cairn.workers.engine import Engine
from cairn.workers.engine_options import EngineOptions
from cairn.workers.model.family_registry import family_named
from cairn.workers.model.layers import Rotary
from cairn.workers.model.model_config import ModelConfig
from cairn.workers.model.mtp import MultiTokenPredictor
from cairn.workers.sampling_params import SamplingParams
from step_limit import Step

DECODE_PROMPT = 8  # tokens of each decoding sequence's prompt: the context its decode steps read
WARM_REPEATS = 6


def full_engine(cfg: ModelConfig, device: str, max_seqs: int, **options: object) -> Engine:
    """An engine over random bf16 weights of `cfg` on `device`, decode graphs on where the device
    has them; `options`: other EngineOptions fields (with `num_speculative_tokens`, a random MTP
    head drafts: `random_head`)."""
    torch.manual_seed(0)
    with torch.device("meta"):
        model = family_named(cfg.model_type).model_class(cfg)
    engine_options = EngineOptions(max_num_seqs=max_seqs, max_num_batched_tokens=4096 + 512, max_model_len=8192,
                                   cache_memory_bytes=24 * 2**30 if device == "cuda" else 2**30, device=device,
                                   dtype="bfloat16", **options)
    head = random_head(cfg, device) if engine_options.num_speculative_tokens else None
    return Engine(_random_bf16(model, cfg, device), engine_options, mtp=head)


def random_head(cfg: ModelConfig, device: str) -> MultiTokenPredictor:
    """An MTP head of `cfg` over random bf16 weights (speculative decoding's verify steps: the
    drafts it makes are rejected, which costs a verify step what any rejection costs)."""
    torch.manual_seed(1)
    with torch.device("meta"):
        head = MultiTokenPredictor(cfg, cache_rank=len(cfg.attention_layers))
    return _random_bf16(head, cfg, device)


def _random_bf16(module: torch.nn.Module, cfg: ModelConfig, device: str) -> torch.nn.Module:
    """`module` (made on the meta device) on `device` in bf16, its weights N(0, 0.02), its rotary
    frequencies (not weights) computed again."""
    module = module.to(torch.bfloat16).to_empty(device=device)
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(0.0, 0.02)
    for m in module.modules():
        if isinstance(m, Rotary):
            m.inv_freq = Rotary(cfg).inv_freq.to(device)
    return module.eval()


class StepDriver:
    def __init__(self, engine: Engine, seed: int = 1):
        self.engine = engine
        self.params = SamplingParams(max_tokens=10_000, temperature=0, ignore_eos=True)
        self.generator = torch.Generator().manual_seed(seed)
        self.decoding: list[str] = []  # request ids of the sequences the current shape decodes

    def _prompt(self, tokens: int) -> list[int]:
        return torch.randint(0, self.engine.config.vocab_size, (tokens,), generator=self.generator).tolist()

    def enter(self, step: Step) -> None:
        engine = self.engine
        for request_id in self.decoding:
            engine.abort(request_id)
        self.decoding = [engine.add_request(self._prompt(DECODE_PROMPT), self.params) for _ in range(step.decodes)]
        scheduler = engine.scheduler
        while scheduler.waiting or any(s.num_uncomputed > 1 for s in scheduler.running):
            engine.step()  # prefills, until every running sequence decodes

    def run(self, step: Step, around: AbstractContextManager | None = None) -> float:
        """Seconds of one run of `step` (entered), `around` (a census, a profiler) held over the step alone."""
        engine = self.engine
        prompts = [engine.add_request(self._prompt(n), self.params) for n in step.prefills]
        if engine.runner.device.type == "cuda":
            torch.cuda.synchronize()  # the step starts on an idle device
        with around or nullcontext():
            began = time.perf_counter()
            outputs = engine.step()  # its sampled ids read back: the step is done
            took = time.perf_counter() - began
        for request_id in prompts:
            engine.abort(request_id)
        if len(outputs) != step.decodes + len(step.prefills):
            raise RuntimeError(f"{step.name}: the step gave {len(outputs)} of its {step.decodes + len(step.prefills)} "
                               f"sequences a token (a prompt was not prefilled whole)")
        return took


@dataclass(frozen=True)
class StepTimes:
    first_s: float  # the first run of the shape in this engine
    warm_s: tuple[float, ...]

    @property
    def median_s(self) -> float:
        return statistics.median(self.warm_s)


def measure(driver: StepDriver, steps: list[Step], repeats: int = WARM_REPEATS) -> dict[str, StepTimes]:
    out = {}
    for step in steps:
        driver.enter(step)
        first = driver.run(step)
        driver.run(step)
        out[step.name] = StepTimes(first, tuple(driver.run(step) for _ in range(repeats)))
    return out


@dataclass(frozen=True)
class KernelTime:
    name: str
    total_s: float
    count: int


def profile(driver: StepDriver, step: Step, top: int = 15) -> tuple[float, float, list[KernelTime]]:
    """The profiled run's wall seconds, its kernels' summed GPU seconds, and its `top` kernels."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    driver.enter(step)
    for _ in range(2):
        driver.run(step)
    profiler = torch_profile(activities=[ProfilerActivity.CUDA])
    wall = driver.run(step, around=profiler)
    kernels: dict[str, list[float]] = {}
    for event in profiler.events():
        if event.device_type == DeviceType.CUDA:
            entry = kernels.setdefault(event.name, [0.0, 0])
            entry[0] += event.time_range.elapsed_us() * 1e-6
            entry[1] += 1
    ranked = sorted((KernelTime(name, s, n) for name, (s, n) in kernels.items()), key=lambda k: -k.total_s)
    return wall, sum(k.total_s for k in ranked), ranked[:top]
