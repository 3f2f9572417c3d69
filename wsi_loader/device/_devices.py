"""The device a run uses, named by the user and checked once, before any slide is read."""

from __future__ import annotations

import torch

from wsi_loader.errors import ConfigError


def resolve_device(device: str | torch.device | None) -> torch.device:
    """The torch device ``device`` names (None: cuda when there, else cpu), checked to be
    there: one clear `ConfigError` before any slide is read, not torch's traceback ("Torch
    not compiled with CUDA enabled", "Expected one of cpu, cuda, ...") from the first tensor
    moved to it."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ConfigError(
            f"device {str(device)!r} is not a device: give cpu, cuda, cuda:N or mps",
            key="device",
            value=device,
        ) from exc
    fix = f"device {str(device)!r}: {{}}; use device 'cpu'"
    if resolved.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(
                fix.format(f"CUDA is not available (torch {torch.__version__})"),
                key="device",
                value=device,
            )
        count = torch.cuda.device_count()
        if resolved.index is not None and resolved.index >= count:
            raise ConfigError(
                fix.format(f"this machine has {count} CUDA device{'s' * (count != 1)}"),
                key="device",
                value=device,
            )
    if resolved.type == "mps" and not torch.backends.mps.is_available():
        raise ConfigError(fix.format("MPS is not available"), key="device", value=device)
    return resolved
