"""Stain normalisation and augmentation of whole batches: numpy in the workers, torch on the device.

Each transform maps uint8 RGB tiles ``(N, H, W, 3)`` to uint8 RGB tiles of the same shape, using
each tile's slide statistics from the index (`wsi_loader.index.stain`), so normalising a batch is
a fixed per-pixel map per tile, not a per-tile estimate:

- `Normalize` ``("macenko")``: optical density, one 3x3 matrix per slide (its stain vectors to
  the target's, concentrations scaled by the maximum concentrations), exp. ``("reinhard")``:
  CIELAB, a per-channel affine map from the slide's moments to the target's, back to RGB.
  ``per_tile=True`` estimates every tile on its own instead, as torchstain does (for comparison).
- `HEDJitter` (Tellez 2019): each HED channel scaled by U(1-sigma, 1+sigma) and shifted by
  U(-bias, bias), in scikit-image's HED space (``rgb2hed``/``hed2rgb``).
- `StainJitter`: the slide's H and E vectors perturbed and their concentrations scaled.
- `RandStain` (after RandStainNA, 2022): a Reinhard target drawn per tile from the spread of the
  archive's slide statistics.

The random ones draw per tile from ``(seed, epoch, row)``, so a tile gets the same colours
whatever the worker count or batch it lands in. A list of transforms applies them in order.

Every transform has two paths with the same per-tile parameters (computed in numpy): `apply_numpy`
for CPU batches in DataLoader workers (OpenCV's SIMD kernels, ~4x plain numpy; never torch's
intra-op threads) and `apply_torch` for tensors on the device (`wsi_loader.gpu.DeviceLoader`).
A transform needs the index it reads (``bind``): `TileDataset`, `make_loader`, `DeviceLoader`,
export and features bind it for you.
"""

from wsi_loader.stain._transforms import (
    HEDJitter,
    Normalize,
    RandStain,
    StainJitter,
    StainTransform,
    as_stain,
    resolve_target,
    stain_from_config,
    stain_from_options,
)

__all__ = [
    "HEDJitter",
    "Normalize",
    "RandStain",
    "StainJitter",
    "StainTransform",
    "as_stain",
    "resolve_target",
    "stain_from_config",
    "stain_from_options",
]
