"""Per-slide stain statistics, estimated once at index time from the slide's tissue.

Two descriptions of a slide's colour, both computed from its tissue pixels (the tissue mask,
less near-white pixels) at the resolution its tiles are read at:

- Macenko (2009): the optical-density (OD) vectors of haematoxylin and eosin, and the 99th
  percentile of each stain's concentration (its robust maximum). Normalising a tile is then a
  fixed per-pixel map: OD, one 3x3 matrix, exp (`wsi_loader.stain`).
- Reinhard (2001): the mean and standard deviation of each CIELAB channel.

Unless that image is the level tiles are read from at full resolution, the pixels come from a
few storage tiles over tissue of the read level (`_stain_sampling.slide_estimate`): the
statistics a tile is normalised with must describe pixels like its own. A coarser picture
averages intensities, which mixes stains with each other and with glass non-linearly in OD
and pulls the estimated vectors inward and the concentrations and spreads down, so a slide
normalised to a crop of itself would move. A target image is fitted by the same
`estimate_stain`, so target and slide are compared over the same kind of pixels.

A slide whose stain cannot be estimated (too little tissue, two stains that are not separable,
vectors far from any H&E) gets a reason instead of an estimate: it is flagged, never failed.
`archive_reference` is the median stain of an archive's slides, a normalisation target.

The OD conventions are torchstain's (``Io = 240``, ``OD = -log((I + 1) / Io)``, pixels with an
OD below ``beta = 0.15`` in any channel are background), so a target fitted here and one fitted
by torchstain on the same image agree. Torch-free, like the rest of the index.
"""

from __future__ import annotations

import json
import logging
import math
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from wsi_loader.errors import InputError
from wsi_loader.files import write_file

log = logging.getLogger(__name__)

IO = 240.0  # transmitted light intensity (torchstain's default)
BETA = 0.15  # OD below this in any channel: background or near-white (not stained)
ALPHA = 1.0  # percentile of the angle distribution taken as each stain's extreme
MAX_C_PERCENTILE = 99.0  # robust maximum concentration
MIN_PIXELS = 2000  # fewer stained tissue pixels give no estimate
MAX_PIXELS = 1 << 18  # more are subsampled (evenly): the estimate does not need them all
MIN_SEPARATION_DEG = 5.0  # H and E closer than this are not two stains
MAX_OFF_REFERENCE_DEG = 40.0  # a vector further than this from the H&E reference: not H&E
GREY_CHROMA = 20  # stained tissue is coloured: pixels with channels this close are not stain
NOT_HE_DEG = (25.0, 20.0)  # H, E further than this from the reference: said to be not H&E
# ...or an E that leans to green (its unit OD vector's green minus red) less than this: eosin
# absorbs green and hardly any red (the reference's lean is 0.585), DAB is brown, absorbing
# blue most and red about half as much as green (Ruifrok's DAB: 0.30), which angles alone
# hardly tell from eosin (DAB lies 15-19 degrees from the reference E, as eosins do)
MIN_E_LEAN = 0.35
METHOD = 3  # slide estimates of this method (sampled at the read level) are kept on rebuild
# what a stain read from a file may hold: OD vectors of a norm near 1, maximum concentrations
# (optical densities) and CIELAB values of an image
MAX_VECTOR_NORM = 100.0
MAX_CONCENTRATION = 50.0
MAX_LAB = 200.0

# Macenko's reference (torchstain's default target): H and E OD vectors and max concentrations
REFERENCE_H = (0.5626, 0.7201, 0.4062)
REFERENCE_E = (0.2159, 0.8012, 0.5581)
REFERENCE_MAX_C = (1.9705, 1.0308)

FloatArray = npt.NDArray[np.float64]
Vector = tuple[float, float, float]


