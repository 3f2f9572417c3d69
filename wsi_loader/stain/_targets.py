"""What the stain transforms read: the stain a normalisation goes to (`resolve_target`: an
estimate, an image, a reference file, an index's archive median, a slide) and every slide's
stain statistics from the index as arrays by slide id (`SlideTables`)."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import numpy.typing as npt

from wsi_loader.errors import ConfigError, InputError
from wsi_loader.index._stain_estimates import (
    StainEstimate,
    archive_reference,
    check_vectors,
    estimate_stain,
    fit_image,
    read_reference,
    slide_estimates,
)
from wsi_loader.index._stain_sampling import slide_estimate
from wsi_loader.index._table import SlideIndex
from wsi_loader.index._table_files import CURRENT
from wsi_loader.stain._kernels import Floats, UInt8s

log = logging.getLogger(__name__)

Target = StainEstimate | np.ndarray | str | os.PathLike[str] | SlideIndex | None
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".webp")


def resolve_target(
    target: Target, index: SlideIndex | None = None, per_tile: bool = False
) -> StainEstimate:
    """The stain a transform normalises to. ``target`` may be a `StainEstimate`, an RGB uint8
    image ``(H, W, 3)`` (give a crop with tissue: fitted over the same pixels as a slide's
    estimate, so a slide normalised to a crop of itself barely moves; with ``per_tile``, as
    torchstain's ``fit`` does, which is how per-tile normalisation fits every tile), a reference
    JSON file (``wsi-loader stain IDX --reference --out FILE``), an image file, an index folder
    or `SlideIndex` (its archive reference: the median stain of its slides), a slide file (its
    tissue at low resolution, as when indexing), or None (``index``'s archive reference)."""
    if isinstance(target, StainEstimate):
        return target
    if isinstance(target, np.ndarray):
        return fit_target(target, per_tile)
    if isinstance(target, SlideIndex):
        return archive(target)
    if target is None:
        if index is None:
            raise ConfigError(
                "the stain target defaults to the index's archive reference, but no index was "
                "given: pass target=... or bind the transform to an index",
                key="target",
            )
        return archive(index)
    path = Path(os.fspath(target)).expanduser()
    if (path / CURRENT).is_file():
        return archive(SlideIndex.open(path))
    if path.suffix.lower() == ".json":
        return read_reference(path)
    if not path.exists():
        raise InputError("stain target not found", path=str(path))
    if path.suffix.lower() in IMAGE_SUFFIXES:
        from PIL import Image

        with Image.open(path) as image:
            rgb = np.asarray(image.convert("RGB"))
        try:
            return fit_target(rgb, per_tile)
        except InputError as exc:
            raise InputError(str(exc), path=str(path)) from None
    return _slide_stain(str(path))


def fit_target(rgb: UInt8s, per_tile: bool = False) -> StainEstimate:
    """A target from an image: `estimate_stain` (the pixels and statistics a slide's estimate
    is made of: the target and the slide are compared like for like), or with ``per_tile``
    `fit_image` (torchstain's, what each tile gets then). Refused when the image's stains are
    not H&E's (the check slide estimates get: a target from a fluorescence or one-stain image
    would recolour every tile)."""
    if rgb.ndim != 3 or rgb.shape[2] != 3 or rgb.dtype != np.uint8:
        raise InputError(
            f"a stain target image must be uint8 (H, W, 3), got {rgb.dtype} {rgb.shape}"
        )
    if per_tile:
        found = fit_image(rgb)
        problem = check_vectors(found.matrix())
        if problem is not None:
            raise InputError(f"no stain target from this image: {problem}")
        return found
    estimate = estimate_stain(rgb, source="target image")
    if isinstance(estimate, str):
        raise InputError(f"no stain target from this image: {estimate}")
    return estimate


def archive(index: SlideIndex) -> StainEstimate:
    """The median stain of the generation's slides (every split, so train and validation
    tiles go to the same target)."""
    found = [s for s in slide_estimates((r.path, r.stain) for r in index.slides) if s is not None]
    if not found:
        raise ConfigError(
            f"no slide of the index {index.path} has a stain estimate (built before stain "
            "estimates, or none is H&E): rebuild it, or give a target",
            key="target",
        )
    return archive_reference(found)


def _slide_stain(path: str) -> StainEstimate:
    from wsi_loader.index._tissue import (
        choose_detector,
        max_hole_pixels,
        read_mask_image,
        tissue_mask,
    )
    from wsi_loader.slides._open import open_slide

    with open_slide(path) as reader:
        image, level = read_mask_image(reader, 2048)
        detector, why = choose_detector(image)
        if detector == "fluorescence":  # as when indexing: such a slide has no stain estimate
            raise InputError(f"no stain target from a fluorescence slide ({why})", path=path)
        # its tissue as the index finds it (holes larger than a few cells are glass), read
        # level 0: a slide with one level is sampled at full resolution, as when indexed
        per_px = reader.meta.dimensions[0] / image.shape[1]
        mpp = reader.meta.usable_mpp
        hole = max_hole_pixels(None if mpp is None else mpp * per_px, 256 / per_px)
        found = slide_estimate(reader, image, tissue_mask(image, None, hole), level, 0)
    if isinstance(found, str):
        raise InputError(f"no stain target from this slide: {found}", path=path)
    return found


@dataclass(frozen=True)
class SlideTables:
    """Every slide's stain statistics as arrays by slide id (``valid``: has an estimate)."""

    he: Floats  # (S, 3, 2)
    max_c: Floats  # (S, 2)
    lab_mean: Floats  # (S, 3)
    lab_std: Floats  # (S, 3)
    valid: npt.NDArray[np.bool_]  # (S,)

    @classmethod
    def from_index(cls, index: SlideIndex) -> SlideTables:
        estimates = slide_estimates((s.path, s.stain) for s in index.slides)
        fill = StainEstimate((1, 0, 0), (0, 1, 0), (1, 1), (50, 0, 0), (1, 1, 1))
        rows = [e or fill for e in estimates]
        tables = cls(
            he=np.array([e.matrix() for e in rows]).reshape(-1, 3, 2),
            max_c=np.array([e.max_c for e in rows]).reshape(-1, 2),
            lab_mean=np.array([e.lab_mean for e in rows]).reshape(-1, 3),
            lab_std=np.array([e.lab_std for e in rows]).reshape(-1, 3),
            valid=np.array([e is not None for e in estimates], dtype=bool),
        )
        return tables

    def warn_missing(self, index: SlideIndex) -> None:
        """Say which slides ``index`` reads (rows in it: a split's view holds fewer than the
        index) have no estimate (once per run: the pipeline's `StainPipeline.bind` calls it)."""
        starts = index.slide_starts()
        missing = [
            s.path
            for sid, (s, valid) in enumerate(zip(index.slides, self.valid, strict=True))
            if not valid and s.status == "ok" and starts[sid + 1] > starts[sid]
        ]
        if missing:
            log.warning(
                "%d slides have no stain estimate (%s): their tiles pass the stain transforms "
                "unchanged (info shows why)",
                len(missing),
                ", ".join(missing[:3]) + (", ..." if len(missing) > 3 else ""),
            )
