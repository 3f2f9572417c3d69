"""What each pixel of a slide's low-resolution picture shows, for quality control: pen ink,
folded tissue, an air bubble, glass.

Pen inks as histolab (after the "Deep Histopath" filters) defines them: a pixel is blue ink
when for one of 12 threshold triples red < R, green < G and blue > B, green ink likewise
with green > G (15 triples), red ink with red > R, green < G, blue < B (9 triples), and red
rather than magenta (intense eosin, TCGA's deep pink, passes the red triples). Black ink,
which those filters lack, is dark and grey: no channel above 90 and little colour. Each
colour's triples are folded into one 256 x 256 table over (red, green) holding the
bound on blue, so a pixel costs one lookup and one comparison whatever the number of
triples (the triples tested one by one cost ~36 comparisons a pixel).
"""

from __future__ import annotations

from functools import cache

import numpy as np
import numpy.typing as npt
from PIL import Image

from wsi_loader.index._tissue import BoolArray, cross_step, fill_holes
from wsi_loader.slides._base import RGBArray

# (red, green, blue) thresholds of histolab's pen filters (filters/image_filters_functions.py)
BILINEAR = Image.Resampling.BILINEAR

BLUE_PEN = (
    (60, 120, 190), (120, 170, 200), (175, 210, 230), (145, 180, 210), (37, 95, 160),
    (30, 65, 130), (130, 155, 180), (40, 35, 85), (30, 20, 65), (90, 90, 140),
    (60, 60, 120), (110, 110, 175),
)  # fmt: skip
GREEN_PEN = (
    (150, 160, 140), (70, 110, 110), (45, 115, 100), (30, 75, 60), (195, 220, 210),
    (225, 230, 225), (170, 210, 200), (20, 30, 20), (50, 60, 40), (30, 50, 35),
    (65, 70, 60), (100, 110, 105), (165, 180, 180), (140, 140, 150), (185, 195, 195),
)  # fmt: skip
RED_PEN = (
    (150, 80, 90), (110, 20, 30), (185, 65, 105), (195, 85, 125), (220, 115, 145),
    (125, 40, 70), (200, 120, 150), (100, 50, 65), (85, 25, 45),
)  # fmt: skip
RED_INK_HUE = 3  # red ink: (blue - green) at most 3/10 of (red - green), a hue >= 342 degrees
GREEN_INK_MARGIN = 30  # green ink: green this far above red and blue (no H&E pixel is)
BLACK_INK_MAX = 90  # black ink: no channel above this...
BLACK_INK_CHROMA = 35  # ...and channels this close (dense nuclei are purple even when dark)

FOLD_DENSITY = 1.8  # a fold absorbs this many times the tissue around it, or more
FOLD_HUE_COSINE = 0.97  # ...in the same colour (two layers of the same tissue)
HUE_PARTS = 3  # a fold is compared with the tissue around of its own hue: this many hues
# a fold over pale tissue (judged against it only as a band, `folded`):
PALE_DENSITY = 1.4  # ...this many times the pale tissue of its hue around it, a candidate
SIDE_DENSITY = 1.8  # ...this many times the tissue on both sides of it (5 x 5 means)
SIDE_TISSUE = 0.8  # ...a side is tissue over this share of its 5 x 5 pixels
SIDE_PALE = 0.6  # ...and pale tissue over this share (the tissue the fold lies on)
BAND_LENGTH = 2.5  # ...and the band this many times as long as it is wide
# a "fold" touching a pen stroke whose share of red absorbed differs from the tissue around
# by more than this fraction is the stroke going on over tissue (red ink absorbs less red
# than eosin, green, blue and black more); two layers of one tissue absorb in its proportions
INKED_RED_SHARE = 0.15
# ...and the other way round: "ink" nearly all of whose pixels have the optical density's
# proportions of the tissue of a hue around them (cosine at least this) is that tissue
# lying on itself, a fold (the doubled dark-haematoxylin core passes histolab's blue
# triples); marker ink, laid over the stain or not, has its own colour
LAYER_HUE_COSINE = 0.998
LAYER_SHARE = 0.9  # ...over this share of its pixels
LAYER_DENSITY = 1.3  # ...half of its pixels this many times as dense as that tissue
LAYER_GLASS = 0.1  # ...and at most this share of the pixels around it glass (a stroke runs on)


