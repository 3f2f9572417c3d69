"""The reader protocol every slide backend implements, the normalised slide metadata, and the
small pieces the backends and the pool share (resizing, a byte-bounded LRU).

Coordinate frames are named in variables: ``l0_*`` level-0 pixels, ``l_*`` pixels of the level
being read. Pixels come back as ``(H, W, 3)`` uint8 RGB numpy arrays; transparent areas (outside
the scanned region) are composited onto white, the slide background.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Generic, Literal, Protocol, TypeVar, runtime_checkable

import numpy as np
import numpy.typing as npt
from PIL import Image

RGBArray = npt.NDArray[np.uint8]
Value = TypeVar("Value")
MppSource = Literal["vendor", "tiff-resolution", "manifest", "missing"]
Window = tuple[int, int, int, int, int]  # (l0_x, l0_y, level, l_w, l_h)

# Resolutions coarser than this are not microscope scans: they come from a screen DPI
# (72 dpi = 352.8 um/px) written by generic image software.
MAX_PLAUSIBLE_MPP = 20.0


NON_SQUARE = 0.01  # relative MPP difference across / down worth a word (not rounding)


def non_square_note(mpp_x: float | None, mpp_y: float | None) -> str | None:
    """What to say of pixels that are not square: grids and MPP follow the x axis (as
    OpenSlide's ``mpp-x``), so a tile then covers another length down than across."""
    if mpp_x is None or mpp_y is None or mpp_x <= 0 or mpp_y <= 0:
        return None
    if abs(mpp_y / mpp_x - 1) <= NON_SQUARE:
        return None
    return (
        f"pixels are not square ({mpp_x:.4g} um across, {mpp_y:.4g} um down): tiles are laid "
        f"out by the MPP across, so each covers {mpp_y / mpp_x:.3g}x its width in microns down"
    )


def join_notes(*notes: str | None) -> str | None:
    """Notes joined with '; ', None when there are none."""
    present = [n for n in notes if n]
    return "; ".join(present) if present else None


@dataclass(frozen=True)
class SlideMeta:
    """What every backend reports about a slide, normalised across vendors."""

    backend: str
    vendor: str
    level_dimensions: tuple[tuple[int, int], ...]
    level_downsamples: tuple[float, ...]
    mpp: float | None
    mpp_source: MppSource
    objective_power: float | None = None
    # storage tile (width, height) per level; (0, 0) when unknown or stored as strips
    tile_sizes: tuple[tuple[int, int], ...] = field(default_factory=tuple)
    # what a user should know about how the slide is read (e.g. one channel of several)
    note: str | None = None

    @property
    def dimensions(self) -> tuple[int, int]:
        return self.level_dimensions[0]

    @property
    def level_count(self) -> int:
        return len(self.level_dimensions)

    @property
    def usable_mpp(self) -> float | None:
        """The MPP if it is a plausible microscope resolution, else None."""
        if self.mpp is None or not (0.0 < self.mpp <= MAX_PLAUSIBLE_MPP):
            return None
        return self.mpp


@runtime_checkable
class SlideReader(Protocol):
    """An open slide. Not thread-safe; one per process (see ``slides.pool``).

    Backends may also offer, and the reading layer uses when present: ``read_region_into``
    (into a caller's buffer), ``read_region_scaled`` (DCT-scaled), ``read_encoded`` (compressed
    bytes for a GPU decoder) and ``read_job`` (a read another thread may run; see
    `wsi_loader.dataset.reading.TileReader.read`).
    """

    path: str
    meta: SlideMeta

    def read_region(self, l0_x: int, l0_y: int, level: int, l_w: int, l_h: int) -> RGBArray:
        """Read ``l_w`` x ``l_h`` pixels of ``level`` whose top-left is level-0 ``(l0_x, l0_y)``.

        Raises ``TileReadError`` on any backend failure.
        """
        ...

    def close(self) -> None: ...


@runtime_checkable
class Prefetching(Protocol):
    """A reader that can start fetching the bytes of windows it will read soon (remote range
    requests, kernel read-ahead) and return at once."""

    def prefetch(self, windows: list[Window], out_size: int) -> None: ...


def l0_to_level(l0: int, downsample: float) -> int:
    """A level-0 coordinate in pixels of a level with ``downsample``: the one rounding rule of
    the whole library (the grid stores ``level_to_l0`` of level pixels, and every reader maps
    back with this, so ``l0_to_level(level_to_l0(l, ds), ds) == l`` for any ``ds >= 1``:
    windows laid on storage-tile corners stay on them at non-integer downsamples)."""
    return round(l0 / downsample)


def level_to_l0(l: int, downsample: float) -> int:  # noqa: E741
    """The level-0 coordinate of pixel ``l`` of a level (rounded; see `l0_to_level`)."""
    return round(l * downsample)


def rgba_to_rgb(rgba: npt.NDArray[np.uint8]) -> RGBArray:
    """Composite an RGBA array onto white (OpenSlide returns alpha 0 outside scanned areas)."""
    alpha = rgba[..., 3]
    if bool(alpha.min() == 255):
        return rgba[..., :3]  # a view: callers copy it into their batch buffer anyway
    a = alpha.astype(np.uint16)[..., None]
    rgb = (rgba[..., :3].astype(np.uint16) * a + 255 * (255 - a) + 127) // 255
    return rgb.astype(np.uint8)


def resize(pixels: RGBArray, out_w: int, out_h: int) -> RGBArray:
    """Bilinear (antialiased) resize with PIL."""
    if pixels.shape[1] == out_w and pixels.shape[0] == out_h:
        return pixels
    image = Image.fromarray(np.ascontiguousarray(pixels)).resize(
        (out_w, out_h), Image.Resampling.BILINEAR
    )
    return np.asarray(image)


class BytesLRU(Generic[Value]):
    """An LRU mapping bounded by the bytes its values hold (``size`` of each value); a value
    larger than the bound is not kept. Not thread-safe: one owner thread."""

    def __init__(self, max_bytes: int, size: Callable[[Value], int]) -> None:
        self.max_bytes = max_bytes
        self._size = size
        self._items: OrderedDict[Hashable, Value] = OrderedDict()
        self._bytes = 0

    def get(self, key: Hashable) -> Value | None:
        value = self._items.get(key)
        if value is not None:
            self._items.move_to_end(key)
        return value

    def put(self, key: Hashable, value: Value) -> None:
        if self._size(value) > self.max_bytes:
            return
        self.pop(key)
        self._items[key] = value
        self._bytes += self._size(value)
        while self._bytes > self.max_bytes:
            _, evicted = self._items.popitem(last=False)
            self._bytes -= self._size(evicted)

    def pop(self, key: Hashable) -> Value | None:
        """Take ``key``'s value out (None when absent)."""
        value = self._items.pop(key, None)
        if value is not None:
            self._bytes -= self._size(value)
        return value

    def clear(self) -> None:
        self._items.clear()
        self._bytes = 0
