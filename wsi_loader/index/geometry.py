"""Resolution choice and tile-grid layout.

Frames: ``l0_*`` level-0 pixels, ``l_*`` pixels of the read level, ``t_*`` tile-grid cells, and
"output" pixels (what the dataset returns: ``tile_size`` square at the target resolution).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from wsi_loader.errors import ResolutionError
from wsi_loader.slides.base import MIN_PLAUSIBLE_MPP, SlideMeta

IntArray = npt.NDArray[np.int64]

_SOURCE_NAMES = {"tiff-resolution": "TIFF resolution tag", "vendor": "scanner metadata"}

__all__ = ["ReadPlan", "grid", "plan_read"]


@dataclass(frozen=True)
class ReadPlan:
    """How one slide's tiles are read: level, window size at that level, grid step."""

    level: int
    level_downsample: float
    read_size: int  # l_w == l_h: window edge in read-level pixels
    l_stride: int  # grid step in read-level pixels
    tile_mpp: float | None  # resolution of the returned tiles (None when the slide has no MPP)
    aligned: bool  # every window starts on a storage-tile corner of the read level
    warning: str | None = None

    @property
    def l0_footprint(self) -> float:
        return self.read_size * self.level_downsample

    @property
    def l0_stride(self) -> float:
        return self.l_stride * self.level_downsample


def _mpp_reason(meta: SlideMeta, mpp: float | None) -> str:
    if mpp is None:
        return "the slide has no MPP (microns per pixel) in its metadata"
    source = _SOURCE_NAMES.get(meta.mpp_source, meta.mpp_source)
    if mpp < MIN_PLAUSIBLE_MPP:
        return (
            f"its MPP {mpp:.4g} um/px (from the {source}) is finer than a light microscope "
            "resolves (probably a wrong resolution unit)"
        )
    return (
        f"its MPP {mpp:.4g} um/px (from the {source}) is not a microscope resolution "
        "(probably a screen DPI)"
    )


def plan_read(
    meta: SlideMeta,
    tile_size: int,
    stride: int,
    *,
    mpp: float | None = None,
    level: int | None = None,
    tolerance: float = 0.1,
    slide_mpp: float | None = None,
) -> ReadPlan:
    """Choose the read level and window size for a target MPP (or a fixed level).

    The read level is the coarsest level that is still at least as fine as the target (within
    ``tolerance``); the window is scaled so it covers ``tile_size`` target pixels. Raises
    `ResolutionError` with a reason that says how to proceed.
    """
    base_mpp = slide_mpp if slide_mpp is not None else meta.usable_mpp
    if level is not None:
        if level >= meta.level_count:
            raise ResolutionError(
                f"level {level} requested but the slide has {meta.level_count} level(s) "
                f"(0..{meta.level_count - 1}); choose a smaller --level"
            )
        ds = meta.level_downsamples[level]
        return ReadPlan(
            level=level,
            level_downsample=ds,
            read_size=tile_size,
            l_stride=stride,
            tile_mpp=base_mpp * ds if base_mpp else None,
            aligned=_aligned(meta, level, stride),
        )
    if mpp is None:
        raise ValueError("give mpp or level")
    if base_mpp is None:
        raise ResolutionError(
            f"cannot index at {mpp} um/px: {_mpp_reason(meta, meta.mpp)}; index it with "
            "--level N instead, or give its MPP in the manifest's 'mpp' column"
        )
    wanted = mpp / base_mpp  # level-0 pixels per output pixel
    warning = None
    if wanted < 1.0 - tolerance:
        raise ResolutionError(
            f"the slide's resolution {base_mpp:.4g} um/px is coarser than the target {mpp} um/px "
            f"beyond the tolerance {tolerance:.0%}; use --mpp {base_mpp:.4g} or coarser"
        )
    candidates = [
        (ds, i) for i, ds in enumerate(meta.level_downsamples) if ds <= wanted * (1.0 + tolerance)
    ]
    ds, chosen = max(candidates) if candidates else (meta.level_downsamples[0], 0)
    if abs(ds - wanted) <= tolerance * wanted:
        read_size, scale = tile_size, ds  # close enough: read the level as it is
    else:
        read_size = max(1, round(tile_size * wanted / ds))
        scale = read_size * ds / tile_size
    tile_mpp = base_mpp * scale
    deviation = abs(tile_mpp - mpp) / mpp
    if deviation > 0.01:
        warning = f"tiles are {tile_mpp:.4g} um/px, {deviation:.1%} from the target {mpp} um/px"
    l_stride = max(1, round(stride * read_size / tile_size))
    return ReadPlan(
        level=chosen,
        level_downsample=ds,
        read_size=read_size,
        l_stride=l_stride,
        tile_mpp=tile_mpp,
        aligned=read_size == tile_size and _aligned(meta, chosen, l_stride),
        warning=warning,
    )


def _aligned(meta: SlideMeta, level: int, l_stride: int) -> bool:
    """Windows starting at multiples of ``l_stride`` from 0 sit on storage-tile corners."""
    if level >= len(meta.tile_sizes):
        return False
    tw, th = meta.tile_sizes[level]
    if tw <= 0 or th <= 0:  # any downsample: readers map l0 back with `l0_to_level` exactly
        return False
    return l_stride % tw == 0 and l_stride % th == 0


def grid(meta: SlideMeta, plan: ReadPlan, align: bool = True) -> tuple[IntArray, IntArray]:
    """Level-0 top-left corners of every full window of the plan, row-major.

    With ``align`` the grid starts at (0, 0), where storage tiles start; otherwise it is
    centred so the unused margin is split between both sides.
    """
    l_w, l_h = meta.level_dimensions[plan.level]
    xs = _axis(l_w, plan.read_size, plan.l_stride, align)
    ys = _axis(l_h, plan.read_size, plan.l_stride, align)
    gy, gx = np.meshgrid(ys, xs, indexing="ij")
    ds = plan.level_downsample
    # `level_to_l0` vectorised (numpy rounds halves to even, as Python's round does); readers
    # map back with `l0_to_level`, which recovers the level pixel exactly
    l0_x = np.round(gx.ravel() * ds).astype(np.int64)
    l0_y = np.round(gy.ravel() * ds).astype(np.int64)
    return l0_x, l0_y


def _axis(length: int, window: int, step: int, align: bool) -> IntArray:
    if length < window:
        return np.zeros(0, dtype=np.int64)
    count = (length - window) // step + 1
    span = (count - 1) * step + window
    offset = 0 if align else (length - span) // 2
    return offset + np.arange(count, dtype=np.int64) * step
