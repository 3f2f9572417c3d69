"""Tissue detection on a low-resolution image, by the detector that fits the slide.

- ``brightfield`` (H&E, IHC): tissue is coloured (stain) while glass is near-white or grey,
  so Otsu's threshold on saturation separates them better than brightness. Where the stain
  is uneven (dark haematoxylin, pale eosin) that threshold falls between dense cellular
  tissue and pale stroma, so pixels above a second, lower threshold (Otsu again, below the
  first, and above the glass's own saturation and noise) are tissue too where they touch
  the first: hysteresis, as Canny's edges grow from strong into weak ones.
- ``fluorescence`` (dark field): glass is black and tissue glows, so the rule inverts and
  works on intensity (the brightest channel): above the glass's own level and noise.

Either is followed by the same morphology (closing, opening, holes filled). `choose_detector`
picks one per slide from its pixels (a dark-field picture: most of it dark) unless one is
forced. The mask image comes from the lowest-resolution level (`read_mask_image`), never from
level 0 of a pyramidal slide.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import numpy as np
import numpy.typing as npt
from PIL import Image

from wsi_loader.errors import TileReadError
from wsi_loader.slides._base import ReadsScaled, RGBArray, SlideReader, level_to_l0, supports

BoolArray = npt.NDArray[np.bool_]

# Below this saturation nothing is tissue, whatever Otsu says (an all-glass image has a
# threshold too, somewhere in its noise).
MIN_SATURATION = 0.05


def otsu_threshold(values: npt.NDArray[np.floating], bins: int = 256) -> float:
    """Otsu's threshold of values in [0, 1]."""
    hist, edges = np.histogram(values, bins=bins, range=(0.0, 1.0))
    weights = hist.astype(np.float64)
    total = weights.sum()
    if total == 0:
        return 1.0
    centres = (edges[:-1] + edges[1:]) / 2
    w0 = np.cumsum(weights)
    w1 = total - w0
    sum0 = np.cumsum(weights * centres)
    mean0 = sum0 / np.maximum(w0, 1e-12)
    mean1 = (sum0[-1] - sum0) / np.maximum(w1, 1e-12)
    between = w0 * w1 * (mean0 - mean1) ** 2
    return float(edges[int(np.argmax(between)) + 1])


def saturation(rgb: RGBArray) -> npt.NDArray[np.float32]:
    """HSV saturation, (max - min) / max (0 for black). Channel by channel: numpy's reductions
    over a length-3 last axis are ~10x slower than elementwise maxima of the channels."""
    r, g, b = rgb[..., 0], rgb[..., 1], rgb[..., 2]
    high = np.maximum(np.maximum(r, g), b)
    low = np.minimum(np.minimum(r, g), b)
    # high - low cannot wrap (high >= low); black has high == low == 0, so 0 / 1 == 0
    sat: npt.NDArray[np.float32] = (high - low).astype(np.float32)
    sat /= np.maximum(high, 1).astype(np.float32)
    return sat


Detector = Literal["brightfield", "fluorescence"]
DETECTORS: tuple[Detector, ...] = ("brightfield", "fluorescence")
# A picture whose typical pixel is this dark (brightest channel, of 255) is dark field: glass
# under brightfield light is ~240, stained tissue 150-220; fluorescence glass is 0-10.
DARK_FIELD_BRIGHTNESS = 100


@dataclass(frozen=True)
class PixelRule:
    """Which pixels of a low-resolution picture are stained tissue (before morphology): the
    detector and its threshold on the slide (saturation 0..1, or intensity 0..255); for
    brightfield, ``pale``: the lower saturation above which pixels 8-connected to those above
    ``threshold`` are tissue too (pale stroma beside dense cellular tissue; None: none)."""

    detector: Detector
    threshold: float
    pale: float | None = None

    def stained(self, rgb: RGBArray) -> BoolArray:
        if self.detector == "fluorescence":
            found: BoolArray = brightness(rgb) > self.threshold
            return found
        sat = saturation(rgb)
        found = sat > self.threshold
        if self.pale is not None and self.pale < self.threshold:
            found = connected_to(sat > self.pale, found)
        return found


def connected_to(candidates: BoolArray, seeds: BoolArray) -> BoolArray:
    """The 8-connected parts of ``candidates`` holding at least one pixel of ``seeds``, and
    the seeds."""
    from scipy import ndimage  # here: index readers (spawned workers) need no scipy

    labels, count = ndimage.label(candidates, structure=np.ones((3, 3), dtype=bool))
    if count == 0:
        return seeds.copy()
    seeded = np.zeros(count + 1, dtype=bool)
    seeded[labels[seeds]] = True
    seeded[0] = False
    grown: BoolArray = seeded[labels] | seeds
    return grown


