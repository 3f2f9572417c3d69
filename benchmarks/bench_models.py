"""The models the feature benchmarks run, on both sides (imports torch only: `clam_real.py`
runs in another Python)."""

from __future__ import annotations

from torch import nn

from tests.feature_models import MeanLinear


def make_model(kind: str) -> nn.Module:
    """``cheap``: global average pool + linear (the data path is what is measured); ``cnn``: a
    small three-layer CNN, a model that keeps the CPU busy."""
    if kind == "cheap":
        return MeanLinear().eval()
    return nn.Sequential(
        nn.Conv2d(3, 32, 3, 2, 1), nn.ReLU(), nn.Conv2d(32, 64, 3, 2, 1), nn.ReLU(),
        nn.Conv2d(64, 128, 3, 2, 1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
        nn.Linear(128, 16),
    ).eval()  # fmt: skip
