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
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import cv2
import numpy as np
import numpy.typing as npt
import torch

from wsi_loader.config import StainConfig
from wsi_loader.errors import ConfigError, InputError
from wsi_loader.index._stain_estimates import (
    IO,
    StainEstimate,
    archive_reference,
    check_vectors,
    fit_image,
    read_reference,
    single_threaded_opencv,
    slide_estimate,
    slide_estimates,
)
from wsi_loader.index._table import SlideIndex
from wsi_loader.index._table_files import CURRENT

log = logging.getLogger(__name__)

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

Floats = npt.NDArray[np.float64]
UInt8s = npt.NDArray[np.uint8]
Work = tuple[npt.NDArray[np.float32], npt.NDArray[np.float32]]  # a kernel's scratch buffers
Target = StainEstimate | np.ndarray | str | os.PathLike[str] | SlideIndex | None

# scikit-image's HED matrices (Ruifrok & Johnston 2001): hed = log(rgb) / log(1e-6) @ HED_FROM_RGB
RGB_FROM_HED = np.array([[0.65, 0.70, 0.29], [0.07, 0.99, 0.11], [0.27, 0.57, 0.78]])
HED_FROM_RGB = np.linalg.inv(RGB_FROM_HED)
_LOG_ADJUST = float(np.log(1e-6))
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".webp")


# ---------------------------------------------------------------------------------------------
# targets and per-slide tables


def resolve_target(target: Target, index: SlideIndex | None = None) -> StainEstimate:
    """The stain a transform normalises to. ``target`` may be a `StainEstimate`, an RGB uint8
    image ``(H, W, 3)`` (fitted like torchstain's ``fit``: give a crop with tissue), a reference
    JSON file (``wsi-loader stain IDX --reference --out FILE``), an image file, an index folder
    or `SlideIndex` (its archive reference: the median stain of its slides), a slide file (its
    tissue at low resolution, as when indexing), or None (``index``'s archive reference)."""
    if isinstance(target, StainEstimate):
        return target
    if isinstance(target, np.ndarray):
        return fit_target(target)
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
            return fit_target(rgb)
        except InputError as exc:
            raise InputError(str(exc), path=str(path)) from None
    return _slide_stain(str(path))


def fit_target(rgb: UInt8s) -> StainEstimate:
    """`fit_image`, refused when the image's stains are not H&E's (the check slide estimates
    get: a target from a fluorescence or one-stain image would recolour every tile)."""
    found = fit_image(rgb)
    problem = check_vectors(found.matrix())
    if problem is not None:
        raise InputError(f"no stain target from this image: {problem}")
    return found


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
    from wsi_loader.index._tissue import choose_detector, read_mask_image, tissue_mask
    from wsi_loader.slides._open import open_slide

    with open_slide(path) as reader:
        image, level = read_mask_image(reader, 2048)
        detector, why = choose_detector(image)
        if detector == "fluorescence":  # as when indexing: such a slide has no stain estimate
            raise InputError(f"no stain target from a fluorescence slide ({why})", path=path)
        # read level 0: a slide with one level is sampled at full resolution, as when indexed
        found = slide_estimate(reader, image, tissue_mask(image), level, 0)
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
        """Say which of ``index``'s slides with tiles have no estimate (once per run: the
        pipeline's `StainPipeline.bind` calls it)."""
        missing = [
            s.path
            for s, valid in zip(index.slides, self.valid, strict=True)
            if not valid and s.status == "ok" and s.tiles > 0
        ]
        if missing:
            log.warning(
                "%d slides have no stain estimate (%s): their tiles pass the stain transforms "
                "unchanged (info shows why)",
                len(missing),
                ", ".join(missing[:3]) + (", ..." if len(missing) > 3 else ""),
            )


# ---------------------------------------------------------------------------------------------
# the two per-pixel kernels, each in numpy/OpenCV and in torch


