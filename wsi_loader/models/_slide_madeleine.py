"""MADELEINE's slide encoder (its H&E path, ``encode_he``) in plain torch, with the module
names of mahmoodlab/MADELEINE's ``madeleine/models/Model.py``, so that ``model.pt`` of
MahmoodLab/madeleine loads strictly.

MADELEINE embeds a slide's CONCH v1 tile features (512 wide, 256 px tiles at 10x) with a
three-layer pre-attention MLP (Linear, LayerNorm, GELU) widening each tile to ``heads``
vectors of 512, gated attention per head (``BatchedABMIL``: softmax over the tiles by
default), the attention-weighted sum per head, and a linear projection of the heads, laid out
as MADELEINE lays them (channel-major, head-minor), to 512. ``heads``, the width and the
attention activation come from the ``model_config.json`` beside the weights.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F  # noqa: N812

ATTENTION_WIDTH = 512  # BatchedABMIL's hidden_dim and the output width, fixed in Model.py
ACTIVATIONS = ("softmax", "leaky_relu", "relu", "sigmoid")


class _GatedAttention(nn.Module):
    """MADELEINE's ``BatchedABMIL`` (one head)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.attention_a = nn.Sequential(nn.Linear(width, ATTENTION_WIDTH), nn.Tanh())
        self.attention_b = nn.Sequential(nn.Linear(width, ATTENTION_WIDTH), nn.Sigmoid())
        self.attention_c = nn.Linear(ATTENTION_WIDTH, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.attention_c(self.attention_a(x) * self.attention_b(x))  # type: ignore[no-any-return]


class _Embedder(nn.Module):
    """MADELEINE's ``ABMILEmbedder``."""

    def __init__(self, input_dim: int, width: int, heads: int) -> None:
        super().__init__()
        # Linear, LayerNorm, GELU, Dropout three times (the indices are the key names)
        self.pre_attn = nn.Sequential(
            nn.Linear(input_dim, width), nn.LayerNorm(width), nn.GELU(), nn.Dropout(0.1),
            nn.Linear(width, width), nn.LayerNorm(width), nn.GELU(), nn.Dropout(0.1),
            nn.Linear(width, width * heads), nn.LayerNorm(width * heads), nn.GELU(),
            nn.Dropout(0.1),
        )  # fmt: skip
        self.attn = nn.ModuleList(_GatedAttention(width) for _ in range(heads))


class Madeleine(nn.Module):
    """MADELEINE's H&E slide encoder: (N, 512) CONCH v1 features -> (512,) embedding."""

    def __init__(
        self, input_dim: int = 512, width: int = 512, heads: int = 4, activation: str = "softmax"
    ) -> None:
        super().__init__()
        self.heads, self.activation = heads, activation
        self.token_projector = nn.Linear(ATTENTION_WIDTH * heads, 128)  # (not on this path)
        self.wsi_embedders = _Embedder(input_dim, width, heads)
        self.projector = nn.Linear(ATTENTION_WIDTH * heads, ATTENTION_WIDTH)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        tokens = self.wsi_embedders.pre_attn(features)  # (N, width * heads)
        tokens = tokens.view(len(tokens), -1, self.heads)  # (N, width, heads): head-minor
        pooled = []
        for head, attention in enumerate(self.wsi_embedders.attn):
            weights = _activate(attention(tokens[:, :, head]), self.activation)  # (N, 1)
            pooled.append((tokens[:, :, head] * weights).sum(dim=0))
        return self.projector(torch.stack(pooled, dim=-1).reshape(-1))  # type: ignore[no-any-return]


def _activate(scores: torch.Tensor, activation: str) -> torch.Tensor:
    if activation == "softmax":
        return torch.softmax(scores, dim=0)
    if activation == "leaky_relu":
        return F.leaky_relu(scores)
    if activation == "relu":
        return F.relu(scores)
    return torch.sigmoid(scores)


def madeleine_from_config(weights: Path) -> Madeleine:
    """The architecture ``model_config.json`` beside the weights describes (on meta)."""
    path = weights.parent / "model_config.json"
    try:
        config: Any = json.loads(path.read_text(encoding="utf-8"))
        heads, width = int(config["n_heads"]), int(config["wsi_encoder_hidden_dim"])
        input_dim = int(config["patch_embedding_dim"])
        activation = str(config.get("activation", "softmax"))
        if config.get("wsi_encoder", "abmil") != "abmil" or activation not in ACTIVATIONS:
            raise ValueError(
                f"wsi_encoder {config.get('wsi_encoder')!r}, activation {activation!r}"
            )
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(
            f"{path}: MADELEINE's model_config.json (beside model.pt in its snapshot folder) "
            f"is missing or not MADELEINE's ({type(exc).__name__}: {exc})"
        ) from exc
    with torch.device("meta"):
        return Madeleine(input_dim, width, heads, activation)
