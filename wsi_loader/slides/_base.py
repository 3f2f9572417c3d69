"""The reader protocol every slide backend implements, the normalised slide metadata, and the
small pieces the backends and the pool share (resizing, a byte-bounded LRU).

Coordinate frames are named in variables: ``l0_*`` level-0 pixels, ``l_*`` pixels of the level
being read. Pixels come back as ``(H, W, 3)`` uint8 RGB numpy arrays; transparent areas (outside
the scanned region) are composited onto white, the slide background.
"""

from __future__ import annotations

import errno
import os
import stat
from collections import OrderedDict
from collections.abc import Callable, Container, Hashable
from dataclasses import dataclass, field
from typing import Generic, Literal, NamedTuple, Protocol, TypeGuard, TypeVar, runtime_checkable

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
# Finer than this is beyond light microscopy (100x oil scans are ~0.1 um/px): a resolution
# tag with the wrong unit (pixels per micrometre written as per centimetre, 10^4 off).
MIN_PLAUSIBLE_MPP = 0.01


NON_SQUARE = 0.01  # relative MPP difference across / down worth a word (not rounding)
NOT_REGULAR = "not a regular file (a FIFO, device or folder)"


def require_regular(path: str) -> None:
    """Raise ``OSError`` (EINVAL, `NOT_REGULAR`) unless ``path`` is a regular file: opening a
    FIFO blocks until something writes to it, forever. For libraries that open the file by
    name themselves (OpenSlide); missing files are left to the open that follows."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISREG(mode):
        raise OSError(errno.EINVAL, NOT_REGULAR, path)


def open_regular(path: str, *, follow_symlinks: bool = True) -> int:
    """A read-only descriptor of ``path`` (not inherited by children, PEP 446), refusing
    anything but a regular file without ever blocking: checked before the open (no device's
    open is tried), and on the opened file, which ``O_NONBLOCK`` lets a FIFO put in its place
    meanwhile be opened at once instead of waiting for a writer. ``follow_symlinks=False``
    refuses a symlink (``O_NOFOLLOW``: ELOOP). Raises ``OSError``."""
    require_regular(path)
    nofollow = 0 if follow_symlinks else os.O_NOFOLLOW
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | nofollow)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, NOT_REGULAR, path)
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


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
        if self.mpp is None or not (MIN_PLAUSIBLE_MPP <= self.mpp <= MAX_PLAUSIBLE_MPP):
            return None
        return self.mpp


Reader = TypeVar("Reader", bound="SlideReader")


@runtime_checkable
class SlideReader(Protocol):
    """An open slide. Not thread-safe; one per process (see ``slides._pool``). A context
    manager (``with open_slide(path) as slide:``) that closes itself; backends subclass it
    for that. Reading a closed reader is a ``ValueError`` (the caller's bug, as for a closed
    file), never a failed tile.

    Optional capabilities are the small protocols below; the reading layer and the pool
    check them with `supports`, by type, so a backend offers one by defining its method.
    """

    path: str
    meta: SlideMeta
    broken: bool = False  # after a latched error (OpenSlide's): the pool opens it again

    def read_region(self, l0_x: int, l0_y: int, level: int, l_w: int, l_h: int) -> RGBArray:
        """Read ``l_w`` x ``l_h`` pixels of ``level`` whose top-left is level-0 ``(l0_x, l0_y)``.

        Raises ``TileReadError`` on any backend failure.
        """
        ...

    def close(self) -> None:
        """Release the file; harmless when closed already."""
        ...

    @property
    def closed(self) -> bool: ...

    def __enter__(self: Reader) -> Reader:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def closed_error(path: str) -> ValueError:
    """What a read of a closed reader raises."""
    return ValueError(f"read of a closed slide: {path}")


@runtime_checkable
class ReadsInto(Protocol):
    """Reads a window straight into the caller's ``(l_h, l_w, 3)`` buffer."""

    def read_region_into(
        self, dest: RGBArray, l0_x: int, l0_y: int, level: int, l_w: int, l_h: int
    ) -> None: ...


