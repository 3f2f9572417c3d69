"""Architectures in our own code: CLAM's truncated ResNet-50 (torchvision's ResNet-50 through
layer 3, the key layout of torchvision's and timm's ResNet-50 files) and CTransPath's
convolutional stem (the patch embedding it puts on timm's Swin-T)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


class Bottleneck(nn.Module):
    """torchvision's ResNet bottleneck (stride on the 3x3 convolution, ResNet v1.5)."""

    expansion = 4

    def __init__(self, inplanes: int, planes: int, stride: int = 1) -> None:
        super().__init__()
        width = planes
        self.conv1 = nn.Conv2d(inplanes, width, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, planes * 4, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(planes * 4)
        self.relu = nn.ReLU(inplace=True)
        self.downsample: nn.Module | None = None
        if stride != 1 or inplanes != planes * 4:
            self.downsample = nn.Sequential(
                nn.Conv2d(inplanes, planes * 4, 1, stride=stride, bias=False),
                nn.BatchNorm2d(planes * 4),
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return torch.relu(out + identity)


class ResNet50Trunc(nn.Module):
    """ResNet-50 through layer 3: (B, 3, H, W) -> (B, 1024, H/16, W/16) (the encoder pools)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 64, 7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, stride=2, padding=1)
        inplanes = 64
        for i, (planes, blocks, stride) in enumerate(((64, 3, 1), (128, 4, 2), (256, 6, 2)), 1):
            layer = [Bottleneck(inplanes, planes, stride)]
            inplanes = planes * 4
            layer += [Bottleneck(inplanes, planes) for _ in range(blocks - 1)]
            self.add_module(f"layer{i}", nn.Sequential(*layer))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        for name in ("layer1", "layer2", "layer3"):
            x = self.get_submodule(name)(x)
        return x


def resnet50_trunc() -> ResNet50Trunc:
    return ResNet50Trunc()


class ConvStem(nn.Module):
    """CTransPath's patch embedding: two stride-2 3x3 convolutions then a 1x1 projection
    (4x downsampling, as Swin's 4x4 patches), in timm's ``embed_layer`` interface."""

    def __init__(
        self,
        img_size: Any = 224,
        patch_size: Any = 4,
        in_chans: int = 3,
        embed_dim: int = 768,
        norm_layer: Any = None,
        flatten: bool = True,
        output_fmt: Any = None,
        **_: Any,
    ) -> None:
        super().__init__()
        size = img_size if isinstance(img_size, tuple) else (img_size, img_size)
        step = patch_size if isinstance(patch_size, tuple) else (patch_size, patch_size)
        self.img_size = size
        self.patch_size = step
        self.grid_size = (size[0] // step[0], size[1] // step[1])
        self.num_patches = self.grid_size[0] * self.grid_size[1]
        stem: list[nn.Module] = []
        channels_in, channels_out = in_chans, embed_dim // 8
        for _step in range(2):
            stem += [
                nn.Conv2d(channels_in, channels_out, 3, stride=2, padding=1, bias=False),
                nn.BatchNorm2d(channels_out),
                nn.ReLU(inplace=True),
            ]
            channels_in, channels_out = channels_out, channels_out * 2
        stem.append(nn.Conv2d(channels_in, embed_dim, 1))
        self.proj = nn.Sequential(*stem)
        self.norm = norm_layer(embed_dim) if norm_layer else nn.Identity()
        self.flatten = flatten

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.proj(x).permute(0, 2, 3, 1)  # NHWC, as timm's Swin takes it
        return self.norm(x)  # type: ignore[no-any-return]