@cache
def _pen_tables() -> tuple[npt.NDArray[np.int16], npt.NDArray[np.int16], npt.NDArray[np.int16]]:
    """Per (red, green): the blue above which a pixel is blue ink, above which it is green
    ink, and below which it is red ink (256 / -1: never)."""
    r = np.arange(256)[:, None]
    g = np.arange(256)[None, :]
    blue = np.full((256, 256), 256, dtype=np.int16)
    green = np.full((256, 256), 256, dtype=np.int16)
    red = np.full((256, 256), -1, dtype=np.int16)
    for tr, tg, tb in BLUE_PEN:
        blue = np.where((r < tr) & (g < tg), np.minimum(blue, tb), blue)
    for tr, tg, tb in GREEN_PEN:
        green = np.where((r < tr) & (g > tg), np.minimum(green, tb), green)
    for tr, tg, tb in RED_PEN:
        red = np.where((r > tr) & (g < tg), np.maximum(red, tb), red)
    return blue, green, red


def pen_ink(rgb: RGBArray) -> BoolArray:
    """Pixels of pen ink: blue, green or red as histolab defines them, or black."""
    blue, other = pen_inks(rgb)
    return blue | other


def pen_inks(rgb: RGBArray) -> tuple[BoolArray, BoolArray]:
    """Pixels of blue ink, and of the other inks (green, red, black), apart: a slide whose
    tissue is mostly "blue ink" is stained blue (Giemsa, methylene blue), which no other
    ink colour is under a brightfield stain. Green is also any clearly green pixel (green
    above red and blue by `GREEN_INK_MARGIN`): histolab's triples ask for some blue and
    miss a saturated green marker."""
    blue_above, green_above, red_below = _pen_tables()
    r, g, b = rgb[..., 0], rgb[..., 1], rgb[..., 2]
    b16 = b.astype(np.int16)
    # red ink is red, not magenta: intense eosin passes histolab's red triples too, but its
    # hue is ~330 degrees, a red marker's 345-360 (in the red-magenta sector the hue is
    # 360 - 60 (b - g) / (r - g) degrees, so hue >= 342 is (b - g) <= 0.3 (r - g))
    g16 = g.astype(np.int16)
    red = (b16 < red_below[r, g]) & (10 * (b16 - g16) <= RED_INK_HUE * (r.astype(np.int16) - g16))
    ink: BoolArray = (b16 > blue_above[r, g]) | (b16 > green_above[r, g]) | red
    ink |= (g16 >= r.astype(np.int16) + GREEN_INK_MARGIN) & (g16 >= b16 + GREEN_INK_MARGIN)
    high = np.maximum(np.maximum(r, g), b)
    low = np.minimum(np.minimum(r, g), b)
    black = (high <= BLACK_INK_MAX) & (high - low <= BLACK_INK_CHROMA)
    # blue: ink whose strongest channel is blue (histolab's green triples take dark blues too)
    blue: BoolArray = ink & (b == high) & ~black
    return blue, (ink & ~blue) | black


def optical_density(rgb: RGBArray) -> npt.NDArray[np.float32]:
    """Per-channel optical density, -log10(I / 255) (Beer-Lambert: what stain absorbs)."""
    table = -np.log10(np.maximum(np.arange(256, dtype=np.float32), 1.0) / 255.0)
    density: npt.NDArray[np.float32] = table.astype(np.float32)[rgb]
    return density


