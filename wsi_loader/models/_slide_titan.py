"""TITAN's slide encoder (its vision tower) in plain torch, with the module names of the
``vision_transformer.py`` that MahmoodLab/TITAN's Hugging Face repo serves, so that the
``vision_encoder.*`` tensors of its ``model.safetensors`` load strictly.

What TITAN does with a slide (``encode_slide_from_patch_features``, as TRIDENT calls it):
tiles are placed on a grid by their level-0 coordinates, ``(coords - min) // patch_size_lv0``
(row = x, column = y, as TITAN indexes them); cells without a tile, and cells whose features
are all zero, are background and left out; tiles falling in one cell are summed (TITAN adds
them with ``index_add_``). The cells' CONCH v1.5 features go through a linear + GELU embedding,
a class token is put first, and six pre-norm transformer blocks attend with a 2-D ALiBi bias
(minus each head's slope times the Euclidean grid distance; none to or from the class token).
The embedding is the contrastive attentional pooler's output (one query) without the
projection (``no_proj=True``): 768 wide. The 128-query pooler (``attn_pool``) and ``proj`` are
in the file and loaded, but not used for the embedding.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F  # noqa: N812

WIDTH, DEPTH, HEADS, MLP_RATIO = 768, 6, 12, 4.0  # TitanVisionConfig's defaults
POOLER_HEADS, POOLER_QUERIES = 8, 128  # TitanConfig sets attentional_pool="parallel"


class _Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(WIDTH, WIDTH * 3)
        self.proj = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        b, n, c = x.shape
        q, k, v = self.qkv(x).reshape(b, n, 3, HEADS, c // HEADS).permute(2, 0, 3, 1, 4)
        x = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
        return self.proj(x.transpose(1, 2).reshape(b, n, c))  # type: ignore[no-any-return]


class _Mlp(nn.Module):
    """timm's ``Mlp`` (fc1, GELU, fc2): its key names."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(WIDTH, int(WIDTH * MLP_RATIO))
        self.fc2 = nn.Linear(int(WIDTH * MLP_RATIO), WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))  # type: ignore[no-any-return]


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(WIDTH, eps=1e-6)
        self.attn = _Attention()
        self.norm2 = nn.LayerNorm(WIDTH, eps=1e-6)
        self.mlp = _Mlp()

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), bias)
        return x + self.mlp(self.norm2(x))  # type: ignore[no-any-return]


class _Blocks(nn.Module):
    """TITAN's ``CustomSequential`` (the blocks are ``blocks.modules_list.<i>``)."""

    def __init__(self) -> None:
        super().__init__()
        self.modules_list = nn.ModuleList(_Block() for _ in range(DEPTH))


class _AttentionalPooler(nn.Module):
    """CoCa's attentional pooler: learned queries attending to the tokens."""

    def __init__(self, queries: int) -> None:
        super().__init__()
        self.query = nn.Parameter(torch.zeros(queries, WIDTH))
        self.attn = nn.MultiheadAttention(WIDTH, POOLER_HEADS, kdim=WIDTH, vdim=WIDTH)
        self.ln_q = nn.LayerNorm(WIDTH)  # torch's default eps, as TITAN's pooler has
        self.ln_k = nn.LayerNorm(WIDTH)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """(L, D) tokens of one slide -> (queries, D)."""
        keys = self.ln_k(tokens)[:, None]  # (L, 1, D): sequence first
        out, _ = self.attn(self.ln_q(self.query)[:, None], keys, keys, need_weights=False)
        return out[:, 0]  # type: ignore[no-any-return]


class Titan(nn.Module):
    """TITAN's vision tower: one slide's (N, 768) CONCH v1.5 features with their level-0
    coordinates -> its (768,) embedding."""

    def __init__(self) -> None:
        super().__init__()
        self.patch_embed = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.GELU())
        self.cls_token = nn.Parameter(torch.zeros(1, 1, WIDTH))
        self.blocks = _Blocks()
        self.norm = nn.LayerNorm(WIDTH, eps=1e-6)
        self.attn_pool = _AttentionalPooler(POOLER_QUERIES)
        self.attn_pool_contrastive = _AttentionalPooler(1)
        self.proj = nn.Parameter(torch.zeros(WIDTH, WIDTH))

    def forward(
        self, features: torch.Tensor, coords: torch.Tensor, patch_size_level0: int
    ) -> torch.Tensor:
        cells, rows, cols = grid_cells(features.float(), coords, patch_size_level0)
        x = self.patch_embed(cells)
        x = torch.cat([self.cls_token[0], x])[None]  # (1, 1 + n, D)
        bias = alibi(rows, cols).to(x.dtype)
        for block in self.blocks.modules_list:
            x = block(x, bias)
        return self.attn_pool_contrastive(self.norm(x[0]))[0]  # type: ignore[no-any-return]


def grid_cells(
    features: torch.Tensor, coords: torch.Tensor, patch_size_level0: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The slide's non-empty grid cells in row-major order: their features (n, D) and their
    row and column (n,) each (see the module's docstring)."""
    grid = torch.div(coords - coords.min(dim=0).values, patch_size_level0, rounding_mode="floor")
    height, width = (int(v) + 1 for v in grid.max(dim=0).values)
    index = grid[:, 0] * width + grid[:, 1]
    cells = torch.zeros(height * width, features.shape[1], device=features.device)
    cells.index_add_(0, index, features)
    present = torch.nonzero((cells != 0).any(dim=1))[:, 0]
    return cells[present], present // width, present % width


def alibi(rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """TITAN's 2-D ALiBi bias (1, heads, 1 + n, 1 + n): minus each head's slope times the
    Euclidean distance between cells; zero in the class token's row and column."""
    points = torch.stack([rows, cols], dim=1).double()
    distances = torch.cdist(points, points).float()
    slopes = torch.tensor(_slopes(HEADS), dtype=torch.float32, device=rows.device)
    n = len(rows)
    bias = torch.zeros(1, HEADS, n + 1, n + 1, device=rows.device)
    bias[0, :, 1:, 1:] = distances[None] * slopes[:, None, None] * -1
    return bias


def _slopes(heads: int) -> list[float]:
    """ALiBi's head slopes (Press et al.): a geometric series for a power of two; else those
    of the power below, then every other slope of the power above."""
    if math.log2(heads).is_integer():
        p = 2 ** (-(2 ** -(math.log2(heads) - 3)))
        return [p * p**i for i in range(heads)]
    below = 2 ** math.floor(math.log2(heads))
    return _slopes(below) + _slopes(2 * below)[0::2][: heads - below]