def brightness(rgb: RGBArray) -> npt.NDArray[np.uint8]:
    """The brightest channel of each pixel (a fluorescence channel is often shown in one)."""
    high: npt.NDArray[np.uint8] = np.maximum(np.maximum(rgb[..., 0], rgb[..., 1]), rgb[..., 2])
    return high


def typical_brightness(rgb: RGBArray) -> float:
    """The median brightest channel, leaving out pure black (areas a scanner did not scan,
    written as 0 by some converters): what most of the picture looks like."""
    high = brightness(rgb)
    lit = high[high > 0]
    return float(np.median(lit)) if lit.size else 0.0


def choose_detector(rgb: RGBArray, forced: str = "auto") -> tuple[Detector, str]:
    """The detector for a slide, and why: ``forced`` (brightfield / fluorescence) as given,
    else from the picture (dark field when its typical pixel is dark)."""
    typical = typical_brightness(rgb)
    looks = "dark field" if typical < DARK_FIELD_BRIGHTNESS else "bright field"
    seen = f"{looks}: typical brightness {typical:.0f}/255"
    if forced == "brightfield":
        return "brightfield", f"forced ({seen})"
    if forced == "fluorescence":
        return "fluorescence", f"forced ({seen})"
    return ("fluorescence" if typical < DARK_FIELD_BRIGHTNESS else "brightfield"), seen


def pixel_rule(rgb: RGBArray, detector: Detector) -> PixelRule:
    """The slide's threshold for ``detector``: Otsu on saturation (brightfield; at least
    `MIN_SATURATION`) and the pale tissue's (`pale_threshold`), or for fluorescence the lower
    of Otsu on log intensity and the glass's level plus four times its noise (dim tissue
    between bright nuclei is tissue)."""
    if detector == "brightfield":
        sat = saturation(rgb)
        threshold = max(otsu_threshold(sat), MIN_SATURATION)
        return PixelRule(detector, threshold, pale_threshold(rgb, sat, threshold))
    high = brightness(rgb).astype(np.float32)
    glass = float(np.percentile(high, 5))
    dark = high[high <= 2 * glass + 3]
    noise = max(1.0, float(dark.std())) if dark.size else 1.0
    scale = math.log1p(255.0)
    otsu = math.expm1(otsu_threshold(np.log1p(high) / scale) * scale)
    return PixelRule(detector, max(glass + 2.0, min(otsu, glass + 4 * noise + 2)))


GLASS_SHARE = 0.05  # the brightest pixels of a picture, this share of them, are its glass


def pale_threshold(rgb: RGBArray, sat: npt.NDArray[np.float32], threshold: float) -> float:
    """The saturation above which tissue touching the saturated tissue is tissue too: Otsu
    over the pixels at or below ``threshold`` (glass and pale tissue), but never within the
    glass's own saturation (that of the brightest `GLASS_SHARE` of pixels: its median plus
    four standard deviations) nor under `MIN_SATURATION`. On a slide without pale tissue the
    lower class is glass alone and this floor is what holds."""
    high = brightness(rgb)
    glass = sat[high >= np.quantile(high, 1 - GLASS_SHARE)]
    floor = float(np.median(glass) + 4 * glass.std()) if glass.size else 0.0
    lower = sat[sat <= threshold]
    split = otsu_threshold(lower / threshold) * threshold if lower.size and threshold > 0 else 0
    return min(threshold, max(MIN_SATURATION, floor, split))


def tissue_mask(
    rgb: RGBArray, rule: PixelRule | None = None, max_hole: int | None = None
) -> BoolArray:
    """Boolean tissue mask of a low-resolution RGB image: the stained pixels of ``rule``
    (default: brightfield, Otsu on saturation), a closing and an
    opening with the 4-neighbour cross (``radius`` times each), then holes of at most
    ``max_hole`` pixels filled (None: every hole). A larger hole (a lumen, a vessel, a tear)
    is glass, as CLAM cuts holes out of its contours: it is not tissue for the tile's tissue
    share, nor for quality control, which reads the same mask. With every hole filled, the
    same pixels as scipy.ndimage's binary_closing/opening/fill_holes (border outside = 0), in
    ~1/7 of the time: plain shifted ANDs and ORs, and one labelling for the holes."""
    mask = (rule or pixel_rule(rgb, "brightfield")).stained(rgb)
    radius = max(1, round(max(mask.shape) / 512))
    for grow in (True, False, False, True):  # closing (grow, shrink), opening (shrink, grow)
        for _ in range(radius):
            mask = cross_step(mask, grow)
    return fill_holes(mask, max_hole)


def cross_step(mask: BoolArray, grow: bool) -> BoolArray:
    """One dilation (``grow``) or erosion by the 4-neighbour cross; outside the image is
    background, so erosion eats into the border."""
    h, w = mask.shape
    padded = np.zeros((h + 2, w + 2), dtype=bool)
    padded[1:-1, 1:-1] = mask
    combine = np.logical_or if grow else np.logical_and
    out = combine(mask, padded[:-2, 1:-1])
    combine(out, padded[2:, 1:-1], out=out)
    combine(out, padded[1:-1, :-2], out=out)
    combine(out, padded[1:-1, 2:], out=out)
    return out