def tissue_layers(
    rgb: RGBArray,
    ink: BoolArray,
    blue: BoolArray,
    stained: BoolArray,
    tissue: BoolArray,
    window: int,
) -> BoolArray:
    """The connected parts (8-neighbours) of ``ink`` that are tissue lying on itself: at
    least `LAYER_SHARE` of their pixels are blue ink (``blue``, `pen_inks`) whose optical
    density (3 x 3 means) points within `LAYER_HUE_COSINE` of the typical density of the
    ``stained`` tissue of one of its hues around them (`hue_parts`; tissue within 2 pixels
    of ink left out, which ink tints), half of them `LAYER_DENSITY` times as dense, and
    they lie within the section: at most `LAYER_GLASS` of the pixels within 2 of them are
    glass (neither ``tissue`` nor ink). Two layers of a tissue absorb in its proportions,
    and a dense haematoxylin doubled passes histolab's blue triples; a marker stroke has
    its own colour and runs over the glass too. Blue is the one ink of a stain's hue: red
    ink is redder than eosin (`RED_INK_HUE`), green is no stain's, black is grey (and tints
    the tissue around it, so the two agree)."""
    if not ink.any() or not stained.any():
        return np.zeros(ink.shape, dtype=bool)
    from scipy import ndimage  # here: index readers (spawned workers) need no scipy

    labels, count = ndimage.label(ink, structure=np.ones((3, 3), dtype=bool))
    sizes = np.bincount(labels.ravel(), minlength=count + 1)
    ring = ndimage.grey_dilation(labels, size=5) * ~ink
    rings = np.bincount(ring.ravel(), minlength=count + 1)
    glass = np.bincount(ring[~tissue].ravel(), minlength=count + 1)
    inside = glass <= LAYER_GLASS * rings
    inside &= np.bincount(labels[ink & blue], minlength=count + 1) >= LAYER_SHARE * sizes
    inside[0] = False
    if not inside.any():  # no blue stroke within the section: nothing to compare
        return np.zeros(ink.shape, dtype=bool)
    reference = stained & ~ndimage.binary_dilation(ink, iterations=2)
    if not reference.any():
        return np.zeros(ink.shape, dtype=bool)
    raw = optical_density(rgb)
    density = ndimage.uniform_filter(raw, (3, 3, 1), mode="nearest")
    strength = _norm(density)
    best = np.zeros(ink.shape, dtype=np.float32)
    ratio = np.zeros(ink.shape, dtype=np.float32)
    for part in hue_parts(raw, reference):
        around = _typical_around(raw, part, window)
        around_strength = np.maximum(_norm(around), 1e-6)
        cosine = _cosine(density, strength, around, around_strength)
        closer = cosine > best
        ratio = np.where(closer, strength / around_strength, ratio)
        best = np.maximum(best, cosine)
    pixels = ink & blue & (best >= LAYER_HUE_COSINE)
    alike = np.bincount(labels[pixels], minlength=count + 1)
    denser = np.bincount(labels[ink & (ratio >= LAYER_DENSITY)], minlength=count + 1)
    layer = inside & (alike >= LAYER_SHARE * sizes) & (2 * denser >= sizes)
    layer[0] = False
    found: BoolArray = layer[labels]
    return found


