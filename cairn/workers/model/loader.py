"""Loads a Hugging Face checkpoint directory into its family's model (cairn.workers.model.family_registry).

Accepts what `save_pretrained` writes: `config.json` plus `model.safetensors`, or shards listed
in `model.safetensors.index.json`; tensors in fp32, bf16 or fp16, converted to the requested
dtype. Each tensor name goes through the family's `tensor_name` first: a tensor it skips (a
vision tower, `mtp.*` heads: cairn.workers.model.mtp reads those) is never read from disk. MoE experts may be stored per expert
(`mlp.experts.{e}.gate_proj.weight`) or fused (`mlp.experts.gate_up_proj`); they are fused at load.

Every refusal is a `CheckpointError` naming the file and the tensor or field at fault.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from cairn.workers.model.model_config import CheckpointError, ModelConfig, read_json
from cairn.workers.model.family import Family
from cairn.workers.model.hybrid import HybridForCausalLM
from cairn.workers.model.layers import Rotary
from cairn.workers.model.family_registry import family_for
from cairn.workers.model.sharding import PER_EXPERT, Ranges, Shard, ranges, shard_config, vocab_rows, zero_on_other_ranks
from cairn.workers.precision import choose_dtype

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(dtype: str | torch.dtype | None, cfg: ModelConfig, device: torch.device | str = "cpu") -> torch.dtype:
    """`dtype` as a torch dtype; auto (or None) as `cairn.workers.precision.choose_dtype` picks it for
    `device`."""
    if isinstance(dtype, torch.dtype):
        return dtype
    name = choose_dtype("auto", cfg.torch_dtype, torch.device(device).type) if dtype in (None, "auto") else dtype
    if name not in DTYPES:
        raise ValueError(f"dtype: expected one of {sorted(DTYPES)} or 'auto', got {dtype!r}")
    return DTYPES[name]


def weight_files(model_dir: Path) -> list[Path]:
    single = model_dir / "model.safetensors"
    index = model_dir / "model.safetensors.index.json"
    if single.exists():
        return [single]
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index}: expected a JSON object with 'weight_map' ({e})") from None
        files = [model_dir / name for name in sorted(set(weight_map.values()))]
        for f in files:
            if not f.exists():
                raise CheckpointError(f"{index}: lists shard '{f.name}', which is missing")
        return files
    raise CheckpointError(f"{model_dir}: no model.safetensors or model.safetensors.index.json")


def _read(handle, stored: str, part: Ranges | None) -> torch.Tensor:
    """The whole tensor, or only the ranges `part` names (read from disk as slices)."""
    if part is None:
        return handle.get_tensor(stored)
    dim, spans = part
    sliced = handle.get_slice(stored)
    ndim = len(sliced.get_shape())
    pieces = [sliced[tuple(slice(a, b) if d == dim else slice(None) for d in range(ndim))] for a, b in spans]
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=dim)


def open_weights(f: Path):
    """A safetensors file opened for reading (a context manager); a CheckpointError if it is not one."""
    try:
        return safe_open(str(f), framework="pt")
    except Exception as e:  # safetensors raises its own error types
        raise CheckpointError(f"{f}: not a readable safetensors file ({e})") from None


def floating(f: Path, stored: str, t: torch.Tensor) -> torch.Tensor:
    """`t` as stored, refused unless in a floating dtype cairn runs (fp32, bf16, fp16)."""
    if t.dtype not in DTYPES.values():
        raise CheckpointError(f"{f}: tensor '{stored}' has dtype {t.dtype}; expected fp32/bf16/fp16")
    return t


def read_tensors(files: list[Path], dtype: torch.dtype, family: Family, cfg: ModelConfig | None = None,
                 shard: Shard = Shard()) -> dict[str, torch.Tensor]:
    """Every tensor the family keeps, renamed, in `dtype`; with a `shard` of more than one rank
    (and the full `cfg`), only that rank's part of each (cairn.workers.model.sharding)."""
    tensors: dict[str, torch.Tensor] = {}
    experts: dict[tuple[str, str], dict[int, torch.Tensor]] = {}
    for f in files:
        with open_weights(f) as handle:
            for stored in handle.keys():
                name = family.tensor_name(stored)
                if name is None:
                    continue
                t = _read(handle, stored, ranges(name, cfg, shard, family.shard_rules) if cfg else None)
                if shard.rank and zero_on_other_ranks(name):
                    t = torch.zeros_like(t)  # a row-parallel bias is added once, by rank 0
                t = floating(f, stored, t).to(dtype)
                m = PER_EXPERT.match(name)
                if m:
                    experts.setdefault((m.group(1), m.group(3)), {})[int(m.group(2))] = t
                else:
                    tensors[name] = t
    prefixes = sorted({prefix for prefix, _ in experts})
    for prefix in prefixes:
        parts = {proj: experts.get((prefix, proj), {}) for proj in ("gate_proj", "up_proj", "down_proj")}
        n = max(len(p) for p in parts.values())
        for proj, got in parts.items():
            if sorted(got) != list(range(n)):
                missing = sorted(set(range(n)) - set(got))
                raise CheckpointError(f"{files[0].parent}: experts {missing} of {prefix} lack {proj}")
        gate_up = [torch.cat((parts["gate_proj"][e], parts["up_proj"][e]), dim=0) for e in range(n)]
        tensors[f"{prefix}.experts.gate_up_proj"] = torch.stack(gate_up)
        tensors[f"{prefix}.experts.down_proj"] = torch.stack([parts["down_proj"][e] for e in range(n)])
    return tensors