@dataclass(frozen=True)
class StainEstimate:
    """A stain description: Macenko vectors and maximum concentrations, Reinhard LAB moments.

    ``h``/``e`` are unit OD vectors (R, G, B); ``max_c`` the robust maximum concentrations of
    H and E; ``lab_mean``/``lab_std`` CIELAB (L in 0..100) means and standard deviations;
    ``pixels`` how many pixels they come from; ``source`` which pixels those were (a slide's:
    ``"level 2"``, the builder's mask image; ``"level 0, 16 tiles"``, storage tiles at full
    resolution).
    """

    h: Vector
    e: Vector
    max_c: tuple[float, float]
    lab_mean: Vector
    lab_std: Vector
    pixels: int = 0
    source: str = ""

    def matrix(self) -> FloatArray:
        """The (3, 2) stain matrix, columns H and E."""
        return np.array([self.h, self.e], dtype=np.float64).T

    def as_json(self) -> dict[str, Any]:
        return {
            "H": [round(v, 6) for v in self.h],
            "E": [round(v, 6) for v in self.e],
            "max_concentrations": [round(v, 6) for v in self.max_c],
            "lab_mean": [round(v, 4) for v in self.lab_mean],
            "lab_std": [round(v, 4) for v in self.lab_std],
            "pixels": self.pixels,
            # how well the slide fits H&E: its vectors' angles to Macenko's H and E
            "he_deg": [round(v, 2) for v in self.he_angles()],
            "e_lean": round(self.e_lean(), 3),
            **({"source": self.source, "method": METHOD} if self.source else {}),
        }

    def he_angles(self) -> tuple[float, float]:
        """The angles (degrees) of H and E to Macenko's reference H and E vectors."""
        return angle_deg(self.h, REFERENCE_H), angle_deg(self.e, REFERENCE_E)

    def e_lean(self) -> float:
        """How much the second stain absorbs green more than red (its unit OD vector's green
        minus red): eosin's is large, a brown DAB's small (`MIN_E_LEAN`)."""
        return self.e[1] - self.e[0]

    def not_he(self) -> str | None:
        """Why this stain does not look like H&E (an IHC's DAB, a Giemsa's blues), or None:
        vectors further from H&E's than H&E slides' are (`NOT_HE_DEG`), or a second stain
        that is not pink (`MIN_E_LEAN`)."""
        off_h, off_e = self.he_angles()
        lean = self.e_lean()
        if off_h <= NOT_HE_DEG[0] and off_e <= NOT_HE_DEG[1] and lean >= MIN_E_LEAN:
            return None
        return (
            f"the stain fits H&E poorly (H {off_h:.0f} and E {off_e:.0f} degrees from H&E's; "
            f"H&E slides are within {NOT_HE_DEG[0]:.0f} and {NOT_HE_DEG[1]:.0f}; E leans to "
            f"green by {lean:.2f}, eosin by at least {MIN_E_LEAN:.2f}): not an H&E slide "
            "(IHC, Giemsa...)? Stain normalisation and the QC rules assume H&E"
        )

    @classmethod
    def from_json(cls, data: Mapping[str, Any], source: str = "stain") -> StainEstimate:
        """Parse (and check) `as_json`'s form: a file given as a target is untrusted input."""

        def numbers(
            key: str, count: int, positive: bool = False, bound: float = math.inf
        ) -> tuple[float, ...]:
            value = data.get(key)
            if (
                not isinstance(value, list)
                or len(value) != count
                or not all(isinstance(v, (int, float)) and math.isfinite(v) for v in value)
                or (positive and not all(v > 0 for v in value))
                or not all(abs(v) <= bound for v in value)
            ):
                need = "positive " if positive else ""
                within = f" of at most {bound:g}" if math.isfinite(bound) else ""
                raise InputError(
                    f"{source}: {key!r} must be a list of {count} {need}numbers{within}"
                )
            return tuple(float(v) for v in value)

        if not isinstance(data, Mapping):
            raise InputError(f"{source}: a stain is a JSON object with H, E, ... keys")
        h, e = numbers("H", 3), numbers("E", 3)
        for name, vector in (("H", h), ("E", e)):
            # an OD vector is stored unit; one of norm 1e300 overflows (its unit vector is 0)
            norm = math.hypot(*vector)
            if not 1 / MAX_VECTOR_NORM <= norm <= MAX_VECTOR_NORM:
                raise InputError(
                    f"{source}: {name!r} has a norm of {norm:.3g}, not an optical-density "
                    f"vector (its norm is 1, between {1 / MAX_VECTOR_NORM:g} and "
                    f"{MAX_VECTOR_NORM:g} accepted)"
                )
        h, e = _unit(h), _unit(e)
        problem = check_vectors(np.array([h, e]).T)
        if problem is not None:  # as a target image's vectors are checked
            raise InputError(f"{source}: {problem}")
        pixels, where = data.get("pixels", 0), data.get("source", "")
        l_mean = numbers("lab_mean", 3, bound=MAX_LAB)
        if not 0 <= l_mean[0] <= 100:
            raise InputError(f"{source}: 'lab_mean' has L = {l_mean[0]:g}, outside 0..100")
        return cls(
            h=h,
            e=e,
            max_c=numbers("max_concentrations", 2, True, MAX_CONCENTRATION),  # type: ignore[arg-type]
            lab_mean=l_mean,  # type: ignore[arg-type]
            lab_std=numbers("lab_std", 3, positive=True, bound=MAX_LAB),  # type: ignore[arg-type]
            pixels=int(pixels) if isinstance(pixels, int) else 0,
            source=where[:200] if isinstance(where, str) else "",
        )