def folded(
    rgb: RGBArray,
    stained: BoolArray,
    ink: BoolArray,
    window: int,
    min_area: int,
    tissue: BoolArray | None = None,
    reach: float = 0.0,
) -> BoolArray:
    """Pixels of tissue lying on itself: two layers absorb twice as much light (optical
    density x2) in the same colour. A stained pixel is folded when its density is at least
    `FOLD_DENSITY` times that of the stained tissue around it (within about ``window``
    pixels; not the slide's, since a dense region is no fold) and points the same way in
    colour space (a band of darker *other* tissue, such as epidermis beside dermis, has
    another colour). Areas under ``min_area`` pixels (a speck, a cluster of nuclei) and the
    rims of pen strokes (ink thinning out over tissue) are no folds.

    A fold over tissue too pale to count as stained (``tissue``: all of it, pale included)
    is judged against that pale tissue too, but only as a band: `PALE_DENSITY` times the
    pale tissue of its hue around it, `SIDE_DENSITY` times the pale tissue within ``reach``
    pixels on both sides of it along a row or a column (`between`), `BAND_LENGTH` times as
    long as it is wide (`_long`) and not within a tenth of ``reach`` of ink. Dense tissue
    beside loose tissue is wider than that or has dense tissue on its other side, and a
    dense nodule is round: neither is a fold. Where such a band runs on beside dense tissue
    or along the section's edge (pale tissue on one side only), the rest of it is found
    from the band (`_band_on`)."""
    if not stained.any():
        return np.zeros(stained.shape, dtype=bool)
    from scipy import ndimage  # here: index readers (spawned workers) need no scipy

    raw = optical_density(rgb)
    # a fold is an area: each pixel is judged by its 3 x 3 neighbourhood's density, so the
    # speckle of nuclei and noise neither makes nor breaks one
    density = ndimage.uniform_filter(raw, (3, 3, 1), mode="nearest")
    strength = _norm(density)
    # ...against the tissue of its own colour around it: a fold over pale stroma is twice
    # the stroma's density, not the mean of the stroma and the dense cellular tissue beside it
    own_hue = np.zeros_like(density)
    for part in hue_parts(density, stained):
        own_hue[part] = _typical_around(raw, part, window)[part]
    # ...or against all the tissue around (where the hues' parts are too few to tell apart)
    fold = _denser(density, strength, own_hue) | _denser(
        density, strength, _typical_around(raw, stained, window)
    )
    rims = ndimage.binary_dilation(ink, iterations=1)
    fold = _areas(fold & stained & ~rims)
    if tissue is not None and reach > 0 and (tissue & ~stained).any():
        # ...or against the tissue of its hue around it, pale included: over pale stroma the
        # stained tissue around is the dense cellular tissue beside it (or the fold itself),
        # as dense as the fold; a band only (dense tissue beside loose tissue is no band)
        pale_hue = np.zeros_like(density)
        for part in hue_parts(density, tissue):
            pale_hue[part] = _typical_around(raw, part, window)[part]
        over_pale = _areas(_denser(density, strength, pale_hue, PALE_DENSITY) & stained & ~rims)
        near_ink = ndimage.binary_dilation(ink, iterations=3)
        # densities over 5 x 5 pixels of tissue (the nuclei in pale stroma counted in)
        plain = (tissue & ~near_ink).astype(np.float32)
        share = ndimage.uniform_filter(plain, 5, mode="constant")
        smooth = ndimage.uniform_filter(strength * plain, 5, mode="constant")
        smooth /= np.maximum(share, 1e-6)
        # the sides: tissue all round, none of it the candidate band
        loose = ndimage.uniform_filter((tissue & ~stained).astype(np.float32), 5, mode="constant")
        solid = (share >= SIDE_TISSUE) & (loose >= SIDE_PALE)
        solid &= ~ndimage.binary_dilation(over_pale, iterations=2)
        sides = np.where(solid, smooth, np.inf).astype(np.float32)
        bands = over_pale & between(smooth, sides, round(reach / 2))
        bands = _long(_areas(bands), BAND_LENGTH)
        # ink thinning out over tissue is a band beside a stroke: no such band comes near ink
        near = max(3, round(reach / 10))
        inked = ndimage.binary_dilation(ink, iterations=near)
        bands &= ~_touching(bands, inked)
        fold |= bands | _band_on(over_pale, bands, inked, min_area)
    return large_parts(fold, min_area)


def _band_on(over_pale: BoolArray, bands: BoolArray, inked: BoolArray, min_area: int) -> BoolArray:
    """The rest of the folds ``bands`` found: where a fold runs on beside dense tissue or
    along the section's edge it has pale tissue on one side only, but it is the same area
    as dense over the pale tissue of its hue (``over_pale``, lines a pixel or two wide such
    as a dense area's rim taken off). Such an area is kept where the band in it is a fold's
    size (``min_area`` pixels: not a few pixels of a gland's wall) and it is a band itself,
    its gaps closed and holes filled (a ragged cellular nodule is no band), away from ink
    (``inked``)."""
    from scipy import ndimage  # here: index readers (spawned workers) need no scipy

    square = np.ones((3, 3), dtype=bool)
    labels, count = ndimage.label(ndimage.binary_opening(over_pale, square), structure=square)
    if not count:
        return np.zeros(bands.shape, dtype=bool)
    proven = np.bincount(labels[bands], minlength=count + 1) >= min_area
    proven[0] = False
    whole: BoolArray = proven[labels]
    if not whole.any():
        return whole
    whole &= ~_touching(whole, inked)
    found = np.zeros(bands.shape, dtype=bool)
    if not whole.any():
        return found
    # over the bounding box of those areas (with room for the closing): most of a slide has none
    rows, cols = np.nonzero(whole.any(axis=1))[0], np.nonzero(whole.any(axis=0))[0]
    box = (
        slice(max(rows[0] - 3, 0), rows[-1] + 4),
        slice(max(cols[0] - 3, 0), cols[-1] + 4),
    )
    solid = ndimage.binary_fill_holes(ndimage.binary_closing(whole[box], square, iterations=2))
    found[box] = whole[box] & _long(solid, BAND_LENGTH)
    return found


def _areas(mask: BoolArray) -> BoolArray:
    """A fold is an area: the pixels of ``mask`` most of whose 3 x 3 neighbours are in it
    too (not a clump of nuclei, a speck)."""
    from scipy import ndimage  # here: index readers (spawned workers) need no scipy

    kept: BoolArray = mask & (
        ndimage.uniform_filter(mask.astype(np.float32), 3, mode="constant") >= 4.5 / 9
    )
    return kept


