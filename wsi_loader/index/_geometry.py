"""Resolution choice and tile-grid layout.

Frames: ``l0_*`` level-0 pixels, ``l_*`` pixels of the read level, ``t_*`` tile-grid cells, and
"output" pixels (what the dataset returns: ``tile_size`` square at the target resolution).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from wsi_loader.errors import ResolutionError
from wsi_loader.slides._base import MIN_PLAUSIBLE_MPP, SlideMeta

IntArray = npt.NDArray[np.int64]

_SOURCE_NAMES = {"tiff-resolution": "TIFF resolution tag", "vendor": "scanner metadata"}

__all__ = ["ReadPlan", "grid", "mag_disagreement", "plan_read", "tile_magnification"]

# Magnification in the field's convention: a "20x" scan is ~0.5 um/px, "40x" ~0.25 um/px
# (mpp = 10 / mag). Used for slides that state no objective power.
MAG_MPP_PRODUCT = 10.0
# Objective powers outside this are not objectives (a 0 or a pixel count in the tag).
MIN_OBJECTIVE, MAX_OBJECTIVE = 1.0, 150.0


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
    tile_mag: float | None = None  # magnification of the returned tiles (see tile_magnification)
    mag_source: str | None = None  # "objective-power" or "mpp" (10 / mpp), None without either

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


def objective_power(meta: SlideMeta) -> float | None:
    """The objective power the slide states, when it is one (1x..150x)."""
    power = meta.objective_power
    if power is None or not MIN_OBJECTIVE <= power <= MAX_OBJECTIVE:
        return None
    return power


def tile_magnification(
    meta: SlideMeta, base_mpp: float | None, l0_per_px: float
) -> tuple[float | None, str | None]:
    """The magnification of pixels that each span ``l0_per_px`` level-0 pixels, and the rule
    that gave it: the slide's objective power divided by the downsample ("objective-power"),
    else 10 / their MPP ("mpp"); (None, None) when the slide states neither."""
    power = objective_power(meta)
    if power is not None:
        return power / l0_per_px, "objective-power"
    if base_mpp is not None:
        return MAG_MPP_PRODUCT / (base_mpp * l0_per_px), "mpp"
    return None, None


def mag_disagreement(meta: SlideMeta, base_mpp: float | None, tolerance: float) -> str | None:
    """What to say of a slide whose stated objective power and MPP disagree beyond
    ``tolerance`` (a "40x" scan at 0.5 um/px): `--mag` follows the objective power."""
    power = objective_power(meta)
    if power is None or base_mpp is None:
        return None
    nominal = MAG_MPP_PRODUCT / power
    if abs(base_mpp - nominal) <= tolerance * nominal:
        return None
    return (
        f"the slide states {power:g}x but its MPP {base_mpp:.4g} um/px is "
        f"{MAG_MPP_PRODUCT / base_mpp:.3g}x by 10 / mpp ({abs(base_mpp / nominal - 1):.0%} apart, "
        f"beyond the tolerance {tolerance:.0%}); --mag follows the objective power"
    )


def plan_read(
    meta: SlideMeta,
    tile_size: int,
    stride: int,
    *,
    mpp: float | None = None,
    level: int | None = None,
    mag: float | None = None,
    tolerance: float = 0.1,
    slide_mpp: float | None = None,
) -> ReadPlan:
    """Choose the read level and window size for a target MPP, a magnification or a fixed
    level (exactly one of them).

    The read level is the coarsest level that is still at least as fine as the target (within
    ``tolerance``); the window is scaled so it covers ``tile_size`` target pixels. A
    magnification maps to level-0 pixels per tile pixel by the slide's objective power
    (``power / mag``: 20x of a 40x scan is a downsample of 2), or, for a slide that states
    none, by the field's rule ``mpp = 10 / mag``. Raises `ResolutionError` with a reason that
    says how to proceed.
    """
    base_mpp = slide_mpp if slide_mpp is not None else meta.usable_mpp
    if level is not None:
        if level >= meta.level_count:
            raise ResolutionError(
                f"level {level} requested but the slide has {meta.level_count} level(s) "
                f"(0..{meta.level_count - 1}); choose a smaller --level"
            )
        ds = meta.level_downsamples[level]
        tile_mag, mag_source = tile_magnification(meta, base_mpp, ds)
        return ReadPlan(
            level=level,
            level_downsample=ds,
            read_size=tile_size,
            l_stride=stride,
            tile_mpp=base_mpp * ds if base_mpp else None,
            aligned=_aligned(meta, level, stride),
            tile_mag=tile_mag,
            mag_source=mag_source,
        )
    wanted, target = _wanted(meta, base_mpp, mpp, mag)  # level-0 pixels per output pixel
    warning = None
    if wanted < 1.0 - tolerance:
        if mag is not None:
            finest = f"{mag * wanted:.3g}x"
            advice = f"--mag {mag * wanted:.3g} or lower"
        else:
            finest = f"{base_mpp:.4g} um/px"
            advice = f"--mpp {base_mpp:.4g} or coarser"
        raise ResolutionError(
            f"the slide's resolution {finest} is coarser than the target {target} "
            f"beyond the tolerance {tolerance:.0%}; use {advice}"
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
    tile_mpp = base_mpp * scale if base_mpp is not None else None
    tile_mag, mag_source = tile_magnification(meta, base_mpp, scale)
    deviation = abs(scale - wanted) / wanted
    if deviation > 0.01:
        delivered = f"{tile_mpp:.4g} um/px" if mag is None and tile_mpp else f"{tile_mag:.3g}x"
        warning = f"tiles are {delivered}, {deviation:.1%} from the target {target}"
    l_stride = max(1, round(stride * read_size / tile_size))
    return ReadPlan(
        level=chosen,
        level_downsample=ds,
        read_size=read_size,
        l_stride=l_stride,
        tile_mpp=tile_mpp,
        aligned=read_size == tile_size and _aligned(meta, chosen, l_stride),
        warning=warning,
        tile_mag=tile_mag,
        mag_source=mag_source,
    )


def _wanted(
    meta: SlideMeta, base_mpp: float | None, mpp: float | None, mag: float | None
) -> tuple[float, str]:
    """Level-0 pixels per output pixel for a target MPP or magnification, and the target as
    words for messages."""
    if (mpp is None) == (mag is None):
        raise ValueError("give one of mpp, mag or level")
    if mag is not None:
        power = objective_power(meta)
        if power is not None:
            return power / mag, f"{mag:g}x"
        if base_mpp is None:
            raise ResolutionError(
                f"cannot index at {mag:g}x: the slide states no objective power, and "
                f"{_mpp_reason(meta, meta.mpp)}; index it with --level N instead, or give its "
                "MPP in the manifest's 'mpp' column"
            )
        return MAG_MPP_PRODUCT / mag / base_mpp, f"{mag:g}x ({MAG_MPP_PRODUCT / mag:.4g} um/px)"
    assert mpp is not None
    if base_mpp is None:
        raise ResolutionError(
            f"cannot index at {mpp} um/px: {_mpp_reason(meta, meta.mpp)}; index it with "
            "--level N instead, or give its MPP in the manifest's 'mpp' column"
        )
    return mpp / base_mpp, f"{mpp} um/px"


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