def _unit(v: Iterable[float]) -> Vector:
    a = np.asarray(list(v), dtype=np.float64)
    a = a / np.linalg.norm(a)
    return (float(a[0]), float(a[1]), float(a[2]))


def angle_deg(a: Iterable[float], b: Iterable[float]) -> float:
    """The angle between two vectors, in degrees."""
    u, v = np.asarray(list(a), np.float64), np.asarray(list(b), np.float64)
    cos = float(u @ v / (np.linalg.norm(u) * np.linalg.norm(v)))
    return math.degrees(math.acos(max(-1.0, min(1.0, cos))))


def optical_density(rgb: npt.NDArray[np.uint8], io: float = IO) -> FloatArray:
    """``-log((I + 1) / io)`` per channel, as float64 ``(..., 3)``."""
    table = -np.log((np.arange(256, dtype=np.float64) + 1.0) / io)
    od: FloatArray = table[rgb]
    return od


_THREADS_SET: list[int] = []


def single_threaded_opencv() -> None:
    """One OpenCV thread in every process that runs our OpenCV calls (the LAB moments here,
    the CPU stain kernels of `wsi_loader.stain`). Their parallelism is the index's and the
    DataLoader's worker processes, and an OpenCV thread pool started in the main process is
    inherited half-locked by forked workers, which then hang in their first OpenCV call
    (seen: a fork after an epoch with ``num_workers=0``)."""
    import cv2  # here: reading an index (info) needs no OpenCV

    pid = os.getpid()
    if [pid] != _THREADS_SET:
        _THREADS_SET[:] = [pid]
        cv2.setNumThreads(1)