def between(
    strength: npt.NDArray[np.float32], sides: npt.NDArray[np.float32], half: int
) -> BoolArray:
    """Pixels `SIDE_DENSITY` times as dense (``strength``) as ``sides`` (inf: no side) at
    some pixel within ``2 * half`` pixels before them and at one within as many after them,
    along a row or a column: a band lying on the tissue of ``sides``."""
    from scipy import ndimage  # here: index readers (spawned workers) need no scipy

    found = np.zeros(strength.shape, dtype=bool)
    size = 2 * half + 1
    for axis in (0, 1):
        both = np.ones(strength.shape, dtype=bool)
        for origin in (half, -half):  # the window ending at the pixel, then starting there
            lowest = ndimage.minimum_filter1d(
                sides, size, axis=axis, mode="constant", cval=np.inf, origin=origin
            )
            both &= strength >= SIDE_DENSITY * lowest
        found |= both
    return found


def _long(mask: BoolArray, length: float) -> BoolArray:
    """The connected parts (8-neighbours) of ``mask`` at least ``length`` times as long as
    they are wide: area over the square of the widest point's width (twice its distance
    from the part's edge); a disc is 0.8, a strip as long as ``length`` widths ``length``."""
    from scipy import ndimage  # here: index readers (spawned workers) need no scipy

    labels, count = ndimage.label(mask, structure=np.ones((3, 3), dtype=bool))
    if not count:
        return mask
    areas = np.bincount(labels.ravel(), minlength=count + 1)
    inside = ndimage.distance_transform_edt(mask)
    widest = np.zeros(count + 1)
    np.maximum.at(widest, labels.ravel(), inside.ravel())
    long = areas >= length * (2 * widest) ** 2
    long[0] = False
    kept: BoolArray = long[labels]
    return kept


def _touching(mask: BoolArray, other: BoolArray) -> BoolArray:
    """The connected parts (8-neighbours) of ``mask`` with a pixel in ``other``."""
    from scipy import ndimage  # here: index readers (spawned workers) need no scipy

    labels, count = ndimage.label(mask, structure=np.ones((3, 3), dtype=bool))
    touching = np.zeros(count + 1, dtype=bool)
    touching[labels[mask & other]] = True
    touching[0] = False
    found: BoolArray = touching[labels]
    return found


def inked_folds(
    rgb: RGBArray, fold: BoolArray, ink: BoolArray, stained: BoolArray, window: int
) -> BoolArray:
    """The parts of ``fold`` that are ink over tissue: areas touching a pen stroke (within 2
    pixels) whose share of red in their optical density differs from that of the tissue
    around them by more than `INKED_RED_SHARE` of it. A marker laid over tissue adds its
    own density, so it looks "twice as dense" and, for red ink over eosin, nearly the same
    colour; a fold is the tissue's own hue (its density's proportions), denser."""
    if not fold.any() or not ink.any():
        return np.zeros(fold.shape, dtype=bool)
    from scipy import ndimage  # here: index readers (spawned workers) need no scipy

    labels, count = ndimage.label(fold, structure=np.ones((3, 3), dtype=bool))
    near_ink = ndimage.binary_dilation(ink, iterations=2)
    touching = np.zeros(count + 1, dtype=bool)
    touching[labels[near_ink & fold]] = True
    touching[0] = False
    if not touching.any():
        return np.zeros(fold.shape, dtype=bool)
    raw = optical_density(rgb)
    around = _typical_around(raw, stained & ~fold, window)

    def red_share(values: npt.NDArray[np.float32]) -> npt.NDArray[np.float64]:
        sums = [np.bincount(labels.ravel(), values[..., c].ravel(), count + 1) for c in range(3)]
        with np.errstate(invalid="ignore", divide="ignore"):
            share: npt.NDArray[np.float64] = sums[0] / (sums[0] + sums[1] + sums[2])
        return share

    own, theirs = red_share(raw), red_share(around)
    with np.errstate(invalid="ignore"):
        other_hue = np.abs(own - theirs) > INKED_RED_SHARE * theirs
    inked: BoolArray = (touching & other_hue)[labels]
    return inked


