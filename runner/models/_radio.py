"""RADIO (NVIDIA's ViT vision encoder, `model_type` "radio"), the vision tower of Nemotron-H VL.

Not an architecture of its own (the leading underscore keeps it out of the registry):
nemotron_h_vl.py nests it under `vision_model.radio_model`. A timm ViT with three RADIO twists:
- patches are flattened channel-first (c, y, x) and embedded by one bias-free linear layer;
- the position embeddings are a (cpe_max_size / patch)^2 grid, resized bilinearly (PyTorch's
  align_corners=False) to the input's patch grid (CPE: scale the square to the larger side,
  then crop), so any tile size is served;
- summary (CLS) tokens, one per teacher, plus registers up to a multiple, are prepended and
  dropped again from the output, which is the patch features only.
The input conditioner's mean/std are stored but not applied: the processor normalises.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from runner.nn.linear import Linear


@dataclass
class RadioArgs:
    """vision_config; the defaults are RADIO v2.5-H (ViT-H/16), what `version` names."""

    hidden_size: int = 1280
    num_hidden_layers: int = 32
    num_attention_heads: int = 16
    intermediate_size: int = 5120
    patch_size: int = 16
    image_size: int = 224
    max_resolution: int = 2048
    layer_norm_eps: float = 1e-6
    args: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_dict(cls, params: dict[str, Any]) -> RadioArgs:
        known = inspect.signature(cls).parameters
        return cls(**{k: v for k, v in params.items() if k in known and v is not None})

    @property
    def grid(self) -> int:
        """Side of the stored position-embedding grid, in patches."""
        return int(self.args.get("cpe_max_size") or self.max_resolution) // self.patch_size

    @property
    def cls_tokens(self) -> int:
        teachers = self.args.get("teachers") or []
        if self.args.get("cls_token_per_teacher", True) and teachers:
            return len({t["name"] for t in teachers})
        return 1

    @property
    def skipped_tokens(self) -> int:
        """Summary tokens plus registers: what precedes the patch features."""
        multiple = self.args.get("register_multiple")
        registers = multiple - self.cls_tokens % multiple if multiple else 0
        return self.cls_tokens + registers


def _bilinear_axis(size_in: int, size_out: int) -> tuple[mx.array, mx.array, mx.array]:
    """Source rows and weights of a 1-D bilinear resize, as F.interpolate(align_corners=False)."""
    scale = size_in / size_out
    src = mx.maximum((mx.arange(size_out, dtype=mx.float32) + 0.5) * scale - 0.5, 0.0)
    low = mx.minimum(mx.floor(src).astype(mx.int32), size_in - 1)
    high = mx.minimum(low + 1, size_in - 1)
    return low, high, src - low.astype(mx.float32)


def resize_bilinear(grid: mx.array, rows: int, cols: int) -> mx.array:
    """(H, W, D) -> (rows, cols, D), bilinear, no antialiasing (as RADIO's eval path)."""
    low, high, w = _bilinear_axis(grid.shape[0], rows)
    grid = grid[low] * (1 - w)[:, None, None] + grid[high] * w[:, None, None]
    low, high, w = _bilinear_axis(grid.shape[1], cols)
    return grid[:, low] * (1 - w)[None, :, None] + grid[:, high] * w[None, :, None]


class ClsToken(nn.Module):
    def __init__(self, args: RadioArgs) -> None:
        super().__init__()
        self.token = mx.zeros((args.skipped_tokens, args.hidden_size))


class PatchGenerator(nn.Module):
    def __init__(self, args: RadioArgs) -> None:
        super().__init__()
        self.patch = args.patch_size
        self.grid = args.grid
        self.cpe = self.grid != args.image_size // args.patch_size
        self.embedder = Linear(3 * self.patch ** 2, args.hidden_size, bias=False)
        self.pos_embed = mx.zeros((1, self.grid ** 2, args.hidden_size))
        self.cls_token = ClsToken(args)

    def positions(self, rows: int, cols: int) -> mx.array:
        """The position embeddings of a rows x cols patch grid, (rows * cols, D)."""
        if (rows, cols) == (self.grid, self.grid):
            return self.pos_embed[0]
        table = self.pos_embed[0].astype(mx.float32).reshape(self.grid, self.grid, -1)
        if self.cpe:
            side = max(rows, cols)
            table = resize_bilinear(table, side, side)
        table = table[:rows, :cols]
        if table.shape[:2] != (rows, cols):
            table = resize_bilinear(table, rows, cols)
        return table.reshape(rows * cols, -1)

    def __call__(self, pixels: mx.array) -> mx.array:
        """(N, H, W, 3) channels-last pixels -> (N, skipped + patches, D)."""
        n, height, width, channels = pixels.shape
        p, rows, cols = self.patch, height // self.patch, width // self.patch
        patches = pixels.reshape(n, rows, p, cols, p, channels).transpose(0, 1, 3, 5, 2, 4)
        h = self.embedder(patches.reshape(n, rows * cols, channels * p * p))
        h = h + self.positions(rows, cols).astype(h.dtype)
        token = mx.broadcast_to(self.cls_token.token.astype(h.dtype),
                                (n, *self.cls_token.token.shape))
        return mx.concatenate([token, h], axis=1)


class Attention(nn.Module):
    def __init__(self, dims: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = Linear(dims, 3 * dims, bias=True)
        self.proj = Linear(dims, dims, bias=True)

    def __call__(self, x: mx.array) -> mx.array:
        n, length, dims = x.shape
        qkv = self.qkv(x).reshape(n, length, 3, self.heads, -1).transpose(2, 0, 3, 1, 4)
        scale = (dims // self.heads) ** -0.5
        out = mx.fast.scaled_dot_product_attention(qkv[0], qkv[1], qkv[2], scale=scale)
        return self.proj(out.transpose(0, 2, 1, 3).reshape(n, length, dims))


class MLP(nn.Module):
    def __init__(self, dims: int, hidden: int) -> None:
        super().__init__()
        self.fc1 = Linear(dims, hidden, bias=True)
        self.fc2 = Linear(hidden, dims, bias=True)

    def __call__(self, x: mx.array) -> mx.array:
        return self.fc2(nn.gelu(self.fc1(x)))  # timm's exact (erf) GELU


class Block(nn.Module):
    def __init__(self, args: RadioArgs) -> None:
        super().__init__()
        dims = args.hidden_size
        self.norm1 = nn.LayerNorm(dims, eps=args.layer_norm_eps)
        self.attn = Attention(dims, args.num_attention_heads)
        self.norm2 = nn.LayerNorm(dims, eps=args.layer_norm_eps)
        self.mlp = MLP(dims, args.intermediate_size)

    def __call__(self, x: mx.array) -> mx.array:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class Backbone(nn.Module):
    def __init__(self, args: RadioArgs) -> None:
        super().__init__()
        self.patch_generator = PatchGenerator(args)
        self.blocks = [Block(args) for _ in range(args.num_hidden_layers)]


class InputConditioner(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm_mean = mx.zeros((3, 1, 1))
        self.norm_std = mx.ones((3, 1, 1))


class RadioModel(nn.Module):
    """Named as checkpoints name it: `radio_model.model.*`, `radio_model.input_conditioner.*`."""

    def __init__(self, args: RadioArgs) -> None:
        super().__init__()
        self.skip = args.skipped_tokens
        self.input_conditioner = InputConditioner()
        self.model = Backbone(args)

    def __call__(self, pixels: mx.array) -> mx.array:
        """(N, H, W, 3) normalised pixels -> (N, H/p * W/p, D) patch features, row-major."""
        h = self.model.patch_generator(pixels)
        for block in self.model.blocks:
            h = block(h)
        return h[:, self.skip:]


def tensor_shapes(args: RadioArgs, prefix: str) -> dict[str, tuple[int, ...]]:
    """Every RADIO tensor under `prefix` (e.g. "vision_model.radio_model."), PyTorch layout."""
    d, inner, p = args.hidden_size, args.intermediate_size, args.patch_size
    gen = f"{prefix}model.patch_generator"
    shapes: dict[str, tuple[int, ...]] = {
        f"{prefix}input_conditioner.norm_mean": (3, 1, 1),
        f"{prefix}input_conditioner.norm_std": (3, 1, 1),
        f"{gen}.embedder.weight": (d, 3 * p * p),
        f"{gen}.pos_embed": (1, args.grid ** 2, d),
        f"{gen}.cls_token.token": (args.skipped_tokens, d),
    }
    for i in range(args.num_hidden_layers):
        b = f"{prefix}model.blocks.{i}"
        shapes.update({
            f"{b}.norm1.weight": (d,), f"{b}.norm1.bias": (d,),
            f"{b}.norm2.weight": (d,), f"{b}.norm2.bias": (d,),
            f"{b}.attn.qkv.weight": (3 * d, d), f"{b}.attn.qkv.bias": (3 * d,),
            f"{b}.attn.proj.weight": (d, d), f"{b}.attn.proj.bias": (d,),
            f"{b}.mlp.fc1.weight": (inner, d), f"{b}.mlp.fc1.bias": (inner,),
            f"{b}.mlp.fc2.weight": (d, inner), f"{b}.mlp.fc2.bias": (d,),
        })
    return shapes
