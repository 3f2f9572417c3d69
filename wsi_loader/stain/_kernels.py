"""The two per-pixel kernels of the stain transforms, each in numpy/OpenCV (one tile in place, in
the DataLoader workers) and in torch (a whole batch on the device): `LogLinear` (optical
density: Macenko, HED jitter, stain jitter) and `LabAffine` (CIELAB: Reinhard, RandStain)."""

from __future__ import annotations

from dataclasses import dataclass, field

import cv2
import numpy as np
import numpy.typing as npt
import torch

Floats = npt.NDArray[np.float64]
UInt8s = npt.NDArray[np.uint8]
Work = tuple[npt.NDArray[np.float32], npt.NDArray[np.float32]]  # a kernel's scratch buffers


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
    conversions (the costly part of Reinhard per tile): CIELAB is ``K f(M rgb_linear) + k0``, with
    ``f`` the cube root (linear below 0.008856) per channel, so the per-channel affine map in
    CIELAB is one 3x3 affine map between ``f`` and its inverse: a LUT (sRGB to linear), three
    3x3 transforms, two cube roots / cubes and the sRGB gamma: faster (benchmarks/README.md,
    "Stain kernels") and within 1 grey level of the float64 formulas (OpenCV's spline
    gamma: 1). The linear toes of ``f``,
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