def fill_holes(mask: BoolArray, max_area: int | None = None) -> BoolArray:
    """The mask with every background area not 4-connected to the image's edge filled (only
    those of at most ``max_area`` pixels when given)."""
    from scipy import ndimage  # here: index readers (spawned workers) need no scipy

    labels, count = ndimage.label(~mask)
    if count == 0:
        return mask.copy()
    keep = np.zeros(count + 1, dtype=bool)  # background areas that stay background
    for side in (labels[0], labels[-1], labels[:, 0], labels[:, -1]):
        keep[side] = True
    if max_area is not None:
        keep |= np.bincount(labels.ravel(), minlength=count + 1) > max_area
    keep[0] = False  # label 0 is the mask itself
    filled: BoolArray = ~keep[labels]
    return filled


HOLE_UM = 60.0  # holes in tissue up to this square (a few cells) are tissue; larger are glass
HOLE_TILE_SHARE = 1 / 16  # without a scale: holes up to this share of a tile's area


def max_hole_pixels(um_per_px: float | None, tile_px: float) -> int:
    """The largest hole `tissue_mask` fills, in pixels of a picture at ``um_per_px`` (None:
    unknown) where a tile is ``tile_px`` pixels wide."""
    if um_per_px is not None and um_per_px > 0:
        return int((HOLE_UM / um_per_px) ** 2)
    return int(tile_px * tile_px * HOLE_TILE_SHARE)


Box = tuple[int, int, int, int]  # x0, y0, x1, y1 in output pixels


