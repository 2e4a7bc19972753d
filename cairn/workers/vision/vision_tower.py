"""Qwen3.5 / Qwen3.6's vision tower: patches in, one embedding per image token out, exactly as
transformers' `Qwen3_5VisionModel` computes its `pooler_output` (what the language model reads).

The forward, for `pixel_values` [patches, C*T*P*P] and `grid_thw` [images, 3] (long, (t, h, w)
in patches), patches laid out as cairn.workers.vision.image_processing writes them: frame by
frame, each frame in merge-window order (every `merge x merge` square of patches consecutive):
1. a patch embedding: the checkpoint's Conv3d, whose stride is its kernel, so a matmul over the
   flattened patch;
2. plus the learned positions, a square grid resampled to each image's (h, w) bilinearly with
   aligned corners, read in merge-window order, the same for every frame;
3. blocks: pre-norm LayerNorm, attention over each frame's own patches (no patch sees another
   image or frame) with a 2-D rotary (half the rotated pairs by patch row, half by column), and
   a pre-norm MLP;
4. the merger: LayerNorm per patch, then each merge window's patches concatenated and projected
   by a two-layer GELU MLP to the language model's `out_hidden_size`.
Output [sum of t*h*w / merge^2, out_hidden_size], image by image. There are no deepstack
features: Qwen3.5's tower hands the language model its merged output only.

The grid is read on the host (`grid_thw.tolist()`, once): it decides every shape. Refused with a
ValueError: pixel values that do not match the grid, a grid the merge window does not tile.
`load_vision_tower` reads only `model.visual.*` from a checkpoint's safetensors and refuses, with
a `CheckpointError` naming the file and tensor, a missing or unexpected tensor or a wrong shape.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from cairn.workers.model.loader import DTYPES, floating, open_weights, weight_files
from cairn.workers.model.model_config import CheckpointError
from cairn.workers.vision.vision_config import VisionConfig

PREFIX = "model.visual."  # where a vision-language checkpoint keeps the tower

ACTIVATIONS = {  # by the names cairn.workers.vision.vision_config accepts
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu": F.gelu,
    "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
    "silu": F.silu,
}


def merge_window_order(h: int, w: int, merge: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Row and column [h*w] of each patch of one frame, in merge-window order."""
    def windows(grid: torch.Tensor) -> torch.Tensor:  # [h, w] -> [h/m, w/m, m, m], flattened
        return grid.reshape(h // merge, merge, w // merge, merge).transpose(1, 2).flatten()

    return windows(torch.arange(h, device=device)[:, None].expand(h, w)), \
        windows(torch.arange(w, device=device)[None, :].expand(h, w))


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


class PatchEmbed(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        kernel = (cfg.temporal_patch_size, cfg.patch_size, cfg.patch_size)
        self.proj = nn.Conv3d(cfg.in_channels, cfg.hidden_size, kernel, stride=kernel)  # as stored

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        # [N, C*T*P*P] @ [hidden, C*T*P*P]^T: the convolution of one non-overlapping window
        return F.linear(patches.to(self.proj.weight.dtype), self.proj.weight.flatten(1), self.proj.bias)


class VisionAttention(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.heads, self.head_dim = cfg.num_heads, cfg.head_dim
        self.qkv = nn.Linear(cfg.hidden_size, 3 * cfg.hidden_size)
        self.proj = nn.Linear(cfg.hidden_size, cfg.hidden_size)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, frames: list[int]) -> torch.Tensor:
        N = x.shape[0]
        q, k, v = self.qkv(x).view(N, 3, self.heads, self.head_dim).unbind(1)  # each [N, heads, head_dim]
        cos, sin = cos[:, None], sin[:, None]  # [N, 1, head_dim], fp32
        q = (q.float() * cos + rotate_half(q.float()) * sin).to(v.dtype)
        k = (k.float() * cos + rotate_half(k.float()) * sin).to(v.dtype)
        out = []
        for q_f, k_f, v_f in zip(q.split(frames), k.split(frames), v.split(frames)):  # [L, heads, head_dim]
            o = F.scaled_dot_product_attention(*(t.transpose(0, 1)[None] for t in (q_f, k_f, v_f)))
            out.append(o[0].transpose(0, 1))  # [1, heads, L, head_dim] -> [L, heads, head_dim]
        return self.proj(torch.cat(out).reshape(N, -1))


class VisionMLP(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.linear_fc1 = nn.Linear(cfg.hidden_size, cfg.intermediate_size)
        self.linear_fc2 = nn.Linear(cfg.intermediate_size, cfg.hidden_size)
        self.act = ACTIVATIONS[cfg.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(self.act(self.linear_fc1(x)))


class VisionBlock(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.norm1 = nn.LayerNorm(cfg.hidden_size, eps=1e-6)
        self.norm2 = nn.LayerNorm(cfg.hidden_size, eps=1e-6)
        self.attn = VisionAttention(cfg)
        self.mlp = VisionMLP(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, frames: list[int]) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, frames)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.window = cfg.hidden_size * cfg.merge_unit
        self.norm = nn.LayerNorm(cfg.hidden_size, eps=1e-6)
        self.linear_fc1 = nn.Linear(self.window, self.window)
        self.linear_fc2 = nn.Linear(self.window, cfg.out_hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(x).view(-1, self.window)  # [N, hidden] -> [N / merge^2, merge^2 * hidden]
        return self.linear_fc2(F.gelu(self.linear_fc1(x)))  # [N / merge^2, out_hidden]


class VisionTower(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.cfg = cfg
        self.patch_embed = PatchEmbed(cfg)
        self.pos_embed = nn.Embedding(cfg.num_position_embeddings, cfg.hidden_size)
        self.blocks = nn.ModuleList(VisionBlock(cfg) for _ in range(cfg.depth))
        self.merger = PatchMerger(cfg)

    def learned_positions(self, h: int, w: int) -> torch.Tensor:
        """The position grid resampled to h x w patches (bilinear, corners aligned): [h, w, hidden],
        in fp32 whatever the weights' dtype, as transformers resamples it."""
        side = self.cfg.grid_side
        grid = self.pos_embed.weight.float().view(side, side, -1)

        def taps(n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            at = torch.arange(n, dtype=torch.float32, device=grid.device) * (side - 1) / max(n - 1, 1)
            low = at.floor()
            return low.long(), (low.long() + 1).clamp(max=side - 1), at - low  # [n] each

        r0, r1, dr = taps(h)
        c0, c1, dc = taps(w)
        corners = ((r0, c0, (1 - dr)[:, None] * (1 - dc)), (r0, c1, (1 - dr)[:, None] * dc),
                   (r1, c0, dr[:, None] * (1 - dc)), (r1, c1, dr[:, None] * dc))
        return sum(grid[r][:, c] * weight[..., None] for r, c, weight in corners)

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        cfg, m = self.cfg, self.cfg.spatial_merge_size
        grids = [tuple(g) for g in grid_thw.tolist()]  # host: the grid decides every shape
        if pixel_values.ndim != 2 or pixel_values.shape[1] != cfg.patch_dim:
            raise ValueError(f"pixel_values: expected [patches, {cfg.patch_dim}], got {list(pixel_values.shape)}")
        if sum(t * h * w for t, h, w in grids) != pixel_values.shape[0]:
            raise ValueError(f"pixel_values: expected {sum(t * h * w for t, h, w in grids)} patches for grid_thw "
                             f"{grids}, got {pixel_values.shape[0]}")
        if any(h % m or w % m or min(t, h, w) < 1 for t, h, w in grids):
            raise ValueError(f"grid_thw: expected positive sizes, h and w multiples of {m}, got {grids}")
        x = self.patch_embed(pixel_values)  # [N, hidden]
        device = x.device
        rows, cols, positions = [], [], []
        for t, h, w in grids:
            r, c = merge_window_order(h, w, m, device)
            rows.append(r.repeat(t))
            cols.append(c.repeat(t))
            positions.append(self.learned_positions(h, w)[r, c].repeat(t, 1))  # [t*h*w, hidden]
        x = x + torch.cat(positions).to(x.dtype)

        half = cfg.head_dim // 2  # rotated pairs: the first half by row, the second by column
        inv_freq = 1.0 / cfg.rope_theta ** (torch.arange(0, half, 2, dtype=torch.float32, device=device) / half)
        angles = torch.cat((torch.cat(rows)[:, None] * inv_freq, torch.cat(cols)[:, None] * inv_freq), dim=-1)
        angles = torch.cat((angles, angles), dim=-1)  # [N, head_dim], fp32
        cos, sin = angles.cos(), angles.sin()

        frames = [h * w for t, h, w in grids for _ in range(t)]  # attention stays inside a frame
        for block in self.blocks:
            x = block(x, cos, sin, frames)
        return self.merger(x)  # [N / merge^2, out_hidden]


def load_vision_tower(checkpoint_dir: str | Path, vision_config: VisionConfig,
                      dtype: torch.dtype | str = torch.float32, device: str | torch.device = "cpu") -> VisionTower:
    """The checkpoint's vision tower in `dtype` on `device`, reading only `model.visual.*`."""
    model_dir = Path(checkpoint_dir)
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ValueError(f"dtype: expected one of {sorted(DTYPES)}, got {dtype!r}")
        dtype = DTYPES[dtype]
    files = weight_files(model_dir)
    where = files[0] if len(files) == 1 else model_dir / "model.safetensors.index.json"
    state: dict[str, torch.Tensor] = {}
    for f in files:
        with open_weights(f) as handle:
            for stored in handle.keys():
                if stored.startswith(PREFIX):  # the language model and mtp heads: never read here
                    state[stored[len(PREFIX):]] = floating(f, stored, handle.get_tensor(stored)).to(dtype)

    with torch.device("meta"):
        tower = VisionTower(vision_config)
    expected = tower.state_dict()
    for names, what in ((sorted(set(expected) - set(state)), "missing tensor"),
                        (sorted(set(state) - set(expected)), "unexpected tensor")):
        if names:
            more = f" (and {len(names) - 1} more)" if len(names) > 1 else ""
            raise CheckpointError(f"{where}: {what} '{PREFIX}{names[0]}'{more} for {vision_config.source}")
    for name, t in state.items():
        if t.shape != expected[name].shape:
            raise CheckpointError(f"{where}: tensor '{PREFIX}{name}' has shape {tuple(t.shape)}, "
                                  f"{vision_config.source} implies {tuple(expected[name].shape)}")
    tower.load_state_dict({k: v.to(device) for k, v in state.items()}, assign=True)
    return tower.eval()
