"""CHIEF's slide encoder in plain torch, with the module names of CHIEF's own
``models/CHIEF.py`` (hms-dbmi/CHIEF), so that ``CHIEF_pretraining.pth`` loads strictly.

CHIEF (``size_arg="small"``) is a gated attention-MIL network over CHIEF's CTransPath tile
features (768 wide). Its slide embedding (``WSI_feature``) is the attention-weighted mean of
the tile features as given: softmax over tiles of the gated attention score, times the
input features (not the projected ones). Coordinates play no part. The anatomical-site text
embedding (``organ_embedding``, ``text_to_vision``) only enters CHIEF's classification output
(``WSI_feature_anatomical``), not the embedding, so it is loaded (the file holds it) but unused
here; TRIDENT passes site 0 for the same reason.
"""

from __future__ import annotations

import torch
from torch import nn

# CHIEF's size_dict["small"]: input width, attention width, gate width
SMALL = (768, 512, 256)
ORGANS = 19  # rows of CHIEF's anatomical-site text embeddings (Text_emdding.pth)


class _GatedAttention(nn.Module):
    """CHIEF's ``Attn_Net_Gated`` (dropout on, as CHIEF builds it; off in eval)."""

    def __init__(self, width: int, gate: int) -> None:
        super().__init__()
        self.attention_a = nn.Sequential(nn.Linear(width, gate), nn.Tanh(), nn.Dropout(0.25))
        self.attention_b = nn.Sequential(nn.Linear(width, gate), nn.Sigmoid(), nn.Dropout(0.25))
        self.attention_c = nn.Linear(gate, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """One attention score per tile: (N, width) -> (N, 1)."""
        return self.attention_c(self.attention_a(x) * self.attention_b(x))  # type: ignore[no-any-return]


class _AttentionHead(nn.Module):
    """CHIEF's ``Att_Head``: in its checkpoint, not used by the embedding."""

    def __init__(self, width: int, gate: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(width, gate)
        self.fc2 = nn.Linear(gate, 1)


class Chief(nn.Module):
    """CHIEF's slide encoder: (N, 768) tile features -> (768,) slide embedding."""

    def __init__(self) -> None:
        super().__init__()
        width, hidden, gate = SMALL
        # CHIEF's attention_net: [Linear, ReLU, Dropout, Attn_Net_Gated] (indices are key names)
        self.attention_net = nn.Sequential(
            nn.Linear(width, hidden), nn.ReLU(), nn.Dropout(0.25), _GatedAttention(hidden, gate)
        )
        self.classifiers = nn.Linear(hidden, 2)
        self.instance_classifiers = nn.ModuleList([nn.Linear(hidden, 2) for _ in range(2)])
        self.att_head = _AttentionHead(hidden, gate)
        self.text_to_vision = nn.Sequential(nn.Linear(768, hidden), nn.ReLU(), nn.Dropout(0.25))
        self.register_buffer("organ_embedding", torch.zeros(ORGANS, 768))

    def attention(self, features: torch.Tensor) -> torch.Tensor:
        """The tiles' attention weights (softmax over tiles): (N, 768) -> (N,)."""
        return torch.softmax(self.attention_net(features)[:, 0], dim=0)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.attention(features) @ features
