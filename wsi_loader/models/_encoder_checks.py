"""An index's resolution against the encoder's: features of tiles at another magnification
or size than the encoder was trained at look fine and train worse, so say so (with the
numbers and the index options that match), or refuse under ``strict``; and the batch size
that fits the device (``--batch-size auto``); a linear head on an encoder (predict's
``--head``)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from wsi_loader.errors import ConfigError
from wsi_loader.models._specs import Model, class_names_of

log = logging.getLogger(__name__)
MPP_TOLERANCE = 0.1  # a 20x index of slides scanned at 0.25 um/px reads 0.5; 10% is another scan


def resolution_problems(model: Model, params: dict[str, Any]) -> list[str]:
    """What differs between the index's build parameters and the model's training tiles."""
    problems = []
    mpp, mag = params.get("mpp"), params.get("mag")
    index_mpp = float(mpp) if mpp else (10 / float(mag) if mag else None)
    if model.mpp and index_mpp and abs(index_mpp / model.mpp - 1) > MPP_TOLERANCE:
        problems.append(
            f"{model.spec} was trained at {model.mpp:g} um/px ({10 / model.mpp:g}x) but the "
            f"index's tiles are at {index_mpp:g} um/px ({10 / index_mpp:g}x)"
        )
    elif model.mpp and not index_mpp:
        problems.append(
            f"{model.spec} was trained at {model.mpp:g} um/px ({10 / model.mpp:g}x) but the "
            f"index was built at a fixed level (level {params.get('level')}), whatever its "
            "resolution"
        )
    size = params.get("tile_size")
    if model.patch_size and size and int(size) != model.patch_size:
        problems.append(
            f"{model.spec} was trained on {model.patch_size} px patches but the index's tiles "
            f"are {int(size)} px"
        )
    return problems


def check_resolution(model: Model, params: dict[str, Any], *, strict: bool = False) -> None:
    """Warn (or with ``strict`` raise a `ConfigError`) when the index's tiles are not the
    encoder's training tiles; the advice names the index options that match."""
    problems = resolution_problems(model, params)
    if not problems:
        return
    advice = (
        f"build the index with --mpp {model.mpp:g} --tile-size {model.patch_size} (or "
        f"wsi-loader index ... --for-encoder {model.spec.removeprefix('encoder:')})"
    )
    message = "; ".join(problems) + f": {advice}"
    if strict:
        raise ConfigError(message, key="model", value=model.spec)
    log.warning("%s", message)


AUTO_BATCH_LIMIT = 1024
CPU_BATCH = 64  # on the CPU memory is not what limits a batch: the default


def auto_batch_size(module: torch.nn.Module, size: int, device: torch.device) -> int:
    """The batch size for ``--batch-size auto``: on CUDA, the largest power of two whose
    forward pass fits the device's memory (up to `AUTO_BATCH_LIMIT`), halved to leave room
    for the loader's batches and fragmentation; elsewhere `CPU_BATCH`."""
    if device.type != "cuda":
        return CPU_BATCH
    module = module.to(device).eval()
    fits, batch = 0, 1
    while batch <= AUTO_BATCH_LIMIT:
        try:
            with torch.inference_mode():
                module(torch.rand(batch, 3, size, size, device=device))
        except torch.cuda.OutOfMemoryError:
            break
        finally:
            torch.cuda.empty_cache()
        fits, batch = batch, batch * 2
    chosen = max(1, fits // 2)
    log.info("--batch-size auto: %d (batches of %d fit %s)", chosen, fits, device)
    return chosen


def with_linear_head(model: Model, head_file: str | Path) -> Model:
    """The encoder followed by a linear layer read from ``head_file`` (a ``torch.save``'d
    dict: ``weight`` (classes x dim), ``bias`` (classes), optional ``classes``), checked
    against the encoder's width."""
    where = str(head_file)
    try:
        saved = torch.load(head_file, map_location="cpu", weights_only=True)
    except (OSError, RuntimeError, ValueError, EOFError) as exc:
        raise ConfigError(f"not a readable head file ({exc})", path=where, key="head") from exc
    weight = saved.get("weight") if isinstance(saved, dict) else None
    bias = saved.get("bias") if isinstance(saved, dict) else None
    if not isinstance(weight, torch.Tensor) or weight.ndim != 2:
        raise ConfigError("a head file holds weight (classes x dim)", path=where, key="head")
    dim = int(getattr(model.model, "dim", weight.shape[1]))
    if weight.shape[1] != dim:
        raise ConfigError(
            f"the head takes {weight.shape[1]} features but {model.spec} gives {dim}",
            path=where,
            key="head",
        )
    if bias is not None and (not isinstance(bias, torch.Tensor) or bias.shape != weight.shape[:1]):
        raise ConfigError(f"bias must have {weight.shape[0]} values", path=where, key="head")
    linear = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None)
    with torch.no_grad():
        linear.weight.copy_(weight.float())
        if bias is not None:
            linear.bias.copy_(bias.float())
    classes = saved.get("classes")
    return Model(
        torch.nn.Sequential(model.model, linear),
        f"{model.spec}+head",
        classes=None if classes is None else class_names_of(classes, where),
        mpp=model.mpp,
        patch_size=model.patch_size,
    )
