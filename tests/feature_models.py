"""Small encoders for feature-extraction tests (importable as ``tests.feature_models:NAME``)."""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import torch
from torch import nn


class PoolLinear(nn.Module):
    """Global average and max pool + a linear layer: cheap, so tests measure the data path,
    and sensitive to every pixel's colour (a wrong or shifted tile gives other features)."""

    def __init__(self, dim: int = 16, delay_s: float = 0.0) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(0)
        self.linear = nn.Linear(6, dim)
        with torch.no_grad():
            self.linear.weight.copy_(torch.randn(dim, 6, generator=generator))
            self.linear.bias.copy_(torch.randn(dim, generator=generator))
        self.delay_s = delay_s

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.delay_s:
            time.sleep(self.delay_s)  # a slow model, for tests that kill a run midway
        pooled = torch.cat([x.mean(dim=(2, 3)), x.amax(dim=(2, 3))], dim=1)
        return self.linear(pooled)


class MeanLinear(nn.Module):
    """Global average pool + linear: the cheapest encoder, for benchmarks of the data path."""

    def __init__(self, dim: int = 16) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.linear = nn.Linear(3, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x.mean(dim=(2, 3)))


def tiny() -> Any:
    """The encoder with ImageNet normalisation and its tiles resized to 64 px on the device."""
    return PoolLinear(), {"mean": (0.485, 0.456, 0.406), "std": (0.229, 0.224, 0.225), "size": 64}


def plain() -> nn.Module:
    """No preprocessing: pixels / 255 at the read size."""
    return PoolLinear()


def slow() -> nn.Module:
    return PoolLinear(delay_s=0.5)


def not_a_model() -> str:
    return "nope"


class Misbehaving(nn.Module):
    """`PoolLinear` whose output goes wrong in one of the ways models do (``how``); ``calls``
    counts the batches it has seen (the first batch is the first slide's)."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.inner = PoolLinear()
        self.how = how
        self.calls = 0

    def forward(self, x: torch.Tensor) -> Any:
        self.calls += 1
        y = self.inner(x)
        if self.how == "nan_first_slide" and self.calls == 1:
            return y * float("nan")
        if self.how == "inf":
            return y.masked_fill(torch.arange(len(y))[:, None] == 0, float("inf"))
        if self.how == "twice_the_rows":  # (2B, D): reshaped to (B, 2D) before, silently
            return torch.cat([y, y])
        if self.how == "one_row_short":
            return y[:-1]
        if self.how == "tuple":
            return y, y
        if self.how == "integers":
            return y.round().long()
        if self.how == "width_changes" and self.calls > 1:
            return y[:, :8]
        return y


def nan_first_slide() -> nn.Module:
    return Misbehaving("nan_first_slide")


def inf() -> nn.Module:
    return Misbehaving("inf")


def twice_the_rows() -> nn.Module:
    return Misbehaving("twice_the_rows")


def one_row_short() -> nn.Module:
    return Misbehaving("one_row_short")


def returns_tuple() -> nn.Module:
    return Misbehaving("tuple")


def integers() -> nn.Module:
    return Misbehaving("integers")


def width_changes() -> nn.Module:
    return Misbehaving("width_changes")


# -- classifiers for predict -----------------------------------------------------------------
def classifier() -> Any:
    """Two classes named as the test index's labels, ImageNet normalisation, 64 px input."""
    return PoolLinear(dim=2), {
        "mean": (0.485, 0.456, 0.406),
        "std": (0.229, 0.224, 0.225),
        "size": 64,
        "classes": ["normal", "tumour"],
    }


def classifier_plain() -> nn.Module:
    """Two outputs, no names, no preprocessing (pixels / 255 at the read size)."""
    return PoolLinear(dim=2)


def slow_classifier() -> nn.Module:
    return PoolLinear(dim=2, delay_s=0.3)


def nan_classifier() -> nn.Module:
    return _NanFirst()


class _NanFirst(nn.Module):
    """NaN for the first batch read (the first slide's); predict runs it once before, on a
    blank tile, to count its outputs."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = PoolLinear(dim=2)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        y = self.inner(x)
        return y * float("nan") if self.calls == 2 else y


class Oriented(nn.Module):
    """Two logits from the mean of the top row and of the left column: a flip or a turn of
    the tile changes them (test-time augmentation must average the views)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.stack([x[:, :, 0, :].mean(dim=(1, 2)), x[:, :, :, 0].mean(dim=(1, 2))], 1)


def oriented() -> nn.Module:
    return Oriented()


class BagAttention(nn.Module):
    """Attention-MIL over a padded batch of bags: (features (B, N, D), mask (B, N)) ->
    (logits (B, 2), attention (B, N))."""

    def __init__(self, dim: int = 16) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(1)
        self.score = nn.Linear(dim, 1)
        self.classify = nn.Linear(dim, 2)
        with torch.no_grad():
            for layer in (self.score, self.classify):
                layer.weight.copy_(torch.randn(layer.weight.shape, generator=generator))
                layer.bias.zero_()

    def forward(
        self, features: torch.Tensor, mask: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        scores = self.score(features).squeeze(-1).masked_fill(~mask, float("-inf"))
        attention = scores.softmax(dim=1)
        pooled = (attention.unsqueeze(-1) * features).sum(dim=1)
        return self.classify(pooled), attention


def bag_model() -> nn.Module:
    return BagAttention()


class OneOutput(nn.Module):
    """A single logit per tile: -5 everywhere (sigmoid 0.0067, "not tumour" at any usual
    threshold) plus a tiny share of the tile's mean, so tiles differ."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.mean(dim=(1, 2, 3))[:, None] * 1e-3 - 5.0


def one_output() -> Any:
    return OneOutput(), {"classes": ["tumour"]}


class MapOutput(nn.Module):
    """Two classes per pixel of a 4 x 4 map (B, 2, 4, 4), or pooled to (B, 2, 1, 1)."""

    def __init__(self, side: int) -> None:
        super().__init__()
        self.side = side

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pooled = torch.nn.functional.adaptive_avg_pool2d(x[:, :2], self.side)
        return pooled


def map_output() -> nn.Module:
    return MapOutput(4)


def map_output_1x1() -> nn.Module:
    return MapOutput(1)


class OneOutputBag(nn.Module):
    """A bag model of a single logit, -5 (sigmoid 0.0067) plus a trace of the bag's mean."""

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return features.mean(dim=(1, 2))[:, None] * 1e-3 - 5.0


def one_output_bag() -> Any:
    return OneOutputBag(), {"classes": ["tumour"]}


class DiesOnce(PoolLinear):
    """`PoolLinear` (same weights) whose process kills itself (SIGKILL, as a lost node's
    workers die) on its second batch, once for good: the first process that creates the file
    ``marker`` dies, the ones after it (a restarted Ray actor) run on. ``marker=None``: never."""

    def __init__(self, marker: str | None) -> None:
        super().__init__()
        self.marker = marker
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.marker is not None and self.calls == 2:
            try:
                open(self.marker, "x").close()
            except FileExistsError:
                pass
            else:
                os.kill(os.getpid(), signal.SIGKILL)
        return super().forward(x)