def _denser(
    density: npt.NDArray[np.float32],
    strength: npt.NDArray[np.float32],
    around: npt.NDArray[np.float32],
    factor: float = FOLD_DENSITY,
) -> BoolArray:
    """Pixels at least ``factor`` times as dense as ``around`` and of its colour."""
    around_strength = _norm(around)
    cosine = _cosine(density, strength, around, around_strength)
    found: BoolArray = (strength >= factor * around_strength) & (cosine >= FOLD_HUE_COSINE)
    return found


def _cosine(
    density: npt.NDArray[np.float32],
    strength: npt.NDArray[np.float32],
    around: npt.NDArray[np.float32],
    around_strength: npt.NDArray[np.float32],
) -> npt.NDArray[np.float32]:
    """Per pixel, the cosine between ``density`` and ``around`` (their lengths given): how
    alike their colours are, whatever their strength."""
    dot = density[..., 0] * around[..., 0]
    dot += density[..., 1] * around[..., 1]
    dot += density[..., 2] * around[..., 2]
    with np.errstate(invalid="ignore", divide="ignore"):
        cosine: npt.NDArray[np.float32] = dot / (strength * around_strength)
    return cosine


def hue_parts(density: npt.NDArray[np.float32], stained: BoolArray) -> list[BoolArray]:
    """The stained pixels split into `HUE_PARTS` of about equal size by their hue (the red
    share of their optical density: haematoxylin's is large, eosin's small)."""
    total = density.sum(axis=-1)
    with np.errstate(invalid="ignore", divide="ignore"):
        red = np.where(total > 0, density[..., 0] / total, 0.0)
    edges = np.quantile(red[stained], np.linspace(0, 1, HUE_PARTS + 1)[1:-1])
    part = np.digitize(red, edges)
    return [stained & (part == i) for i in range(HUE_PARTS)]


def _typical_around(
    density: npt.NDArray[np.float32], pixels: BoolArray, window: int
) -> npt.NDArray[np.float32]:
    """The mean density of ``pixels`` around each pixel, leaving out those much denser than
    a first such mean (folds and clumps must not raise their own reference)."""
    around = local_mean(density, pixels, window)
    typical = pixels & (_norm(density) <= 1.3 * _norm(around))
    return local_mean(density, typical if typical.any() else pixels, window)


def _norm(vectors: npt.NDArray[np.float32]) -> npt.NDArray[np.float32]:
    """Length of each pixel's 3-vector, channel by channel (numpy's reductions over a
    length-3 last axis are several times slower than elementwise sums)."""
    total = vectors[..., 0] ** 2
    total += vectors[..., 1] ** 2
    total += vectors[..., 2] ** 2
    root: npt.NDArray[np.float32] = np.sqrt(total)
    return root


def large_parts(mask: BoolArray, min_area: int) -> BoolArray:
    """The connected parts (8-neighbours) of ``mask`` of at least ``min_area`` pixels."""
    from scipy import ndimage  # here: index readers (spawned workers) need no scipy

    labels, count = ndimage.label(mask, structure=np.ones((3, 3), dtype=bool))
    if not count:
        return mask
    areas = np.bincount(labels.ravel(), minlength=count + 1)
    big = areas >= min_area
    big[0] = False
    kept: BoolArray = big[labels]
    return kept


