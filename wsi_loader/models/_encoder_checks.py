"""An index's resolution against the encoder's: features of tiles at another magnification
or size than the encoder was trained at look fine and train worse, so say so (with the
numbers and the index options that match), or refuse under ``strict``; and the batch size
that fits the device (``--batch-size auto``)."""

from __future__ import annotations

import logging
from typing import Any

import torch

from wsi_loader.errors import ConfigError
from wsi_loader.models._specs import Model

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