def rgb_to_lab(rgb: npt.NDArray[np.uint8]) -> npt.NDArray[np.float32]:
    """CIELAB (D65, sRGB gamma; L in 0..100) of uint8 RGB pixels ``(..., 3)``: OpenCV's float
    conversion, which agrees with scikit-image's ``rgb2lab`` to ~0.01."""
    import cv2

    single_threaded_opencv()
    pixels = np.ascontiguousarray(rgb, dtype=np.uint8).reshape(-1, 3)
    # OpenCV converts row by row: one very long row is ~20x slower than rows of ~1k pixels
    width = 1024
    rows = -(-len(pixels) // width)
    padded = np.zeros((rows * width, 3), dtype=np.float32)
    padded[: len(pixels)] = pixels
    padded *= 1.0 / 255.0
    lab = np.asarray(cv2.cvtColor(padded.reshape(rows, width, 3), cv2.COLOR_RGB2Lab))
    out = lab.reshape(-1, 3)[: len(pixels)].reshape(rgb.shape).astype(np.float32, copy=False)
    return out


def macenko_vectors(od: FloatArray, alpha: float = ALPHA) -> FloatArray:
    """The (3, 2) stain matrix (columns H, E) of OD pixels ``(n, 3)`` that are all stained
    (Macenko 2009: the plane of the two main eigenvectors, the robust extreme angles in it).

    The eigenvectors are oriented along the mean OD first, so the angles do not wrap around
    +-pi (the published algorithm leaves their signs to the eigen solver)."""
    _, vectors = np.linalg.eigh(np.cov(od.T))
    plane = vectors[:, [1, 2]]
    mean = od.mean(axis=0)
    if plane[:, 1] @ mean < 0:  # the principal direction points into the stained octant
        plane[:, 1] = -plane[:, 1]
    projected = od @ plane
    phi = np.arctan2(projected[:, 1], projected[:, 0])
    low, high = np.percentile(phi, [alpha, 100 - alpha])
    v_min = plane @ np.array([math.cos(low), math.sin(low)])
    v_max = plane @ np.array([math.cos(high), math.sin(high)])
    # haematoxylin absorbs more red than eosin: the vector with the larger red OD is H
    h, e = (v_min, v_max) if v_min[0] > v_max[0] else (v_max, v_min)
    he: FloatArray = np.stack([h, e], axis=1)
    return he


def concentrations(od: FloatArray, he: FloatArray) -> FloatArray:
    """Least-squares stain concentrations ``(2, n)`` of OD pixels ``(n, 3)``."""
    c: FloatArray = np.linalg.pinv(he) @ od.T  # the least-squares solution (he has rank 2)
    return c


def check_vectors(he: FloatArray) -> str | None:
    """Why a stain matrix is not a usable H&E estimate, or None."""
    h, e = he[:, 0], he[:, 1]
    separation = angle_deg(h, e)
    if separation < MIN_SEPARATION_DEG:
        return f"the two stains are not separable (vectors {separation:.1f} degrees apart)"
    if (he < -0.05).any():
        return "a stain vector has a negative optical density (not a brightfield H&E stain)"
    off_h, off_e = angle_deg(h, REFERENCE_H), angle_deg(e, REFERENCE_E)
    if max(off_h, off_e) > MAX_OFF_REFERENCE_DEG:
        return (
            f"the stain vectors are {off_h:.0f} (H) and {off_e:.0f} (E) degrees from H&E's; "
            "not an H&E stain"
        )
    return None


def is_stained(od: FloatArray) -> npt.NDArray[np.bool_]:
    """Pixels stained enough to estimate from: an OD of at least `BETA` in every channel
    (Macenko's and torchstain's rule; a rule on the summed OD, which keeps light eosin, gave
    noisier vectors on the test slides)."""
    keep: npt.NDArray[np.bool_] = np.all(od >= BETA, axis=-1)
    return keep


def evenly(pixels: npt.NDArray[Any], limit: int) -> npt.NDArray[Any]:
    """At most ``limit`` rows, evenly spaced (deterministic)."""
    if len(pixels) <= limit:
        return pixels
    return pixels[np.linspace(0, len(pixels) - 1, limit).astype(np.int64)]


def estimate_stain(
    rgb: npt.NDArray[np.uint8], tissue: npt.NDArray[np.bool_] | None = None, source: str = ""
) -> StainEstimate | str:
    """The stain of an image's tissue: its pixels inside ``tissue`` (all when None) but
    those that are no stain (`_not_stain`: ink, grey bubble rims). The vectors and the LAB
    moments come from the pixels whose OD is at least `BETA` in every channel
    (`is_stained`); the maximum concentrations from every pixel with an OD of at least
    `BETA` in any channel (light eosin included: over the stained pixels alone, a paler
    eosin keeps fewer of its pixels and its maximum came out higher, not lower). A slide's
    estimate and a target image's are this same fit, so a slide normalised to a
    crop of itself barely moves. Returns the reason when there is no usable estimate."""
    pixels = rgb.reshape(-1, 3) if tissue is None else rgb[tissue]
    pixels = pixels[~_not_stain(pixels)]
    od = optical_density(pixels)
    stained = is_stained(od)
    count = int(stained.sum())
    if count < MIN_PIXELS:
        return (
            f"too little stained tissue for a stain estimate ({count} pixels of the "
            f"{source or 'image'}, at least {MIN_PIXELS} needed)"
        )
    coloured = evenly(od[(od >= BETA).any(axis=-1)], MAX_PIXELS)
    od, pixels = evenly(od[stained], MAX_PIXELS), evenly(pixels[stained], MAX_PIXELS)
    he = macenko_vectors(od)
    problem = check_vectors(he)
    if problem is not None:
        return problem
    c = concentrations(coloured, he)
    max_c = np.percentile(c, MAX_C_PERCENTILE, axis=1)
    if not (max_c > 0).all():
        return "a stain has no positive concentration (not an H&E stain)"
    lab = rgb_to_lab(pixels).astype(np.float64)
    return _fitted(he, max_c, lab, lab.std(axis=0) + 1e-6, count, source)


def _fitted(
    he: FloatArray,
    max_c: FloatArray,
    lab: FloatArray,
    lab_std: FloatArray,
    pixels: int,
    source: str = "",
) -> StainEstimate:
    """The estimate of a fit (`estimate_stain`, `fit_image`): H and E the unit columns of
    ``he``, the LAB mean over ``lab``, plain floats throughout."""
    mean = lab.mean(axis=0)
    return StainEstimate(
        h=_unit(he[:, 0]),
        e=_unit(he[:, 1]),
        max_c=(float(max_c[0]), float(max_c[1])),
        lab_mean=(float(mean[0]), float(mean[1]), float(mean[2])),
        lab_std=(float(lab_std[0]), float(lab_std[1]), float(lab_std[2])),
        pixels=pixels,
        source=source,
    )


def _not_stain(pixels: npt.NDArray[np.uint8]) -> npt.NDArray[np.bool_]:
    """Pixels ``(n, 3)`` that are no stain: green, red or black ink, and grey (bubble rims,
    dust). Blue "ink" stays: dense nuclei pass histolab's blue triples, and a blue stain is
    a stain."""
    from wsi_loader.index._qc_pixels import pen_inks

    other = pen_inks(pixels[:, None])[1][:, 0]
    high, low = pixels.max(axis=-1).astype(np.int16), pixels.min(axis=-1).astype(np.int16)
    grey: npt.NDArray[np.bool_] = other | ((high - low < GREY_CHROMA) & (high < 200))
    return grey


def is_current(stain: Mapping[str, Any] | None, stain_error: str | None) -> bool:
    """Whether a stored slide record's stain columns come from this estimation: a record from
    before stain columns has neither, and an estimate of an older `METHOD` (from before
    slides were sampled at a level that resolves nuclei) has another or none. The builder
    estimates the others again (a few reads per slide, once)."""
    if stain is None:
        return stain_error is not None
    return stain.get("method") == METHOD


def fit_image(rgb: npt.NDArray[np.uint8]) -> StainEstimate:
    """A target fitted from an RGB image the way torchstain's ``fit`` does it: the Macenko
    vectors from pixels with OD >= beta, concentrations over all pixels; LAB moments (sample
    standard deviation) over all pixels. Give a crop filled with tissue."""
    pixels, stained = stained_pixels(rgb)
    he, max_c = _macenko_fit(pixels, stained)
    lab = rgb_to_lab(pixels).astype(np.float64)
    return _fitted(he, max_c, lab, lab.std(axis=0, ddof=1), int(stained.sum()))


def fit_macenko(rgb: npt.NDArray[np.uint8]) -> tuple[FloatArray, FloatArray]:
    """`fit_image`'s Macenko values alone (a per-tile Macenko needs no LAB moments, which
    cost as much again): its `StainEstimate.matrix` and maximum concentrations."""
    he, max_c = _macenko_fit(*stained_pixels(rgb))
    return np.array([_unit(he[:, 0]), _unit(he[:, 1])]).T, max_c


def fit_lab(rgb: npt.NDArray[np.uint8]) -> tuple[FloatArray, FloatArray]:
    """`fit_image`'s LAB mean and standard deviation alone (a per-tile Reinhard's), refused
    as it refuses an image with too few stained pixels."""
    pixels, _ = stained_pixels(rgb)
    lab = rgb_to_lab(pixels).astype(np.float64)
    return lab.mean(axis=0), lab.std(axis=0, ddof=1)


def _macenko_fit(
    pixels: npt.NDArray[np.uint8], stained: npt.NDArray[np.bool_]
) -> tuple[FloatArray, FloatArray]:
    """The stain matrix (columns H and E, as `macenko_vectors` gives them) and the maximum
    concentrations (torchstain's percentile over every pixel) of pixels ``(n, 3)``."""
    he = macenko_vectors(_OD_TABLE[pixels[stained]])  # only the stained pixels' OD
    return he, _nearest_percentile(concentrations(_OD_TABLE[pixels], he), MAX_C_PERCENTILE)


def stained_pixels(
    rgb: npt.NDArray[np.uint8],
) -> tuple[npt.NDArray[np.uint8], npt.NDArray[np.bool_]]:
    """An image's pixels ``(n, 3)`` and which are stained (an OD of at least `BETA` in every
    channel), checked to be a uint8 (H, W, 3) image with enough stained pixels for
    `fit_image` (an `InputError` otherwise). The rule is on the uint8 values: OD falls as
    the intensity rises, so OD >= `BETA` is intensity <= the last level whose OD is, and
    three comparisons of bytes cost a tenth of the float OD's."""
    if rgb.ndim != 3 or rgb.shape[2] != 3 or rgb.dtype != np.uint8:
        raise InputError(
            f"a stain target image must be uint8 (H, W, 3), got {rgb.dtype} {rgb.shape}"
        )
    pixels = rgb.reshape(-1, 3)
    stained = pixels[:, 0] <= _STAINED_LEVEL
    stained &= pixels[:, 1] <= _STAINED_LEVEL
    stained &= pixels[:, 2] <= _STAINED_LEVEL
    count = int(stained.sum())
    if count < 100:
        raise InputError(
            f"the stain target image has {count} stained pixels: too few for a target "
            "(give a crop with tissue)"
        )
    return pixels, stained


_OD_TABLE = optical_density(np.arange(256, dtype=np.uint8))  # the OD of each uint8 intensity
# the highest intensity whose OD is at least BETA (OD falls as intensity rises)
_STAINED_LEVEL = int(np.flatnonzero(_OD_TABLE >= BETA)[-1])


def _nearest_percentile(values: FloatArray, q: float) -> FloatArray:
    """torchstain's percentile (the k-th smallest, k = 1 + round(q/100 (n - 1))) per row."""
    k = round(q / 100 * (values.shape[-1] - 1))
    out: FloatArray = np.partition(values, k, axis=-1)[..., k]
    return out


def archive_reference(stains: Iterable[StainEstimate]) -> StainEstimate:
    """The median stain of an archive: element-wise medians of the slides' vectors (made
    unit again), maximum concentrations and LAB moments, over its H&E slides: an IHC or
    Giemsa slide (`StainEstimate.not_he`) would pull the target H&E tiles are normalised to.
    An archive with no H&E slide keeps them all, and says so."""
    found = list(stains)
    if not found:
        raise InputError("no slide has a stain estimate, so there is no archive reference")
    he = [s for s in found if s.not_he() is None]
    if not he:
        log.warning(
            "none of the %d slides' stains looks like H&E: their median is the reference, "
            "but stain normalisation assumes H&E",
            len(found),
        )
    found = he or found

    def median(values: Iterable[Iterable[float]]) -> tuple[float, ...]:
        return tuple(float(v) for v in np.median(np.array([list(v) for v in values]), axis=0))

    return StainEstimate(
        h=_unit(median(s.h for s in found)),
        e=_unit(median(s.e for s in found)),
        max_c=median(s.max_c for s in found),  # type: ignore[arg-type]
        lab_mean=median(s.lab_mean for s in found),  # type: ignore[arg-type]
        lab_std=median(s.lab_std for s in found),  # type: ignore[arg-type]
        pixels=sum(s.pixels for s in found),
    )


def slide_estimates(
    records: Iterable[tuple[str, Mapping[str, Any] | None]],
) -> list[StainEstimate | None]:
    """The `StainEstimate` of each slide record's (``path``, ``stain``) (None where it has
    none); a malformed one is an `InputError` naming the slide (index files are input)."""
    return [
        None if stain is None else StainEstimate.from_json(stain, source=f"{path}: stain")
        for path, stain in records
    ]


def summary(records: Iterable[tuple[str, Mapping[str, Any] | None]]) -> dict[str, Any]:
    """``info --json``'s ``stain``: how many slides have an estimate, the archive reference
    (their median) when any has, and the paths of the slides whose stain does not look like
    H&E (`StainEstimate.not_he`)."""
    listed = list(records)
    estimates = slide_estimates(listed)
    found = [s for s in estimates if s is not None]
    return {
        "estimated": len(found),
        "reference": archive_reference(found).as_json() if found else None,
        "not_he": [
            path for (path, _), s in zip(listed, estimates, strict=True) if s and s.not_he()
        ],
    }


def read_reference(path: str | os.PathLike[str]) -> StainEstimate:
    """A stain written by `write_reference` (``wsi-loader stain IDX --reference --out``)."""
    name = os.fspath(path)
    try:
        with open(name, encoding="utf-8") as fh:
            data = json.load(fh)
    except OSError as exc:
        raise InputError(
            f"cannot read the stain reference: {exc.strerror or exc}", path=name
        ) from exc
    except (ValueError, UnicodeDecodeError) as exc:
        raise InputError(f"not a JSON stain reference: {exc}", path=name) from exc
    return StainEstimate.from_json(data, source=name)


def write_reference(path: str | os.PathLike[str], stain: StainEstimate, source: str) -> None:
    body = {**stain.as_json(), "source": source}
    write_file(Path(path), (json.dumps(body, indent=1) + "\n").encode())