def local_mean(
    values: npt.NDArray[np.float32], weight: BoolArray, window: int
) -> npt.NDArray[np.float32]:
    """The mean of ``values`` (H, W, C) over the ``weight`` pixels around each pixel: means
    over blocks of ``window`` pixels, blocks without such pixels filled from their
    neighbours (else the overall mean), then interpolated back to every pixel."""
    h, w, channels = values.shape
    block = max(2, window)
    rows, cols = -(-h // block), -(-w // block)
    counted = np.zeros((rows * block, cols * block), dtype=np.float32)
    counted[:h, :w] = weight

    def block_sums(plane: npt.NDArray[np.float32]) -> npt.NDArray[np.float32]:
        sums: npt.NDArray[np.float32] = (
            plane.reshape(rows, block, cols, block).sum(axis=3).sum(axis=1)
        )
        return sums

    counts = block_sums(counted)
    planes = []
    for c in range(channels):
        padded = np.zeros_like(counted)
        np.multiply(values[..., c], counted[:h, :w], out=padded[:h, :w])
        planes.append(block_sums(padded))
    sums = np.stack(planes, axis=-1)
    overall = sums.sum(axis=(0, 1)) / max(float(counts.sum()), 1.0)
    # each block with its 8 neighbours, so a block of little tissue borrows from them
    from scipy import ndimage  # here: index readers (spawned workers) need no scipy

    near_sums = ndimage.uniform_filter(sums, (3, 3, 1), mode="nearest")
    near_counts = ndimage.uniform_filter(counts, 3, mode="nearest")[..., None]
    means = np.where(near_counts > 0, near_sums / np.maximum(near_counts, 1e-6), overall)
    # bilinear between block centres (PIL: ~50x faster than ndimage.zoom here)
    size = (cols * block, rows * block)
    spread = [
        np.asarray(Image.fromarray(means[..., c].astype(np.float32), "F").resize(size, BILINEAR))
        for c in range(channels)
    ]
    out: npt.NDArray[np.float32] = np.stack(spread, axis=-1)[:h, :w]
    return out


BUBBLE_RIM_DARKER = 0.8  # a rim pixel is at most this bright relative to what is around it
BUBBLE_RIM_GREYER = 0.8  # ...and at most this colourful relative to the tissue around it


def bubbles(
    rgb: RGBArray, ink: BoolArray, stained: BoolArray, window: int, min_area: int = 9
) -> BoolArray:
    """Pixels of an air bubble, rim included: a closed ring of pixels darker than what is
    around them and greyer than the tissue around them (light refracted away, not stain),
    closing in a roughly round area of at least ``min_area`` pixels. Pen ink, which
    pathologists draw in circles too, is never rim; nuclei and folds are darker but more
    colourful."""
    r, g, b = rgb[..., 0], rgb[..., 1], rgb[..., 2]
    high = np.maximum(np.maximum(r, g), b).astype(np.float32)
    chroma = high - np.minimum(np.minimum(r, g), b)
    bright = local_mean(high[..., None], ~ink, window)[..., 0]
    colour = local_mean(chroma[..., None], stained, window)[..., 0]
    rim = (high <= BUBBLE_RIM_DARKER * bright) & (chroma <= BUBBLE_RIM_GREYER * colour) & ~ink
    if not rim.any():
        return np.zeros(rim.shape, dtype=bool)
    # ink crossing a rim does not open it: rings are closed over rim and ink together, but
    # the edge of a hole must be mostly grey rim (a circle drawn in ink is no bubble)
    ring = rim | ink
    for grow in (True, True, False, False):  # a closing: gaps of up to 4 pixels in a ring
        ring = cross_step(ring, grow)
    holes = fill_holes(ring) & ~ring
    from scipy import ndimage  # here: index readers (spawned workers) need no scipy

    labels, count = ndimage.label(holes)
    if not count:
        return np.zeros(rim.shape, dtype=bool)
    # each hole's edge: the ring pixels within 2 of it, labelled as the hole
    edge_labels = np.where(ring, ndimage.grey_dilation(labels, size=5), 0)
    grey_edge = edge_labels * ~ink
    areas = np.bincount(labels.ravel(), minlength=count + 1)
    edge_count = np.bincount(edge_labels.ravel(), minlength=count + 1)
    grey_count = np.bincount(grey_edge.ravel(), minlength=count + 1)
    edge_sum = np.bincount(grey_edge.ravel(), weights=high.ravel(), minlength=count + 1)
    hole_sum = np.bincount(labels.ravel(), weights=high.ravel(), minlength=count + 1)
    edge_bright = edge_sum / np.maximum(grey_count, 1)
    hole_bright = hole_sum / np.maximum(areas, 1)
    keep = np.zeros(count + 1, dtype=bool)
    for i, box in enumerate(ndimage.find_objects(labels), start=1):
        if box is None or areas[i] < min_area or grey_count[i] < 0.5 * edge_count[i]:
            continue
        height, width = box[0].stop - box[0].start, box[1].stop - box[1].start
        # roughly round: not a sliver, filling most of its bounding box (a disc: 79%)
        round_enough = (
            max(height, width) <= 1.6 * min(height, width) and areas[i] >= 0.6 * height * width
        )
        # a rim is darker than what it closes in; the edge of a round piece of tissue is not
        if round_enough and edge_bright[i] <= BUBBLE_RIM_DARKER * hole_bright[i]:
            keep[i] = True
    keep[0] = False
    found: BoolArray = keep[labels] | (keep[edge_labels] & ~ink)
    return found
