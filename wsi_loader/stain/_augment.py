"""The stain augmentations, drawn per tile from ``(seed, epoch, row)``: `HEDJitter` (Tellez
2019, in scikit-image's HED space), `StainJitter` (the slide's stain vectors and
concentrations moved) and `RandStain` (a Reinhard target drawn from the archive's spread)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, ClassVar

import numpy as np
import numpy.typing as npt

from wsi_loader.errors import ConfigError
from wsi_loader.index._stain_estimates import IO
from wsi_loader.index._table import SlideIndex
from wsi_loader.stain._kernels import Floats, LabAffine, LogLinear, UInt8s
from wsi_loader.stain._targets import SlideTables, archive
from wsi_loader.stain._transforms import StainTransform, TileParams

# scikit-image's HED matrices (Ruifrok & Johnston 2001): hed = log(rgb) / log(1e-6) @ HED_FROM_RGB
RGB_FROM_HED = np.array([[0.65, 0.70, 0.29], [0.07, 0.99, 0.11], [0.27, 0.57, 0.78]])
HED_FROM_RGB = np.linalg.inv(RGB_FROM_HED)
_LOG_ADJUST = float(np.log(1e-6))


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

    per_slide: ClassVar[bool] = False  # no per-slide values

    def bind(self, index: SlideIndex, tables: SlideTables | None = None) -> HEDJitter:
        return replace(self, bound=True)

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

    def bind(self, index: SlideIndex, tables: SlideTables | None = None) -> RandStain:
        tables = SlideTables.from_index(index) if tables is None else tables
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