def fused_name(name: str) -> str:
    """A fused expert tensor's name on our SparseMoE module (they sit directly on it)."""
    return name.replace(".mlp.experts.gate_up_proj", ".mlp.gate_up_proj").replace(
        ".mlp.experts.down_proj", ".mlp.down_proj")


def load_model(model_dir: str | Path, dtype: str | torch.dtype | None = None,
               device: str | torch.device = "cpu", shard: Shard = Shard(), group=None) -> HybridForCausalLM:
    """The checkpoint's model; with a `shard` of more than one rank, that rank's part of it,
    reading only that part from disk, its collectives over `group` (cairn.workers.execution.tp_group.TPGroup)."""
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise CheckpointError(f"{model_dir}: not a directory")
    source = model_dir / "config.json"
    raw = read_json(source)
    family = family_for(raw, str(source))
    full = family.read_config(raw, str(source))
    cfg = shard_config(full, shard.world)
    torch_dtype = resolve_dtype(dtype, cfg, device or "cpu")
    files = weight_files(model_dir)
    state = {fused_name(k): v for k, v in read_tensors(files, torch_dtype, family, full, shard).items()}
    _, _, vocab_per_rank = vocab_rows(full.vocab_size, shard)
    for name in ("model.embed_tokens.weight", "lm_head.weight"):  # the last rank's tail is padding
        t = state.get(name)
        if t is not None and t.shape[0] < vocab_per_rank:
            state[name] = torch.cat((t, t.new_zeros(vocab_per_rank - t.shape[0], *t.shape[1:])))

    with torch.device("meta"):
        model = family.model_class(cfg, shard, group)
    expected = model.state_dict()
    if cfg.tie_word_embeddings:
        state.pop("lm_head.weight", None)
        expected.pop("lm_head.weight", None)
    where = files[0] if len(files) == 1 else files[0].parent / "model.safetensors.index.json"
    missing = sorted(set(expected) - set(state))
    if missing:
        raise CheckpointError(f"{where}: missing tensor '{missing[0]}'" + (
            f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
    unexpected = sorted(set(state) - set(expected))
    if unexpected:
        raise CheckpointError(f"{where}: unexpected tensor '{unexpected[0]}' for this config.json" + (
            f" (and {len(unexpected) - 1} more)" if len(unexpected) > 1 else ""))
    for name, t in state.items():
        if tuple(t.shape) != tuple(expected[name].shape):
            raise CheckpointError(f"{where}: tensor '{name}' has shape {tuple(t.shape)}, config.json "
                                  f"implies {tuple(expected[name].shape)}")
    model.load_state_dict({k: v.to(device) for k, v in state.items()}, strict=False, assign=True)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    for module in model.modules():  # non-persistent buffers are not in the checkpoint
        if isinstance(module, Rotary):
            module.refresh(cfg, device)
    return model.eval()
