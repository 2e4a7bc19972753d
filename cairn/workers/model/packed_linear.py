"""Linear layers whose weights are laid out once for the CPU's matrix engine: `pack_linears`.

On a CPU, `F.linear` hands oneDNN a plain row-major weight, and oneDNN reorders it into its
blocked layout (AMX tiles, AVX512 panels) on every call: for a decode step that is a second pass
over every weight, and on the LM head (vocab x hidden) the larger share of the step. Reordered
once at load (`torch.ops.mkldnn._reorder_linear_weight`) and multiplied with
`mkldnn._linear_pointwise`, the same products take about half the time here (AMX, bf16: the
[16, 512] x [512, 151936] LM head 14 -> 9 ms, a [16, 512] x [512, 1536] projection 70 -> 35 us,
a 6000-row one 7.7 -> 3.5 ms), with bf16 results bit-identical to `F.linear`'s and fp32 ones
equal to rounding.

Contract:
- `can_pack(device, dtype)`: a CPU tensor, fp32 or bf16 (bf16 only where oneDNN computes it), and
  torch built with oneDNN.
- `pack_linears(model)` replaces, in place, every `nn.Linear` of `model` by a `PackedLinear`
  holding its packed weight (the plain one is dropped: the memory is the same), and returns how
  many it replaced. It leaves alone a linear whose weight is read as a tensor elsewhere: one
  tied to another parameter (an LM head tied to the embedding), and the children a module names
  in its `READS_WEIGHTS` (e.g. `SparseMoE`'s shared expert, whose weights the fused MoE op takes).
  A model off the CPU, or in another dtype, is left as it is (0).
- `PackedLinear.forward(x)` is `F.linear(x, weight, bias)` for any leading shape; it runs the
  product at `padded_rows` rows (zero rows added, their results dropped), so that the shapes
  oneDNN compiles a kernel for are few and a new prompt length costs no compile.
- `warm_up(model, max_rows, head_rows)` runs every distinct packed shape once at every row count
  a product of at most `max_rows` rows runs at (`head_rows` for the model's `lm_head`, which sees
  only the sampled rows), zeros in, nothing kept: oneDNN then compiles its kernels before the
  first request instead of during it (a first 6,000-token prompt paid about 200 ms of compiles on
  the peer model, served). Returns how many products it ran.
Packing is the CPU's eager path only: CUDA models never take it, and the step census
(`cairn.workers.execution.step_census`), which counts a GPU's work on CPU tensors, sees one op a linear either way.
"""

from __future__ import annotations

import torch
from torch import nn

PACK_BATCH_HINT = 16  # the rows oneDNN is told to expect; any count works, the layout is the same
ROW_STEP = 256  # above it, row counts are rounded up to a multiple of it; below, to a power of two


def padded_rows(n: int) -> int:
    """The row count a product of `n` rows runs at: oneDNN builds (JIT-compiles) a kernel for
    every new shape, about 4 ms a linear here, so a prefill of a length never seen before paid
    that in every layer; rounded up, a linear sees at most log2(ROW_STEP) + 1 shapes below
    ROW_STEP and one per ROW_STEP rows above, at most ROW_STEP - 1 rows of zeros more."""
    if n <= 1:
        return n
    if n <= ROW_STEP:
        return 1 << (n - 1).bit_length()
    return -(-n // ROW_STEP) * ROW_STEP


def can_pack(device: torch.device, dtype: torch.dtype) -> bool:
    if device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.float32:
        return True
    return dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported()


class PackedLinear(nn.Module):
    """y = x W^T + b with W held in oneDNN's blocked layout (an opaque mkldnn tensor)."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        with torch.no_grad():
            self.register_buffer("packed", torch.ops.mkldnn._reorder_linear_weight(
                linear.weight.detach().contiguous(), PACK_BATCH_HINT), persistent=False)
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        n = rows.shape[0]
        padded = padded_rows(n)
        if padded != n:
            rows = torch.cat((rows, rows.new_zeros(padded - n, self.in_features)))
        y = torch.ops.mkldnn._linear_pointwise(rows, self.packed, self.bias, "none", [], "")
        return y[:n].view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def _skipped(model: nn.Module) -> set[int]:
    """ids of the linears whose weight is read as a tensor somewhere: tied, or named by a parent."""
    seen: dict[int, int] = {}
    for _, p in model.named_parameters(remove_duplicate=False):
        seen[id(p)] = seen.get(id(p), 0) + 1
    skip = {id(m) for m in model.modules() if isinstance(m, nn.Linear) and seen.get(id(m.weight), 0) > 1}
    for parent in model.modules():
        for name in getattr(parent, "READS_WEIGHTS", ()):
            skip.update(id(m) for m in getattr(parent, name).modules())
    return skip


def pack_linears(model: nn.Module) -> int:
    p = next(model.parameters(), None)
    if p is None or not can_pack(p.device, p.dtype):
        return 0
    skip, done = _skipped(model), 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear) and id(child) not in skip and child.weight.dtype == p.dtype:
                setattr(parent, name, PackedLinear(child))
                done += 1
    return done


def row_buckets(max_rows: int) -> list[int]:
    """Every row count `padded_rows` gives for 1..max_rows."""
    out, n = [], 1
    while n <= padded_rows(max_rows):
        out.append(n)
        n = n * 2 if n < ROW_STEP else n + ROW_STEP
    return out


def warm_up(model: nn.Module, max_rows: int, head_rows: int) -> int:
    head = getattr(model, "lm_head", None)
    shapes = {(m.in_features, m.out_features, m.bias is not None, m is head): m for m in model.modules()
              if isinstance(m, PackedLinear)}
    done = 0
    with torch.inference_mode():
        for (*_, is_head), linear in shapes.items():
            for rows in row_buckets(head_rows if is_head else max_rows):
                linear(torch.zeros(rows, linear.in_features, dtype=linear.packed.dtype))
                done += 1
    return done
