"""Seeded random weights in a hub file's (or a peer model's state dict's) key layout, for the
encoder tests (nothing is ever downloaded), and an independent ResNet-50 forward written from
torchvision's definition."""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping
from pathlib import Path

import torch
from torch.nn import functional as F  # noqa: N812

_CODES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.int64: "I64"}


def is_norm_weight(name: str) -> bool:
    """Whether ``name`` is a normalisation layer's weight, which random weights keep near one:
    its module is named ``*norm*`` (timm's ``norm1``, ``fc_norm``) or ``ln*`` (open_clip's
    ``ln_1``, TITAN's ``ln_q``); torchscale (MUSK) puts its norms' parts before ``.A``/``.B``
    (``self_attn.inner_attn_ln.A.weight``), so the whole name is looked at."""
    module = name.split(".")[-2] if "." in name else ""
    return name.endswith(".weight") and (
        "norm" in name or module.startswith("ln") or "_ln." in name
    )


def seeded_like(
    state: Mapping[str, torch.Tensor], seed: int = 0, *, fan_in: bool = False
) -> dict[str, torch.Tensor]:
    """Seeded random tensors in ``state``'s layout (its floating-point tensors; the others
    kept), scaled so that activations stay in range: noise times 0.02, or with ``fan_in``
    (the slide encoders' few wide layers) matrices divided by the root of their fan-in and
    vectors by 10; norms' weights (`is_norm_weight`) one plus that."""
    generator = torch.Generator().manual_seed(seed)
    out = {}
    for name, value in state.items():
        if not value.is_floating_point():
            out[name] = value
            continue
        noise = torch.randn(value.shape, generator=generator)
        norm = is_norm_weight(name)
        if not fan_in:
            new = noise * 0.02
        elif value.ndim >= 2 and not norm:
            new = noise / value.shape[-1] ** 0.5
        else:
            new = noise / 10
        out[name] = new + 1 if norm else new
    return out


def write_safetensors(path: Path, state: dict[str, torch.Tensor]) -> None:
    """A safetensors file written from its specification (JSON header, raw little-endian
    data), independent of the reader under test."""
    header: dict[str, object] = {}
    blobs = []
    offset = 0
    for name, tensor in state.items():
        data = tensor.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy().tobytes()
        header[name] = {
            "dtype": _CODES[tensor.dtype],
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + len(data)],
        }
        blobs.append(data)
        offset += len(data)
    encoded = json.dumps(header).encode()
    encoded += b" " * (-len(encoded) % 8)
    path.write_bytes(struct.pack("<Q", len(encoded)) + encoded + b"".join(blobs))


def resnet50_state(seed: int = 0) -> dict[str, torch.Tensor]:
    """torchvision's ResNet-50 key layout (through fc), seeded: convolutions scaled so that
    activations stay in range, batch-norm statistics positive."""
    generator = torch.Generator().manual_seed(seed)
    state: dict[str, torch.Tensor] = {}

    def conv(name: str, out: int, inp: int, k: int) -> None:
        fan = inp * k * k
        state[name] = torch.randn(out, inp, k, k, generator=generator) * (2 / fan) ** 0.5

    def bn(name: str, n: int, scale: float = 1.0) -> None:
        state[f"{name}.weight"] = scale * (1 + 0.1 * torch.randn(n, generator=generator))
        state[f"{name}.bias"] = 0.1 * torch.randn(n, generator=generator)
        state[f"{name}.running_mean"] = 0.1 * torch.randn(n, generator=generator)
        state[f"{name}.running_var"] = 0.5 + torch.rand(n, generator=generator)
        state[f"{name}.num_batches_tracked"] = torch.tensor(100)

    conv("conv1.weight", 64, 3, 7)
    bn("bn1", 64)
    inplanes = 64
    for i, (planes, blocks) in enumerate(((64, 3), (128, 4), (256, 6), (512, 3)), 1):
        for b in range(blocks):
            p = f"layer{i}.{b}"
            conv(f"{p}.conv1.weight", planes, inplanes, 1)
            bn(f"{p}.bn1", planes)
            conv(f"{p}.conv2.weight", planes, planes, 3)
            bn(f"{p}.bn2", planes)
            conv(f"{p}.conv3.weight", planes * 4, planes, 1)
            bn(f"{p}.bn3", planes * 4, scale=0.2)  # residual branches small: features O(1)
            if b == 0:
                conv(f"{p}.downsample.0.weight", planes * 4, inplanes, 1)
                bn(f"{p}.downsample.1", planes * 4, scale=0.5)
            inplanes = planes * 4
    state["fc.weight"] = torch.randn(1000, 2048, generator=generator) * 0.01
    state["fc.bias"] = torch.zeros(1000)
    return state


def resnet50_layer3_pooled(state: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """CLAM's ResNet-50 feature: torchvision's forward through layer 3 (stride on the 3x3
    convolution), then an adaptive average pool: (B, 3, H, W) ImageNet-normalized -> (B,
    1024). Functional, from the state dict alone."""

    def bn(t: torch.Tensor, name: str) -> torch.Tensor:
        return F.batch_norm(
            t,
            state[f"{name}.running_mean"],
            state[f"{name}.running_var"],
            state[f"{name}.weight"],
            state[f"{name}.bias"],
            training=False,
            eps=1e-5,
        )

    x = F.relu(bn(F.conv2d(x, state["conv1.weight"], stride=2, padding=3), "bn1"))
    x = F.max_pool2d(x, 3, stride=2, padding=1)
    for i, blocks in enumerate((3, 4, 6), 1):
        for b in range(blocks):
            p = f"layer{i}.{b}"
            stride = 2 if b == 0 and i > 1 else 1
            out = F.relu(bn(F.conv2d(x, state[f"{p}.conv1.weight"]), f"{p}.bn1"))
            out = F.conv2d(out, state[f"{p}.conv2.weight"], stride=stride, padding=1)
            out = F.relu(bn(out, f"{p}.bn2"))
            out = bn(F.conv2d(out, state[f"{p}.conv3.weight"]), f"{p}.bn3")
            if b == 0:
                w = state[f"{p}.downsample.0.weight"]
                x = bn(F.conv2d(x, w, stride=stride), f"{p}.downsample.1")
            x = F.relu(out + x)
    return x.mean(dim=(2, 3))
