"""Stain normalisation and augmentation of whole batches: numpy in the workers, torch on the device.

Each transform maps uint8 RGB tiles ``(N, H, W, 3)`` to uint8 RGB tiles of the same shape, using
each tile's slide statistics from the index (`wsi_loader.index._stain_estimates`), so
normalising a batch is a fixed per-pixel map per tile, not a per-tile estimate:

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
intra-op threads) and `apply_torch` for tensors on the device (`wsi_loader.device.DeviceLoader`).
A transform needs the index it reads (``bind``): `TileDataset`, `make_loader`, `DeviceLoader`,
export and features bind it for you.

This module holds the base `StainTransform` (the two paths around a kernel), `Normalize` and
`StainPipeline`; the kernels are `_kernels`, the targets and per-slide tables `_targets`, the
augmentations `_augment`, and building transforms from specs and configs `_build`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar

import numpy as np
import numpy.typing as npt
import torch

from wsi_loader.errors import ConfigError, InputError
from wsi_loader.index._stain_estimates import (
    IO,
    StainEstimate,
    fit_lab,
    fit_macenko,
    single_threaded_opencv,
)
from wsi_loader.index._table import SlideIndex
from wsi_loader.stain._kernels import Floats, LabAffine, LogLinear, UInt8s
from wsi_loader.stain._targets import SlideTables, resolve_target


@dataclass(frozen=True)
class TileParams:
    """One batch's per-tile parameters: ``a`` and ``b`` (the kernel's), and which tiles change."""

    a: Floats
    b: Floats
    active: npt.NDArray[np.bool_]


_NO_TABLES = SlideTables(
    np.zeros((0, 3, 2)), np.zeros((0, 2)), np.zeros((0, 3)), np.zeros((0, 3)), np.zeros(0, bool)
)


@dataclass(frozen=True, kw_only=True)
class StainTransform:
    """Base of the stain transforms (see the module's docstring). Subclasses give the kernel
    and `params`; ``bind`` fills the per-slide tables (and the target) from an index."""

    seed: int = 0
    tables: SlideTables = field(default=_NO_TABLES, repr=False, compare=False)
    bound: bool = field(default=False, repr=False, compare=False)

    kernel: Any = field(default=None, init=False, repr=False, compare=False)
    salt: int = field(default=0, init=False, repr=False)  # separates the random streams of ops

    # whether ``bind`` reads the slides' estimates (`SlideTables`)
    per_slide: ClassVar[bool] = True

    def bind(self, index: SlideIndex, tables: SlideTables | None = None) -> StainTransform:
        """Bound to ``index``: its slides' estimates (``tables``, when the caller read them
        already: `StainPipeline.bind` reads them once for its steps)."""
        tables = SlideTables.from_index(index) if tables is None else tables
        return replace(self, tables=tables, bound=True)

    def params(
        self,
        images: UInt8s | None,
        slide_ids: npt.NDArray[np.int64],
        rows: npt.NDArray[np.int64],
        epoch: int,
    ) -> TileParams:
        raise NotImplementedError

    def spec(self) -> dict[str, Any]:
        """A JSON description (export settings); `from_spec` makes the transform again."""
        raise NotImplementedError

    def _check_bound(self) -> None:
        if not self.bound:
            raise ConfigError(
                f"{type(self).__name__} is not bound to an index: call .bind(index) (the "
                "datasets, make_loader, DeviceLoader and export do it)",
                key="stain",
            )

    def _rngs(self, rows: npt.NDArray[np.int64], epoch: int) -> list[np.random.Generator]:
        return [np.random.default_rng([self.salt, self.seed, epoch, int(r)]) for r in rows]

    def _slides(self, slide_ids: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
        ids = np.asarray(slide_ids, dtype=np.int64)
        if len(ids) and (ids.min() < 0 or ids.max() >= len(self.tables.valid)):
            raise ConfigError(
                f"slide id {int(ids.max())} is not in the index this transform was bound to "
                f"({len(self.tables.valid)} slides)",
                key="stain",
            )
        return ids

    def apply_numpy(
        self,
        images: UInt8s,
        slide_ids: npt.ArrayLike,
        rows: npt.ArrayLike,
        epoch: int = 0,
        ok: npt.ArrayLike | None = None,
    ) -> None:
        """Transform a uint8 NHWC batch in place (tiles that are not ``ok`` are left alone)."""
        self._check_bound()
        single_threaded_opencv()
        p = self.params(images, np.asarray(slide_ids), np.asarray(rows), epoch)
        active = p.active if ok is None else p.active & np.asarray(ok, dtype=bool)
        # float scratch once per batch: a fresh 0.8 MB array per pass of every tile costs
        # page faults (benchmarks/README.md, "Stain kernels")
        work = (np.empty(images.shape[1:], np.float32), np.empty(images.shape[1:], np.float32))
        for i in np.flatnonzero(active):
            tile = images[i]
            if not tile.flags.c_contiguous:
                done = np.empty_like(tile)
                self.kernel.numpy(np.ascontiguousarray(tile), p.a[i], p.b[i], done, work)
                tile[...] = done
            else:
                self.kernel.numpy(tile, p.a[i], p.b[i], tile, work)

    def apply_torch(
        self,
        images: torch.Tensor,
        slide_ids: torch.Tensor | npt.ArrayLike,
        rows: torch.Tensor | npt.ArrayLike,
        epoch: int = 0,
        ok: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """A transformed copy of a uint8 NHWC tensor, on its device."""
        self._check_bound()
        host = None
        if self.needs_pixels:
            host = images.cpu().numpy()
        p = self.params(host, _host(slide_ids), _host(rows), epoch)
        active = p.active if ok is None else p.active & _host(ok).astype(bool)
        if not active.any():
            return images
        device = images.device
        a = torch.as_tensor(p.a, dtype=torch.float32, device=device)
        b = torch.as_tensor(p.b, dtype=torch.float32, device=device)
        out: torch.Tensor = self.kernel.torch(images, a, b)
        if active.all():
            return out
        keep = torch.as_tensor(active, device=device)[:, None, None, None]
        return torch.where(keep, out, images)

    @property
    def needs_pixels(self) -> bool:
        return False


def _host(values: torch.Tensor | npt.ArrayLike) -> np.ndarray:
    if isinstance(values, torch.Tensor):
        return values.detach().cpu().numpy()
    return np.asarray(values)


@dataclass(frozen=True)
class Normalize(StainTransform):
    """Normalise every tile to ``target`` from its slide's stain (`resolve_target` lists the
    targets; None: the index's archive reference). ``method``: "macenko" or "reinhard";
    ``per_tile``: estimate each tile instead of using its slide's values (torchstain's way:
    slower and noisier; a tile whose estimate fails falls back to its slide's). Tiles of
    slides without an estimate pass unchanged either way."""

    method: str = "macenko"
    target: Any = None
    per_tile: bool = False
    resolved: StainEstimate | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.method not in ("macenko", "reinhard"):
            raise ConfigError(
                f"method must be 'macenko' or 'reinhard', got {self.method!r}", key="method"
            )
        kernel = LogLinear(io=IO) if self.method == "macenko" else LabAffine()
        object.__setattr__(self, "kernel", kernel)
        if (
            self.resolved is None
            and self.target is not None
            and not isinstance(self.target, (SlideIndex, str, os.PathLike))
        ):  # images and estimates resolve now; paths and indexes when bound
            object.__setattr__(self, "resolved", resolve_target(self.target, None, self.per_tile))
            object.__setattr__(self, "target", None)

    def bind(self, index: SlideIndex, tables: SlideTables | None = None) -> Normalize:
        resolved = self.resolved or resolve_target(self.target, index, self.per_tile)
        tables = SlideTables.from_index(index) if tables is None else tables
        return replace(self, tables=tables, bound=True, resolved=resolved)

    @property
    def needs_pixels(self) -> bool:
        return self.per_tile

    def params(
        self,
        images: UInt8s | None,
        slide_ids: npt.NDArray[np.int64],
        rows: npt.NDArray[np.int64],
        epoch: int,
    ) -> TileParams:
        assert self.resolved is not None
        ids = self._slides(slide_ids)
        t = self.tables
        he, max_c = t.he[ids], t.max_c[ids]
        mean, std = t.lab_mean[ids], t.lab_std[ids]
        active = t.valid[ids].copy()
        if self.per_tile:
            assert images is not None
            # tiles of slides without an estimate (fluorescence, too little stain) pass
            # unchanged, as they do per slide: their own fit would take them for H&E
            for i in np.flatnonzero(active):
                tile = images[i]
                # `fit_image`'s values of this method only: the other's cost as much again
                try:
                    if self.method == "macenko":
                        he[i], max_c[i] = fit_macenko(np.ascontiguousarray(tile))
                    else:
                        mean[i], own_std = fit_lab(np.ascontiguousarray(tile))
                        std[i] = np.maximum(own_std, 1e-6)
                except (InputError, ValueError, np.linalg.LinAlgError):
                    continue  # too little tissue: the slide's values
                active[i] = True
        target = self.resolved
        if self.method == "macenko":
            ratio = np.asarray(target.max_c) / max_c  # (N, 2)
            a = target.matrix()[None] @ (ratio[:, :, None] * np.linalg.pinv(he))
            return TileParams(a, np.zeros((len(ids), 3)), active)
        scale = np.asarray(target.lab_std) / std
        return TileParams(scale, np.asarray(target.lab_mean) - mean * scale, active)

    def spec(self) -> dict[str, Any]:
        assert self.resolved is not None
        return {
            "transform": "normalize",
            "method": self.method,
            "per_tile": self.per_tile,
            "target": self.resolved.as_json(),
        }


@dataclass(frozen=True)
class StainPipeline:
    """Transforms applied in order (what a list given as ``stain=`` becomes)."""

    steps: tuple[StainTransform, ...]

    @property
    def bound(self) -> bool:
        return all(s.bound for s in self.steps)

    def bind(self, index: SlideIndex, warn: bool = True) -> StainPipeline:
        """Each step bound to ``index``; with ``warn``, one WARNING naming the slides without
        an estimate (a run binds once with it; its units and loaders bind again without).
        The slides' estimates are read once for all the steps (parsing them costs about as
        much as opening the index)."""
        tables = SlideTables.from_index(index) if any(s.per_slide for s in self.steps) else None
        bound = StainPipeline(tuple(s.bind(index, tables) for s in self.steps))
        with_tables = [s.tables for s in bound.steps if s.tables is not _NO_TABLES]
        if warn and with_tables:
            with_tables[0].warn_missing(index)
        return bound

    def apply_numpy(
        self,
        images: UInt8s,
        slide_ids: npt.ArrayLike,
        rows: npt.ArrayLike,
        epoch: int = 0,
        ok: npt.ArrayLike | None = None,
    ) -> None:
        for step in self.steps:
            step.apply_numpy(images, slide_ids, rows, epoch, ok)

    def apply_torch(
        self,
        images: torch.Tensor,
        slide_ids: Any,
        rows: Any,
        epoch: int = 0,
        ok: torch.Tensor | None = None,
    ) -> torch.Tensor:
        for step in self.steps:
            images = step.apply_torch(images, slide_ids, rows, epoch, ok)
        return images

    def spec(self) -> list[dict[str, Any]]:
        return [s.spec() for s in self.steps]
