"""Feather (TRIDENT's ``feather``: MahmoodLab/abmil.base.conch_v15.pc108-24k) in plain torch,
with the module names of MIL-Lab's ``src/models/abmil.py`` (the ``ABMIL`` that the Hugging Face
repo's ``ABMILModel`` wraps as ``model``), so that its ``model.safetensors`` loads strictly.

Feather is attention MIL pretrained on 108 tasks: each tile's CONCH v1.5 features go through a
linear + ReLU embedding (``num_fc_layers`` of them), gated attention gives each head one score
per tile, and the embedding is the softmax-weighted sum of the embedded tiles per head, the
heads concatenated (``forward_features``, as TRIDENT calls it): 512 wide for the released
config. The widths come from the ``config.json`` beside the weights; the classifier it was
pretrained with is in the file and loaded, but not part of the embedding.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import nn


class _GatedAttention(nn.Module):
    """MIL-Lab's ``GlobalGatedAttention``."""

    def __init__(self, width: int, attention: int, heads: int) -> None:
        super().__init__()
        self.attention_a = nn.Sequential(nn.Linear(width, attention), nn.Tanh(), nn.Dropout())
        self.attention_b = nn.Sequential(nn.Linear(width, attention), nn.Sigmoid(), nn.Dropout())
        self.attention_c = nn.Linear(attention, heads)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.attention_c(self.attention_a(x) * self.attention_b(x))  # type: ignore[no-any-return]


def _embedding(in_dim: int, width: int, layers: int) -> nn.Sequential:
    """MIL-Lab's ``create_mlp(..., end_with_fc=False)``: (Linear, ReLU, Dropout) for each
    hidden layer, then Linear, ReLU (the indices are the key names)."""
    modules: list[nn.Module] = []
    for _ in range(layers - 1):
        modules += [nn.Linear(in_dim, width), nn.ReLU(), nn.Dropout()]
        in_dim = width
    return nn.Sequential(*modules, nn.Linear(in_dim, width), nn.ReLU())


class Feather(nn.Module):
    """MIL-Lab's ABMIL: (N, in_dim) tile features -> (heads * embed_dim,) embedding."""

    def __init__(
        self,
        in_dim: int = 768,
        embed_dim: int = 512,
        attn_dim: int = 384,
        num_fc_layers: int = 1,
        num_heads: int = 1,
        num_classes: int = 0,
        gate: bool = True,
    ) -> None:
        super().__init__()
        if not gate:  # (MIL-Lab's GlobalAttention: no released Feather uses it)
            raise ValueError("Feather without gated attention (gate: false) is not wired")
        self.patch_embed = _embedding(in_dim, embed_dim, num_fc_layers)
        self.global_attn = _GatedAttention(embed_dim, attn_dim, num_heads)
        if num_classes > 0:
            self.classifier = nn.Linear(embed_dim * num_heads, num_classes)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        tiles: torch.Tensor = self.patch_embed(features)  # (N, embed_dim)
        weights = torch.softmax(self.global_attn(tiles), dim=0)  # (N, heads)
        return (weights.T @ tiles).reshape(-1)


def feather_from_config(weights: Path) -> Feather:
    """The architecture the ``config.json`` beside the weights describes (on meta)."""
    path = weights.parent / "config.json"
    try:
        config: Any = json.loads(path.read_text(encoding="utf-8"))
        kwargs = {key: int(config[key]) for key in ("in_dim", "embed_dim", "attn_dim")}
        with torch.device("meta"):
            return Feather(
                **kwargs,
                num_fc_layers=int(config.get("num_fc_layers", 1)),
                num_heads=int(config.get("num_heads", 1)),  # (later MIL-Lab versions only)
                num_classes=int(config.get("num_classes", 0)),
                gate=bool(config.get("gate", True)),
            )
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(
            f"{path}: Feather's config.json (beside model.safetensors in its snapshot folder) "
            f"is missing or not MIL-Lab's ABMIL config ({type(exc).__name__}: {exc})"
        ) from exc