@runtime_checkable
class ReadsScaled(Protocol):
    """Reads a window shrunk to ``out_w`` x ``out_h`` (by DCT scaling where it can)."""

    def read_region_scaled(
        self, l0_x: int, l0_y: int, level: int, l_w: int, l_h: int, out_w: int, out_h: int
    ) -> RGBArray: ...


@runtime_checkable
class PlansReads(Protocol):
    """Hands out a window's read as a call another thread may run (None: read it serially)."""

    def read_job(
        self, dest: RGBArray, l0_x: int, l0_y: int, level: int, l_w: int, l_h: int
    ) -> Callable[[], None] | None: ...


SegmentKey = tuple[str, int, int, int]  # (path, level, segment index, DCT scale)


class SegmentJob(NamedTuple):
    """A storage segment to decode: its bytes are already read, ``decode`` uses no reader state
    (any thread may run it) and its result goes back through `PlansSegments.keep`."""

    key: SegmentKey
    nbytes: int  # decoded size, for cache budgets
    decode: Callable[[], RGBArray]


@runtime_checkable
class PlansSegments(Protocol):
    """Hands out the decodes of the storage segments a window needs (any thread may run
    them) and caches their results, so that the window's read then only stitches."""

    def segment_jobs(
        self,
        l0_x: int,
        l0_y: int,
        level: int,
        l_w: int,
        l_h: int,
        out_w: int,
        out_h: int,
        planned: Container[SegmentKey] = (),
    ) -> list[SegmentJob]: ...

    def keep(self, key: SegmentKey, pixels: RGBArray) -> None: ...

    def segment_cache_bytes(self) -> int: ...


class StoredSizes(NamedTuple):
    """The compressed size of every storage tile of a level: ``counts[row, col]`` bytes for
    the tile whose level pixels start at (``col * tile_w``, ``row * tile_h``)."""

    counts: npt.NDArray[np.int64]
    tile_w: int
    tile_h: int


@runtime_checkable
class KnowsStoredSizes(Protocol):
    """Tells how many compressed bytes each storage tile of a level holds, from the file's
    layout alone (no pixel decoded): the sharper the tile, the more bytes. None for a level
    not stored as compressed tiles."""

    def stored_sizes(self, level: int) -> StoredSizes | None: ...


@runtime_checkable
class ReadsEncoded(Protocol):
    """Hands out a window's compressed stream (for a GPU decoder); None when it cannot."""

    def read_encoded(
        self, l0_x: int, l0_y: int, level: int, l_w: int, l_h: int
    ) -> bytes | None: ...


@runtime_checkable
class ReadsStoredJpeg(Protocol):
    """Hands out a window's stored JPEG, YCbCr or RGB, as one complete stream that any
    libjpeg-based decoder (a browser) reads; None when the window is not one stored tile."""

    def read_stored_jpeg(
        self, l0_x: int, l0_y: int, level: int, l_w: int, l_h: int
    ) -> bytes | None: ...


@runtime_checkable
class KeepsLayout(Protocol):
    """A closed reader that keeps its parsed layout: ``reopen`` makes it readable again
    (False when the file changed or went), so the pool parks it instead of parsing again."""

    def reopen(self) -> bool: ...

    def layout_bytes(self) -> int:
        """Memory the kept layout holds (the pool's budget of parked readers)."""
        ...


@runtime_checkable
class Prefetching(Protocol):
    """A reader that can start fetching the bytes of windows it will read soon (remote range
    requests, kernel read-ahead) and return at once."""

    def prefetch(self, windows: list[Window], out_size: int) -> None: ...


Capability = TypeVar("Capability")
_SUPPORTED: dict[tuple[type, type], bool] = {}  # (reader class, capability) -> answer


def supports(reader: object, capability: type[Capability]) -> TypeGuard[Capability]:
    """Whether ``reader``'s class implements the capability protocol (its methods; the
    capability protocols have no data members). Decided once per class: an ``isinstance``
    check against a protocol is slow enough to show on the per-tile path."""
    key = (type(reader), capability)
    found = _SUPPORTED.get(key)
    if found is None:
        found = _SUPPORTED[key] = issubclass(type(reader), capability)
    return found


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

    @property
    def nbytes(self) -> int:
        """The bytes the kept values hold."""
        return self._bytes
