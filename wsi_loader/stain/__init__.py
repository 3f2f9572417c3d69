"""Stain normalisation and augmentation of whole batches: numpy/OpenCV in the DataLoader
workers, torch on the device, with the same per-tile parameters from each slide's stain in the
index (`_transforms` explains the transforms).

- `_transforms`: the base `StainTransform` (its numpy and torch paths), `Normalize` (Macenko,
  Reinhard) and `StainPipeline` (transforms in order)
- `_augment`: the augmentations `HEDJitter`, `StainJitter` and `RandStain`
- `_kernels`: the two per-pixel kernels (optical density, CIELAB), each in numpy/OpenCV and torch
- `_targets`: the stain a normalisation goes to (`resolve_target`) and the per-slide tables
- `_build`: transforms from ``stain=`` values, export specs, ``--stain`` options and configs

The stain of each slide (Macenko vectors, Reinhard moments) is estimated at index time, in
`wsi_loader.index._stain_estimates`; its `write_reference` (a target frozen to a file) is
re-exported here.

May import: `slides`, `index` and the foundation modules; imports torch. Imported by `dataset`
and `device` (and the later steps).
"""

from wsi_loader.index._stain_estimates import write_reference
from wsi_loader.stain._augment import HEDJitter, RandStain, StainJitter
from wsi_loader.stain._build import as_stain, stain_from_config, stain_from_options
from wsi_loader.stain._targets import resolve_target
from wsi_loader.stain._transforms import Normalize, StainTransform

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
    "write_reference",
]
