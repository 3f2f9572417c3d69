"""Prov-GigaPath's slide encoder (``gigapath_slide_enc12l768d``: LongNet, 12 layers, 768 wide)
in plain torch, with the module names of prov-gigapath's ``gigapath/slide_encoder.py`` and its
torchscale copy, so that ``slide_encoder.pth`` (its ``model`` entry) loads strictly.

What it does with a slide, as the README's usage runs it (``slide_encoder(tile_embed, coords)``:
``global_pool=False``, the last layer): the 1,536-wide tile features are projected to 768 and
given a fixed 2-D sine-cosine position embedding of their tile on a 1,000 x 1,000 grid (tile
``floor(x / tile) * 1000 + floor(y / tile)`` of the table, ``tile`` the level-0 tile edge as
TRIDENT sets it), a class token is put first, and 12 pre-norm LongNet layers attend with dilated
attention: five branches (segment lengths 1024 ... 2^20 tokens, dilation 1, 2, 4, 8, 16), head
group ``j`` of a dilation ``r`` branch attending among the tokens at ``j`` mod ``r`` of each
segment, zero-padded tokens included as keys as the authors' flash-attention path has them, the
branches mixed by their softmax normalisers. The embedding is the class token after the
encoder's final norm and the model's ``norm``. (TRIDENT differs: global average pooling, and
the output of layer 11 before the final norm.)
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F  # noqa: N812

IN, WIDTH, DEPTH, HEADS, FFN = 1536, 768, 12, 16, 3072
GRID = 1000  # slide_ngrids: the position embedding's grid edge
DILATIONS = (1, 2, 4, 8, 16)
# get_optimal_segment_length(262144, 256): 2 ** linspace(10, 20, 5), truncated
SEGMENTS = tuple(int(2**v) for v in (10.0, 12.5, 15.0, 17.5, 20.0))


class _Projection(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(IN, WIDTH)


class _DilatedAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.k_proj = nn.Linear(WIDTH, WIDTH)
        self.v_proj = nn.Linear(WIDTH, WIDTH)
        self.q_proj = nn.Linear(WIDTH, WIDTH)
        self.out_proj = nn.Linear(WIDTH, WIDTH)
        self.inner_attn_ln = nn.LayerNorm(WIDTH)  # torchscale's subln

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, length, _ = x.shape
        q, k, v = (p(x).view(b, length, HEADS, -1) for p in (self.q_proj, self.k_proj, self.v_proj))
        outs, lses = [], []
        for segment, ratio in zip(SEGMENTS, DILATIONS, strict=True):
            qi, ki, vi = (_gather(t, ratio, segment) for t in (q, k, v))
            out, lse = _attention(qi, ki, vi)
            out, lse = _scatter(out, lse, ratio, b, length)
            outs.append(out)
            lses.append(lse)
        stacked = torch.stack(lses)
        weights = torch.exp(stacked - stacked.max(0).values)
        weights = weights / weights.sum(0)
        mixed = sum(o * w.type_as(o) for o, w in zip(outs, weights, strict=True))
        assert isinstance(mixed, torch.Tensor)
        mixed = mixed.view(b, HEADS, length, -1).transpose(1, 2).reshape(b, length, WIDTH)
        return self.out_proj(self.inner_attn_ln(mixed))  # type: ignore[no-any-return]


def _gather(x: torch.Tensor, ratio: int, segment: int) -> torch.Tensor:
    """(b, L, H, d) -> (b * segments, l, H, d): the sequence cut into segments (the last
    zero-padded), each thinned so that head group j keeps its tokens at j mod ratio."""
    _, length, heads, d = x.shape
    size = min(segment, length)
    x = F.pad(x, (0, 0, 0, 0, 0, -length % size))
    x = x.reshape(-1, size, heads, d)
    x = F.pad(x, (0, 0, 0, 0, 0, -size % ratio))
    x = x.reshape(x.shape[0], -1, ratio, ratio, heads // ratio, d)  # b l r1 r2 h d
    x = torch.diagonal(x, dim1=2, dim2=3)  # b l h d r
    return x.permute(0, 1, 4, 2, 3).reshape(x.shape[0], x.shape[1], heads, d)


def _attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention per head (b, l, H, d) -> the output and the log of each query's
    softmax normaliser (b, H, l), as flash-attention returns them."""
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * q.shape[-1] ** -0.5
    lse = torch.logsumexp(scores.float(), dim=-1)
    out = torch.einsum("bhqk,bkhd->bqhd", torch.exp(scores.float() - lse[..., None]).type_as(v), v)
    return out, lse


