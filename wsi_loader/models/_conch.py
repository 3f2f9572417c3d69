"""CONCH's vision towers in plain torch around a timm ViT trunk, in the key layout of the
released files, so that neither CONCH's package (open_clip's CoCa) nor TRIDENT is needed.

Both towers pool the trunk's tokens with the first query of an attentional pooler and a
LayerNorm (``encode_image(proj_contrast=False, normalize=False)``, as TRIDENT uses them):

- CONCH v1 (``MahmoodLab/CONCH`` ``pytorch_model.bin``, an open_clip CoCa): a ViT-B/16 at
  448 px; the pooler is a ``nn.MultiheadAttention`` (512 wide, keys 768); the file's keys sit
  under ``visual.`` beside the text towers the recipe leaves out.
- CONCH v1.5 (``MahmoodLab/conchv1_5`` ``pytorch_model_vision.bin``): a ViT-L/16 with layer
  scale 1.0, trained at 224 px positions and run at 448 px; the pooler has its own q/kv/out
  projections (768 wide, keys 1024). TRIDENT and TITAN stretch the 14 x 14 position grid to
  28 x 28 at every forward pass (DINO's bicubic ``interpolate_pos_encoding``); we stretch it
  the same way once, when the file is loaded (`conch_v15_positions`).
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F  # noqa: N812


class MultiheadPooler(nn.Module):
    """CoCa's attentional pooler (CONCH v1): learned queries attend over the tokens."""

    def __init__(self, width: int, context: int, heads: int = 8, queries: int = 1) -> None:
        super().__init__()
        self.query = nn.Parameter(torch.zeros(queries, width))
        self.attn = nn.MultiheadAttention(width, heads, kdim=context, vdim=context)
        self.ln_q = nn.LayerNorm(width)
        self.ln_k = nn.LayerNorm(context)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        keys = self.ln_k(tokens).permute(1, 0, 2)  # (tokens, batch, width) as the file's MHA
        query = self.ln_q(self.query).unsqueeze(1).expand(-1, keys.shape[1], -1)
        out: torch.Tensor = self.attn(query, keys, keys, need_weights=False)[0]
        return out.permute(1, 0, 2)


class ProjectionPooler(nn.Module):
    """CONCH v1.5's attentional pooler: the same attention with its own bias-free
    projections (``to_q``, ``to_kv``, ``to_out``)."""

    def __init__(self, width: int, context: int, heads: int = 8, queries: int = 1) -> None:
        super().__init__()
        self.heads = heads
        self.query = nn.Parameter(torch.zeros(queries, width))
        self.ln_k = nn.LayerNorm(context)
        self.ln_q = nn.LayerNorm(width)
        self.to_q = nn.Linear(width, width, bias=False)
        self.to_kv = nn.Linear(context, width * 2, bias=False)
        self.to_out = nn.Linear(width, width, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        key, value = self.to_kv(self.ln_k(tokens)).chunk(2, dim=-1)
        query = self.to_q(self.ln_q(self.query)).expand(tokens.shape[0], -1, -1)

        def heads(t: torch.Tensor) -> torch.Tensor:
            return t.reshape(*t.shape[:-1], self.heads, -1).transpose(1, 2)

        out = F.scaled_dot_product_attention(heads(query), heads(key), heads(value))
        return self.to_out(out.transpose(1, 2).flatten(2))  # type: ignore[no-any-return]


class VisionTower(nn.Module):
    """The trunk's normalized tokens, pooled by the first query, then a LayerNorm."""

    def __init__(self, trunk: nn.Module, pooler: nn.Module, width: int) -> None:
        super().__init__()
        self.trunk = trunk
        self.attn_pool_contrast = pooler
        self.ln_contrast = nn.LayerNorm(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = self.trunk.forward_features(x)  # type: ignore[operator]
        return self.ln_contrast(self.attn_pool_contrast(tokens)[:, 0])  # type: ignore[no-any-return]


class CoCaVisual(nn.Module):
    """CONCH v1's tower under ``visual.``, the prefix its file's keys carry."""

    def __init__(self, visual: VisionTower) -> None:
        super().__init__()
        self.visual = visual

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.visual(x)  # type: ignore[no-any-return]


def conch_v1(trunk: nn.Module, width: int) -> nn.Module:
    """CONCH v1's vision tower around its ViT-B/16 trunk (``width``: 512)."""
    pooler = MultiheadPooler(width, int(trunk.num_features))  # type: ignore[arg-type]
    return CoCaVisual(VisionTower(trunk, pooler, width))


def conch_v15(trunk: nn.Module, width: int) -> nn.Module:
    """CONCH v1.5's vision tower around its ViT-L/16 trunk (``width``: 768)."""
    pooler = ProjectionPooler(width, int(trunk.num_features))  # type: ignore[arg-type]
    return VisionTower(trunk, pooler, width)


def conch_v15_positions(state: dict[str, torch.Tensor], size: int) -> dict[str, torch.Tensor]:
    """The file's position embedding (class token + a 14 x 14 grid) stretched to the grid
    of ``size`` px as TRIDENT's and TITAN's forward pass does it (DINO's bicubic interpolation
    by a scale factor of (grid + 0.1) / 14), once instead of per batch."""
    key = "trunk.pos_embed"
    positions = state.get(key)
    if positions is None or positions.ndim != 3:
        return state
    old = math.isqrt(positions.shape[1] - 1)
    new = size // 16
    if old * old != positions.shape[1] - 1 or old == new:
        return state
    dim = positions.shape[-1]
    grid = positions[:, 1:].float().reshape(1, old, old, dim).permute(0, 3, 1, 2)
    scale = (new + 0.1) / old
    grid = F.interpolate(grid, scale_factor=(scale, scale), mode="bicubic")
    grid = grid.permute(0, 2, 3, 1).reshape(1, new * new, dim)
    return {**state, key: torch.cat([positions[:, :1].float(), grid], dim=1)}