def read_mask_image(
    reader: SlideReader,
    max_size: int,
    level: int | None = None,
    unreadable: list[Box] | None = None,
) -> tuple[RGBArray, int]:
    """Read a level (the lowest-resolution one by default), shrunk so its longest side is at
    most ``max_size``.

    Returns the image and the level it came from. The level is read in chunks and box-filtered,
    so a large single-level slide never needs its full raster in memory. A chunk that fails
    raises `TileReadError`, unless ``unreadable`` is given: then the chunk is read again in
    storage-tile pieces, pieces that still fail are left white and their boxes appended to
    ``unreadable`` (so a view can draw what it can and mark the rest).
    """
    meta = reader.meta
    level = meta.level_count - 1 if level is None else level
    l_w, l_h = meta.level_dimensions[level]
    factor = max(1, math.ceil(max(l_w, l_h) / max_size))
    out_w, out_h = math.ceil(l_w / factor), math.ceil(l_h / factor)
    out = np.empty((out_h, out_w, 3), dtype=np.uint8)
    ds = meta.level_downsamples[level]

    # A reader that can shrink while decoding (libjpeg's DCT scaling: JPEG tiles at 1/2, 1/4
    # or 1/8 size) keeps a slide without a pyramid from being decoded at full resolution to
    # find its tissue (~5x faster at 1/8). Spans a multiple of ``whole`` (whole output pixels
    # and whole shrunk pixels) are read shrunk, then averaged down the rest of the way; the
    # slide's last few pixels are read as they are.
    scaler = reader if supports(reader, ReadsScaled) else None
    shrink = max((s for s in (8, 4, 2) if s <= factor), default=1) if scaler is not None else 1
    whole = math.lcm(factor, shrink)
    chunk = whole * max(1, 2048 // whole)

    def paint(l_x: int, l_y: int, w: int, h: int) -> None:
        x0, y0 = level_to_l0(l_x, ds), level_to_l0(l_y, ds)
        if scaler is not None and shrink > 1 and w % whole == 0 and h % whole == 0:
            pixels = scaler.read_region_scaled(x0, y0, level, w, h, w // shrink, h // shrink)
            pixels = _area_reduce(pixels, w // factor, h // factor)
        else:
            pixels = reader.read_region(x0, y0, level, w, h)
            if factor > 1:
                pixels = _box_reduce(pixels, factor)
        out[
            l_y // factor : l_y // factor + pixels.shape[0],
            l_x // factor : l_x // factor + pixels.shape[1],
        ] = pixels

    tile_w = meta.tile_sizes[level][0] if level < len(meta.tile_sizes) else 0
    piece = whole * max(1, math.ceil(max(tile_w, 256) / whole))  # whole output pixels
    for l_y, h in _spans(l_h, chunk, (whole, factor)):
        for l_x, w in _spans(l_w, chunk, (whole, factor)):
            try:
                paint(l_x, l_y, w, h)
            except TileReadError:
                if unreadable is None:
                    raise
                for p_y in range(l_y, l_y + h, piece):
                    for p_x in range(l_x, l_x + w, piece):
                        p_w, p_h = min(piece, l_x + w - p_x), min(piece, l_y + h - p_y)
                        try:
                            paint(p_x, p_y, p_w, p_h)
                        except TileReadError:
                            x0, y0 = p_x // factor, p_y // factor
                            x1, y1 = -(-(p_x + p_w) // factor), -(-(p_y + p_h) // factor)
                            out[y0:y1, x0:x1] = 255
                            unreadable.append((x0, y0, x1, y1))
    return out, level


def _spans(length: int, chunk: int, units: tuple[int, ...]) -> list[tuple[int, int]]:
    """(start, size) of the chunks along a side, ``chunk`` long (a multiple of ``units[0]``);
    the last is split where it stops being a multiple of each unit in turn (descending, each
    a multiple of the next), so a short remainder is read apart."""
    spans = [(start, min(chunk, length - start)) for start in range(0, length, chunk)]
    for unit in units:
        start, size = spans[-1]
        if size > unit and size % unit:
            cut = size - size % unit
            spans[-1:] = [(start, cut), (start + cut, size - cut)]
    return spans


def _area_reduce(pixels: RGBArray, out_w: int, out_h: int) -> RGBArray:
    """Shrink by averaging areas: whole blocks when the factor is an integer, else fractional
    blocks (exact areas: the running sum of a side, interpolated at the blocks' edges; PIL's
    box filter weighs whole pixels by their centres)."""
    h, w = pixels.shape[:2]
    if (w, h) == (out_w, out_h):
        return pixels
    if w % out_w == 0 and h % out_h == 0 and w // out_w == h // out_h:
        return _box_reduce(pixels, w // out_w)
    means = _area_means(_area_means(pixels.astype(np.float64), out_h, axis=0), out_w, axis=1)
    reduced: RGBArray = (means + 0.5).astype(np.uint8)
    return reduced


def _area_means(values: npt.NDArray[np.float64], count: int, axis: int) -> npt.NDArray[np.float64]:
    """Means of ``values`` over ``count`` equal (fractional) stretches of ``axis``."""
    n = values.shape[axis]
    total = np.concatenate(
        [np.zeros_like(values.take([0], axis=axis)), values.cumsum(axis=axis)], axis=axis
    )
    edges = np.arange(count + 1) * (n / count)
    whole = np.minimum(edges.astype(np.int64), n - 1)
    shape = [1] * values.ndim
    shape[axis] = count + 1
    part = (edges - whole).reshape(shape)
    at = total.take(whole, axis=axis) + part * values.take(whole, axis=axis)
    means: npt.NDArray[np.float64] = np.diff(at, axis=axis) * (count / n)
    return means


def _box_reduce(pixels: RGBArray, factor: int) -> RGBArray:
    """Mean over factor x factor blocks; partial edge blocks are padded with white. (PIL's
    reduce: ~20x faster than a numpy mean over a reshaped array.)"""
    h, w = pixels.shape[:2]
    ph, pw = math.ceil(h / factor) * factor, math.ceil(w / factor) * factor
    if (ph, pw) != (h, w):
        padded = np.full((ph, pw, 3), 255, dtype=np.uint8)
        padded[:h, :w] = pixels
        pixels = padded
    reduced: RGBArray = np.asarray(Image.fromarray(np.ascontiguousarray(pixels)).reduce(factor))
    return reduced


def tile_fractions(
    mask: BoolArray,
    l0_size: tuple[int, int],
    l0_x: npt.NDArray[np.int64],
    l0_y: npt.NDArray[np.int64],
    l0_footprint: float,
) -> npt.NDArray[np.float32]:
    """Tissue fraction of each tile (level-0 top-left, square footprint), from the mask.

    Uses a summed-area table, so the cost is O(1) per tile.
    """
    h_m, w_m = mask.shape
    sx, sy = w_m / l0_size[0], h_m / l0_size[1]
    sat = np.zeros((h_m + 1, w_m + 1), dtype=np.int64)
    sat[1:, 1:] = mask.astype(np.int64).cumsum(0).cumsum(1)

    def bounds(
        start: npt.NDArray[np.int64], scale: float, limit: int
    ) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
        lo = np.clip(np.floor(start * scale).astype(np.int64), 0, limit)
        hi = np.clip(np.ceil((start + l0_footprint) * scale).astype(np.int64), 0, limit)
        return lo, np.maximum(hi, np.minimum(lo + 1, limit))

    x0, x1 = bounds(l0_x, sx, w_m)
    y0, y1 = bounds(l0_y, sy, h_m)
    area = np.maximum((x1 - x0) * (y1 - y0), 1)
    inside = sat[y1, x1] - sat[y0, x1] - sat[y1, x0] + sat[y0, x0]
    return (inside / area).astype(np.float32)