def _scatter(
    out: torch.Tensor, lse: torch.Tensor, ratio: int, b: int, length: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each head group's tokens back in their places (zero output and a normaliser of -1e8
    where a group has none): (b * H, L, d) and (b * H, L, 1)."""
    n, thin, heads, d = out.shape
    dense = out.view(n, thin, ratio, heads // ratio, d).permute(0, 1, 3, 4, 2)
    dense = torch.diag_embed(dense, dim1=4, dim2=5)  # b l h d r1 r2
    dense = dense.permute(0, 5, 2, 1, 4, 3).reshape(n, heads, thin * ratio, d)
    norm = lse.view(n, ratio, heads // ratio, thin).permute(0, 3, 2, 1)
    norm = torch.diag_embed(norm, dim1=3, dim2=4)
    norm = norm.masked_fill(norm == 0, -1e8)
    norm = norm.permute(0, 4, 2, 1, 3).reshape(n, heads, thin * ratio, 1)
    dense = dense.view(b, -1, heads, thin * ratio, d).transpose(1, 2)
    norm = norm.view(b, -1, heads, thin * ratio, 1).transpose(1, 2)
    dense = dense.reshape(b * heads, -1, d)[:, :length]
    norm = norm.reshape(b * heads, -1, 1)[:, :length]
    return dense, norm


class _FeedForward(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(WIDTH, FFN)
        self.fc2 = nn.Linear(FFN, WIDTH)
        self.ffn_layernorm = nn.LayerNorm(FFN)  # torchscale's subln

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc1(x)
        return self.fc2(self.ffn_layernorm(F.gelu(h.float()).type_as(h)))  # type: ignore[no-any-return]


class _Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.self_attn = _DilatedAttention()
        self.self_attn_layer_norm = nn.LayerNorm(WIDTH)
        self.ffn = _FeedForward()
        self.final_layer_norm = nn.LayerNorm(WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.self_attn_layer_norm(x))
        return x + self.ffn(self.final_layer_norm(x))  # type: ignore[no-any-return]


class _Encoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_Layer() for _ in range(DEPTH))
        self.layer_norm = nn.LayerNorm(WIDTH)


class GigaPathSlide(nn.Module):
    """Prov-GigaPath's slide encoder: one slide's (N, 1536) tile features with their level-0
    coordinates -> its (768,) embedding."""

    def __init__(self) -> None:
        super().__init__()
        self.patch_embed = _Projection()
        self.cls_token = nn.Parameter(torch.zeros(1, 1, WIDTH))
        self.encoder = _Encoder()
        self.norm = nn.LayerNorm(WIDTH, eps=1e-6)

    def forward(
        self, features: torch.Tensor, coords: torch.Tensor, patch_size_level0: int
    ) -> torch.Tensor:
        cells = torch.floor(coords.double() / patch_size_level0).long()
        index = cells[:, 0] * GRID + cells[:, 1]
        if int(index.min()) < 0 or int(index.max()) >= GRID * GRID:
            raise ValueError(
                f"tiles beyond Prov-GigaPath's {GRID} x {GRID} tile grid (coordinates "
                f"{coords.min(0).values.tolist()} to {coords.max(0).values.tolist()} at "
                f"{patch_size_level0} px a tile)"
            )
        x = self.patch_embed.proj(features) + sincos(index).to(features.dtype)
        x = torch.cat([self.cls_token[0], x])[None]
        for layer in self.encoder.layers:
            x = layer(x)
        return self.norm(self.encoder.layer_norm(x))[0, 0]  # type: ignore[no-any-return]


def sincos(index: torch.Tensor) -> torch.Tensor:
    """Rows ``index`` of the fixed 2-D sine-cosine table (MAE's get_2d_sincos_pos_embed on
    the grid, less its class-token row): 384 values of ``index % 1000`` (the table's ``w``),
    then 384 of ``index // 1000``."""
    omega = 1.0 / 10000 ** (torch.arange(WIDTH // 4, dtype=torch.float64) / (WIDTH // 4))
    parts = []
    for position in (index % GRID, index // GRID):
        angle = position.double()[:, None] * omega.to(index.device)
        parts += [torch.sin(angle), torch.cos(angle)]
    return torch.cat(parts, dim=1).float()