@dataclass(frozen=True, eq=False)
class LogLinear:
    """``out = io * exp(M @ log(max(in + add, floor) / io) + b) - sub`` per pixel, M and b per
    tile; with ``clamp`` (scikit-image's HED), ``h = max(A @ l, 0)`` comes first and M acts
    on h. Macenko (+1 in, OD), HED (no offset) and stain jitter share it."""

    io: float
    add: float = 1.0
    floor: float = 1.0
    sub: float = 0.0
    clamp: Floats | None = None  # (3, 3): into a space whose negative values are cut
    lut: npt.NDArray[np.float32] = field(init=False, repr=False)  # uint8 -> log value

    def __post_init__(self) -> None:
        values = np.maximum(np.arange(256, dtype=np.float64) + self.add, self.floor)
        object.__setattr__(self, "lut", np.log(values / self.io).astype(np.float32)[None])

    def numpy(self, tile: UInt8s, m: Floats, b: Floats, out: UInt8s, work: Work) -> None:
        x, y = work
        cv2.LUT(tile, self.lut, dst=x)
        if self.clamp is not None:
            cv2.transform(x, self.clamp.astype(np.float32), dst=y)
            cv2.max(y, 0.0, dst=y)
            x, y = y, x
        affine = np.hstack([m, b[:, None]]) if b.any() else m
        cv2.transform(x, affine.astype(np.float32), dst=y)
        x = y
        cv2.exp(x, dst=x)
        if self.sub:  # io * x - sub >= 0 before OpenCV's saturating |.|
            cv2.max(x, _all(self.sub / self.io), dst=x)
        cv2.convertScaleAbs(x, dst=out, alpha=self.io, beta=-self.sub)

    def torch(self, images: torch.Tensor, m: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        x = images.float().add_(self.add).clamp_(min=self.floor).div_(self.io).log_()
        if self.clamp is not None:
            a = torch.as_tensor(self.clamp, dtype=x.dtype, device=x.device)
            x = torch.einsum("ij,nhwj->nhwi", a, x).clamp_(min=0)
        y = torch.einsum("nij,nhwj->nhwi", m, x) + b[:, None, None, :]
        return y.exp_().mul_(self.io).sub_(self.sub).clamp_(0, 255).round_().to(torch.uint8)


@dataclass(frozen=True)
class LabAffine:
    """``lab' = lab * scale + shift`` per channel in CIELAB (D65, sRGB gamma), per tile.

    On the CPU the map is taken apart instead of going through OpenCV's float CIELAB
    conversions (~350 us each per 256 px tile): CIELAB is ``K f(M rgb_linear) + k0``, with
    ``f`` the cube root (linear below 0.008856) per channel, so the per-channel affine map in
    CIELAB is one 3x3 affine map between ``f`` and its inverse: a LUT (sRGB to linear), three
    3x3 transforms, two cube roots / cubes and the sRGB gamma, 1.6-2.1x faster and within 1
    grey level of the float64 formulas (OpenCV's spline gamma: 1). The linear toes of ``f``,
    its inverse and the sRGB gamma cost three passes each; a tile with no pixel that dark
    (checked with one min) skips them."""

    def numpy(self, tile: UInt8s, scale: Floats, shift: Floats, out: UInt8s, work: Work) -> None:
        a, b = work
        cv2.LUT(tile, _LINEAR_LUT, dst=a)  # linear RGB
        cv2.transform(a, _M1_32, dst=b)  # XYZ / white
        # f(v) = cbrt(max(v, T)) + 7.787 min(v - T, 0): the -7.787 T goes into the next map
        toe = _power_with_toe(b, _T, 1 / 3, 7.787, a)
        lab_scale = _K_INV @ np.diag(scale) @ _K  # f' = B f + beta
        beta = _K_INV @ (scale * _K0 + shift - _K0)
        offset = beta - lab_scale @ np.full(3, 7.787 * _T) if toe else beta
        cv2.transform(b, np.hstack([lab_scale, offset[:, None]]).astype(np.float32), dst=a)
        # f^-1(w) = max(w, FT)^3 + (min(w, FT) - FT) / 7.787
        toe = _power_with_toe(a, _FT, 3.0, 1 / 7.787, b)
        cv2.transform(a, _M1_INV_TOE if toe else _M1_INV, dst=b)  # linear RGB'
        # sRGB: 1.055 max(c, t)^(1/2.4) - 0.055 + 12.92 min(c - t, 0), clipped to 0..255
        toe = _power_with_toe(b, _GAMMA_T, 1 / 2.4, 12.92 / 1.055, a)
        s = b
        beta_out = -0.055 - (12.92 * _GAMMA_T if toe else 0.0)
        cv2.max(s, _all(-beta_out / 1.055), dst=s)  # >= 0 before the saturating |.|
        cv2.convertScaleAbs(s, dst=out, alpha=1.055 * 255.0, beta=beta_out * 255.0)

    def torch(self, images: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
        lab = rgb_to_lab_torch(images.float() / 255)
        lab = lab * scale[:, None, None, :] + shift[:, None, None, :]
        return lab_to_rgb_torch(lab).mul_(255).clamp_(0, 255).round_().to(torch.uint8)


def _all(value: float) -> tuple[float, float, float, float]:
    """A scalar for every channel (OpenCV reads a plain float as (value, 0, 0, 0))."""
    return (value, value, value, value)


def _power_with_toe(
    values: npt.NDArray[np.float32],
    knee: float,
    power: float,
    slope: float,
    spare: npt.NDArray[np.float32],
) -> bool:
    """``max(v, knee) ** power + slope * min(v, knee)`` in place of ``values`` (the caller
    folds the constant ``-slope * knee`` into its next map); returns whether any value was
    below the knee: without one, ``values ** power`` alone (three passes fewer). ``spare``: a
    buffer of the same shape to use."""
    low = float(cv2.minMaxLoc(values.reshape(values.shape[0], -1))[0])
    toe = low < knee
    if toe:
        cv2.min(values, _all(knee), dst=spare)
        cv2.max(values, _all(knee), dst=values)
    if power == 3.0:
        cv2.pow(values, 3, dst=values)
    else:  # exp(log(v) p): OpenCV's pow with a fraction is 3x slower
        cv2.log(values, dst=values)
        cv2.multiply(values, power, dst=values)
        cv2.exp(values, dst=values)
    if toe:
        cv2.scaleAdd(spare, slope, values, dst=values)
    return toe


_RGB_TO_XYZ = np.array(
    [[0.412453, 0.357580, 0.180423], [0.212671, 0.715160, 0.072169], [0.019334, 0.119193, 0.950227]]
)
_WHITE = np.array([0.950456, 1.0, 1.088754])  # D65, as OpenCV
# the CPU kernel's pieces of CIELAB (see LabAffine)
_UNIT = np.arange(256) / 255.0
_LINEAR_LUT = np.where(_UNIT > 0.04045, ((_UNIT + 0.055) / 1.055) ** 2.4, _UNIT / 12.92)
_LINEAR_LUT = _LINEAR_LUT.astype(np.float32).reshape(1, 256)
_M1 = _RGB_TO_XYZ / _WHITE[:, None]  # linear RGB -> XYZ / white
_M1_32 = _M1.astype(np.float32)
_K = np.array([[0.0, 116, 0], [500, -500, 0], [0, 200, -200]])  # lab = K f + k0
_K0 = np.array([-16.0, 0, 0])
_T, _GAMMA_T = 0.008856, 0.0031308  # where f and the sRGB gamma turn linear
_FT = 7.787 * _T + 16 / 116  # f(T)
_K_INV = np.linalg.inv(_K)
_M1_INV = np.linalg.inv(_M1).astype(np.float32)
_M1_INV_TOE = np.hstack(  # with f^-1's constant -FT / 7.787 folded in
    [np.linalg.inv(_M1), -np.linalg.inv(_M1) @ np.full((3, 1), _FT / 7.787)]
).astype(np.float32)


def rgb_to_lab_torch(rgb: torch.Tensor) -> torch.Tensor:
    """CIELAB of RGB in [0, 1], channels last (the formulas of OpenCV and scikit-image)."""
    linear = torch.where(rgb > 0.04045, ((rgb + 0.055) / 1.055) ** 2.4, rgb / 12.92)
    m = torch.as_tensor(_RGB_TO_XYZ / _WHITE[:, None], dtype=rgb.dtype, device=rgb.device)
    xyz = linear @ m.T
    f = torch.where(xyz > 0.008856, xyz.clamp(min=1e-12) ** (1 / 3), 7.787 * xyz + 16 / 116)
    fx, fy, fz = f.unbind(-1)
    return torch.stack([116 * fy - 16, 500 * (fx - fy), 200 * (fy - fz)], dim=-1)


def lab_to_rgb_torch(lab: torch.Tensor) -> torch.Tensor:
    """RGB in [0, 1] (clipped) of CIELAB, channels last."""
    fy = (lab[..., 0] + 16) / 116
    f = torch.stack([fy + lab[..., 1] / 500, fy, fy - lab[..., 2] / 200], dim=-1)
    xyz = torch.where(f > 0.2068966, f**3, (f - 16 / 116) / 7.787)
    m = torch.as_tensor(
        np.linalg.inv(_RGB_TO_XYZ / _WHITE[:, None]), dtype=lab.dtype, device=lab.device
    )
    linear = (xyz @ m.T).clamp(0, 1)
    return torch.where(linear > 0.0031308, 1.055 * linear ** (1 / 2.4) - 0.055, 12.92 * linear)


# ---------------------------------------------------------------------------------------------
# the transforms


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

    def bind(self, index: SlideIndex) -> StainTransform:
        return replace(self, tables=SlideTables.from_index(index), bound=True)

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
        # page faults (measured 1.4 ms vs 0.55 ms per 256 px tile for Reinhard)
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
    slower and noisier; a tile whose estimate fails falls back to its slide's)."""

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
            object.__setattr__(self, "resolved", resolve_target(self.target))
            object.__setattr__(self, "target", None)

    def bind(self, index: SlideIndex) -> Normalize:
        resolved = self.resolved or resolve_target(self.target, index)
        return replace(self, tables=SlideTables.from_index(index), bound=True, resolved=resolved)

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
            for i, tile in enumerate(images):
                try:
                    own = fit_image(np.ascontiguousarray(tile))
                except (InputError, ValueError, np.linalg.LinAlgError):
                    continue  # too little tissue: the slide's values
                he[i], max_c[i] = own.matrix(), own.max_c
                mean[i], std[i] = own.lab_mean, np.maximum(own.lab_std, 1e-6)
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
class HEDJitter(StainTransform):
    """HED augmentation (Tellez 2019): per tile and HED channel, ``h * U(1-sigma, 1+sigma) +
    U(-bias, bias)`` in scikit-image's HED space. With ``clamp`` the negative HED values are
    cut first, exactly as ``rgb2hed`` does, so zero ``sigma``/``bias`` is scikit-image's round
    trip; without it (default) zero ``sigma``/``bias`` is the identity (the round trip alone
    moves ~20% of an H&E tile's pixels, some by 100+ grey levels)."""

    sigma: float = 0.05
    bias: float = 0.05
    clamp: bool = False

    def __post_init__(self) -> None:
        for name in ("sigma", "bias"):
            value = getattr(self, name)
            if not 0 <= value < 1:
                raise ConfigError(f"{name} must be in [0, 1), got {value}", key=name, value=value)
        clamp = (HED_FROM_RGB.T / _LOG_ADJUST) if self.clamp else None
        kernel = LogLinear(io=255.0, add=0.0, floor=255e-6, clamp=clamp)
        object.__setattr__(self, "kernel", kernel)
        object.__setattr__(self, "salt", 1)

    def bind(self, index: SlideIndex) -> HEDJitter:
        return replace(self, bound=True)  # no per-slide values

    def _check_bound(self) -> None:
        pass

    def params(
        self,
        images: UInt8s | None,
        slide_ids: npt.NDArray[np.int64],
        rows: npt.NDArray[np.int64],
        epoch: int,
    ) -> TileParams:
        n = len(rows)
        alpha, beta = np.ones((n, 3)), np.zeros((n, 3))
        for i, rng in enumerate(self._rngs(rows, epoch)):
            alpha[i] = rng.uniform(1 - self.sigma, 1 + self.sigma, 3)
            beta[i] = rng.uniform(-self.bias, self.bias, 3)
        to_hed = HED_FROM_RGB / _LOG_ADJUST  # rows: l @ to_hed = hed
        back = _LOG_ADJUST * RGB_FROM_HED  # hed @ back = log rgb
        if self.clamp:  # the kernel already is in HED space: hed' = hed * alpha + beta
            a = np.einsum("nk,kj->njk", alpha, back)
        else:
            a = np.einsum("ik,nk,kj->nji", to_hed, alpha, back)
        return TileParams(a, beta @ back, np.ones(n, dtype=bool))

    def spec(self) -> dict[str, Any]:
        return {
            "transform": "hed_jitter",
            "sigma": self.sigma,
            "bias": self.bias,
            "clamp": self.clamp,
            "seed": self.seed,
        }


@dataclass(frozen=True)
class StainJitter(StainTransform):
    """Perturb each tile's slide stain vectors (each component + N(0, sigma), made unit again)
    and scale each stain's concentration by U(1-concentration, 1+concentration); the part of
    the OD outside the H-E plane is kept, so zero ``sigma``/``concentration`` is the identity."""

    sigma: float = 0.05
    concentration: float = 0.1

    def __post_init__(self) -> None:
        for name in ("sigma", "concentration"):
            value = getattr(self, name)
            if not 0 <= value < 1:
                raise ConfigError(f"{name} must be in [0, 1), got {value}", key=name, value=value)
        object.__setattr__(self, "kernel", LogLinear(io=IO, sub=1.0))
        object.__setattr__(self, "salt", 2)

    def params(
        self,
        images: UInt8s | None,
        slide_ids: npt.NDArray[np.int64],
        rows: npt.NDArray[np.int64],
        epoch: int,
    ) -> TileParams:
        ids = self._slides(slide_ids)
        he = self.tables.he[ids]
        moved = he.copy()
        scale = np.ones((len(ids), 2))
        for i, rng in enumerate(self._rngs(rows, epoch)):
            v = np.clip(he[i] + rng.normal(0, self.sigma, (3, 2)), 1e-3, None)
            moved[i] = v / np.linalg.norm(v, axis=0)
            scale[i] = rng.uniform(1 - self.concentration, 1 + self.concentration, 2)
        a = np.eye(3)[None] + (moved * scale[:, None, :] - he) @ np.linalg.pinv(he)
        return TileParams(a, np.zeros((len(ids), 3)), self.tables.valid[ids])

    def spec(self) -> dict[str, Any]:
        return {
            "transform": "stain_jitter",
            "sigma": self.sigma,
            "concentration": self.concentration,
            "seed": self.seed,
        }


@dataclass(frozen=True)
class RandStain(StainTransform):
    """RandStainNA-like augmentation: per tile, a Reinhard target drawn from the archive's
    spread of slide LAB statistics (each channel's mean and standard deviation ~ a normal
    fitted over the slides, its spread times ``spread``), reached from the tile's slide."""

    spread: float = 1.0
    spread_of: tuple[Floats, Floats, Floats, Floats] | None = field(
        default=None, repr=False, compare=False
    )

    def __post_init__(self) -> None:
        if not 0 <= self.spread <= 10:
            raise ConfigError(f"spread must be in [0, 10], got {self.spread}", key="spread")
        object.__setattr__(self, "kernel", LabAffine())
        object.__setattr__(self, "salt", 3)

    def bind(self, index: SlideIndex) -> RandStain:
        tables = SlideTables.from_index(index)
        if not tables.valid.any():
            archive(index)  # raises: no estimates
        mean, std = tables.lab_mean[tables.valid], tables.lab_std[tables.valid]
        spread = (mean.mean(0), mean.std(0), std.mean(0), std.std(0))
        return replace(self, tables=tables, bound=True, spread_of=spread)

    def params(
        self,
        images: UInt8s | None,
        slide_ids: npt.NDArray[np.int64],
        rows: npt.NDArray[np.int64],
        epoch: int,
    ) -> TileParams:
        assert self.spread_of is not None
        mu_mean, sd_mean, mu_std, sd_std = self.spread_of
        ids = self._slides(slide_ids)
        mean, std = self.tables.lab_mean[ids], self.tables.lab_std[ids]
        t_mean, t_std = np.empty_like(mean), np.empty_like(std)
        for i, rng in enumerate(self._rngs(rows, epoch)):
            t_mean[i] = rng.normal(mu_mean, sd_mean * self.spread)
            t_std[i] = np.maximum(rng.normal(mu_std, sd_std * self.spread), 0.1 * mu_std)
        scale = t_std / std
        return TileParams(scale, t_mean - mean * scale, self.tables.valid[ids])

    def spec(self) -> dict[str, Any]:
        return {"transform": "rand_stain", "spread": self.spread, "seed": self.seed}


@dataclass(frozen=True)
class StainPipeline:
    """Transforms applied in order (what a list given as ``stain=`` becomes)."""

    steps: tuple[StainTransform, ...]

    @property
    def bound(self) -> bool:
        return all(s.bound for s in self.steps)

    def bind(self, index: SlideIndex, warn: bool = True) -> StainPipeline:
        """Each step bound to ``index``; with ``warn``, one WARNING naming the slides without
        an estimate (a run binds once with it; its units and loaders bind again without)."""
        bound = StainPipeline(tuple(s.bind(index) for s in self.steps))
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


def as_stain(value: Any, key: str = "stain") -> StainPipeline | None:
    """``stain=`` as given (a transform, a list of them, or None) as a `StainPipeline`. The
    commands' ``--stain`` spellings work too: ``"macenko"`` or ``"reinhard"`` is
    ``Normalize(method)`` with the default target (the index's median), ``"none"`` None."""
    if value is None or (isinstance(value, str) and value == "none"):
        return None
    if isinstance(value, StainPipeline):
        return value
    steps = [value] if isinstance(value, (StainTransform, str)) else value
    if isinstance(steps, (list, tuple)):
        steps = [_by_name(s, key) if isinstance(s, str) else s for s in steps]
    if not isinstance(steps, (list, tuple)) or not all(
        isinstance(s, StainTransform) for s in steps
    ):
        raise ConfigError(
            f"invalid value {value!r} for {key!r}: a stain transform of wsi_loader.stain "
            "(Normalize, HEDJitter, StainJitter, RandStain), 'macenko' or 'reinhard' (as "
            "--stain), a list of them, or None",
            key=key,
            value=value,
        )
    return StainPipeline(tuple(steps)) if steps else None


def _by_name(method: str, key: str) -> Normalize:
    if method not in ("macenko", "reinhard"):
        raise ConfigError(
            f"invalid value {method!r} for {key!r}: 'macenko' or 'reinhard' (as --stain: "
            "Normalize(method) with the index's median target), Normalize(method, "
            "target=...) for another target, a stain transform of wsi_loader.stain, a list "
            "of them, or None",
            key=key,
            value=method,
        )
    return Normalize(method)


def from_spec(spec: Sequence[dict[str, Any]]) -> StainPipeline | None:
    """The transforms `StainPipeline.spec` described (not yet bound)."""
    steps: list[StainTransform] = []
    for s in spec:
        kind = s.get("transform")
        if kind == "normalize":
            steps.append(
                Normalize(
                    s["method"],
                    per_tile=bool(s.get("per_tile")),
                    resolved=StainEstimate.from_json(s["target"]),
                )
            )
        elif kind == "hed_jitter":
            steps.append(
                HEDJitter(sigma=s["sigma"], bias=s["bias"], clamp=s["clamp"], seed=s["seed"])
            )
        elif kind == "stain_jitter":
            steps.append(
                StainJitter(sigma=s["sigma"], concentration=s["concentration"], seed=s["seed"])
            )
        elif kind == "rand_stain":
            steps.append(RandStain(spread=s["spread"], seed=s["seed"]))
        else:
            raise ConfigError(f"unknown stain transform {kind!r}", key="stain")
    return StainPipeline(tuple(steps)) if steps else None


def stain_from_options(method: str | None, target: Target = None) -> Normalize | None:
    """The normalisation the commands' ``--stain METHOD --stain-target T`` ask for (None for
    no ``--stain``): what ``export``, ``features``, ``predict`` and ``mosaic`` use."""
    if method is None or method == "none":
        return None
    return Normalize(method, target=target)


def stain_from_config(
    config: StainConfig, method: str | None = None, target: Target = None
) -> list[StainTransform] | None:
    """The transforms a config file's ``stain`` section asks for (normalisation, then the
    augmentations in order; None for none); ``method``/``target`` (``--stain``,
    ``--stain-target``) override its ``normalize``/``target``."""
    steps: list[StainTransform] = []
    method = method or config.normalize
    if method is not None and method != "none":
        chosen = target if target is not None else config.target
        steps.append(Normalize(method, target=chosen, per_tile=config.per_tile))
    for i, step in enumerate(config.augment):
        seed = config.seed + i  # each augmentation draws its own numbers
        if step.hed_jitter is not None:
            h = step.hed_jitter
            steps.append(HEDJitter(sigma=h.sigma, bias=h.bias, clamp=h.clamp, seed=seed))
        elif step.stain_jitter is not None:
            j = step.stain_jitter
            steps.append(StainJitter(sigma=j.sigma, concentration=j.concentration, seed=seed))
        elif step.rand_stain is not None:
            steps.append(RandStain(spread=step.rand_stain.spread, seed=seed))
    return steps or None
