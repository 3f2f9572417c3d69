"""Synthetic pyramidal slides for tests, the demo and benchmarks.

`write_svs` writes an Aperio-compatible SVS that OpenSlide opens as vendor ``aperio``: tiled JPEG
levels at downsamples 1/4/16/64 (as many as fit), abbreviated JPEG tiles sharing one JPEGTables
tag (as real scanners write them), MPP and AppMag in the ImageDescription. `write_tiff` writes a
generic tiled TIFF pyramid (reduced-resolution pages, resolution tags in centimetres).

The picture is H&E-like: a near-white background, irregular tissue regions (a smoothed random
field), pink stroma texture and purple nuclei, so compressed tile sizes are realistic. Tiles
are generated one at a time, so a 40k x 30k slide never needs its full raster in memory.
``corrupt_tiles`` breaks chosen level-0 tiles exactly the way openslide-python's
``unreadable.svs`` is broken (the JPEG SOS marker 0xFFDA becomes 0xFFDB).

``SlideSpec(artefacts=...)`` paints pen strokes, blurred regions, folds and bubbles with known
masks (`wsi_loader.synthetic`); ``dark_field=True`` draws a fluorescence (DAPI-like)
slide instead: black glass, dim tissue, bright blue nuclei.
"""

from __future__ import annotations

import io
import math
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, replace

import numpy as np
import numpy.typing as npt
import tifffile
from PIL import Image, ImageDraw
from scipy import ndimage

from wsi_loader.synthetic._artefacts import Artefact, paint_artefacts, qc_layout
from wsi_loader.synthetic._other_artefacts import paint_other_artefacts

_FIELD_STEP = 32  # level-0 pixels per cell of the tissue field
_BACKGROUND = np.array([242, 241, 239], dtype=np.float32)
_STROMA = np.array([226, 160, 196], dtype=np.float32)
_NUCLEUS = (88, 58, 140)
# nuclei (radius 2.5-5.5 px, 0.8 as high as wide, one per 900 px^2) cover this share of tissue;
# levels coarser than 1/_DOTS_UP_TO draw that share as a tint instead of dots
_NUCLEAR_SHARE = math.pi * (2.5**2 + 2.5 * 5.5 + 5.5**2) / 3 * 0.8 / 900
_DOTS_UP_TO = 4
# dark field (fluorescence, a DAPI channel shown in blue): black glass, dim tissue, bright nuclei
_DARK_BACKGROUND = np.array([2, 2, 5], dtype=np.float32)
_DARK_TISSUE = np.array([3, 4, 22], dtype=np.float32)
_DARK_NUCLEUS = (20, 30, 215)


@dataclass(frozen=True)
class SlideSpec:
    """What to draw: level-0 size, storage tile size, resolution, seed, tissue share."""

    width: int = 10_000
    height: int = 8_000
    tile_size: int = 256
    mpp: float = 0.5
    seed: int = 0
    tissue: float = 0.35  # approximate share of the area covered by tissue
    nuclei: float = 1.0  # nuclei per area of tissue, times the default's (a class that shows)
    quality: int = 85
    # stained with known optical-density vectors (H, E), by Beer-Lambert, instead of fixed
    # colours: nuclei haematoxylin, stroma eosin (tests of stain estimation)
    stain: tuple[tuple[float, float, float], tuple[float, float, float]] | None = None
    # the stained slides' amounts of H and E, times the default's (a darker or paler staining
    # of the same tissue)
    amounts: tuple[float, float] = (1.0, 1.0)
    artefacts: tuple[Artefact, ...] = ()  # painted over the tissue (_artefacts)
    # which painter draws pen and folds: "ours" (_artefacts, what QC was tuned on) or
    # "other" (_other_artefacts: ink blended over the stain, a second tissue layer)
    artefact_painter: str = "ours"
    dark_field: bool = False  # a fluorescence slide: dark glass, bright nuclei


class _Painter:
    """Deterministic tile painter: the same level-0 area looks the same at every level."""

    def __init__(self, spec: SlideSpec) -> None:
        self.spec = spec
        rng = np.random.default_rng(spec.seed)
        fw = math.ceil(spec.width / _FIELD_STEP) + 2
        fh = math.ceil(spec.height / _FIELD_STEP) + 2
        sigma = max(fw, fh) / 14.0
        field = ndimage.gaussian_filter(rng.standard_normal((fh, fw)).astype(np.float32), sigma)
        # keep tissue away from the slide border, like a real section on glass
        yy, xx = np.mgrid[0:fh, 0:fw]
        edge = np.minimum.reduce([xx, yy, fw - 1 - xx, fh - 1 - yy]).astype(np.float32)
        field = field / (field.std() + 1e-9) - 3.0 * np.exp(-edge / (0.04 * max(fw, fh) + 1))
        self.threshold = float(np.quantile(field, 1.0 - spec.tissue))
        self.field = field
        self._texture_bank: dict[
            int, tuple[list[npt.NDArray[np.uint8]], list[npt.NDArray[np.uint8]]]
        ] = {}

    def tissue_mask(
        self, l0_x: int, l0_y: int, ds: float, w: int, h: int, above: float = 0.0
    ) -> npt.NDArray[np.bool_]:
        """Tissue where the smoothed field (sampled every 8 px, bilinear) passes the threshold
        (plus ``above``: the tissue's cores)."""
        threshold = self.threshold + above
        step = 8
        xs = (l0_x + np.arange(0, w + step, step) * ds) / _FIELD_STEP
        ys = (l0_y + np.arange(0, h + step, step) * ds) / _FIELD_STEP
        gy, gx = np.meshgrid(ys, xs, indexing="ij")
        coarse = ndimage.map_coordinates(self.field, [gy, gx], order=1, mode="nearest")
        if coarse.max() <= threshold - 0.05:
            return np.zeros((h, w), dtype=bool)
        size = ((coarse.shape[1] - 1) * step, (coarse.shape[0] - 1) * step)
        fine = Image.fromarray(coarse.astype(np.float32), "F").resize(
            size,
            Image.Resampling.BILINEAR,
            box=(0.5, 0.5, coarse.shape[1] - 0.5, coarse.shape[0] - 0.5),
        )
        return np.asarray(fine)[:h, :w] > threshold

    def _textures(
        self, size: int
    ) -> tuple[list[npt.NDArray[np.uint8]], list[npt.NDArray[np.uint8]]]:
        """A few pre-drawn background and stroma textures per tile size (noise is the slow part)."""
        if size not in self._texture_bank:
            rng = np.random.default_rng([self.spec.seed, size])
            noise = [rng.normal(0.0, 1.0, (size, size, 1)).astype(np.float32) for _ in range(4)]
            glass, tissue, spread = (
                (_DARK_BACKGROUND, _DARK_TISSUE, 3.0)
                if self.spec.dark_field
                else (_BACKGROUND, _STROMA, 14.0)
            )
            background = [np.clip(glass + n * 2.5, 0, 255).astype(np.uint8) for n in noise]
            stroma = [np.clip(tissue + n * spread, 0, 255).astype(np.uint8) for n in noise]
            self._texture_bank[size] = (background, stroma)
        return self._texture_bank[size]

    def paint(
        self, level: int, l0_x: int, l0_y: int, ds: float, size: int
    ) -> npt.NDArray[np.uint8]:
        tile = self._paint_clean(level, l0_x, l0_y, ds, size)
        if not self.spec.artefacts:
            return tile
        paint = paint_other_artefacts if self.spec.artefact_painter == "other" else paint_artefacts
        return paint(
            tile,
            self.spec.artefacts,
            l0_x,
            l0_y,
            ds,
            self.tissue_mask(l0_x, l0_y, ds, size, size),
            lambda x, y: self._paint_clean(level, round(x), round(y), ds, size),
        )

    def _paint_clean(
        self, level: int, l0_x: int, l0_y: int, ds: float, size: int
    ) -> npt.NDArray[np.uint8]:
        # tiles left of or above the slide (a blurred artefact's neighbours) get keys of their own
        key = [l0_x, l0_y] if l0_x >= 0 and l0_y >= 0 else [l0_x % 2**32, l0_y % 2**32, 1]
        rng = np.random.default_rng([self.spec.seed, level, *key])
        background, stroma = self._textures(size)
        shift = tuple(int(v) for v in rng.integers(0, size, 2))
        bg = np.roll(background[int(rng.integers(4))], shift, axis=(0, 1))
        mask = self.tissue_mask(l0_x, l0_y, ds, size, size)
        if not mask.any():
            return bg
        tissue = np.roll(stroma[int(rng.integers(4))], shift, axis=(0, 1))
        nucleus = _DARK_NUCLEUS if self.spec.dark_field else _NUCLEUS
        if ds > _DOTS_UP_TO and self.spec.stain is None:
            # a coarse level averages many nuclei into each pixel, as a scanner's pyramid does:
            # a tint of the nuclei's share, not single-pixel dots of pure nucleus colour (a
            # stained slide keeps its dots: its repainting finds nuclei by their colour)
            share = min(0.5, _NUCLEAR_SHARE * self.spec.nuclei)
            tinted = tissue * (1 - share) + np.array(nucleus) * share
            return np.where(mask[..., None], tinted.astype(np.uint8), bg)
        canvas = Image.fromarray(np.where(mask[..., None], tissue, bg))
        draw = ImageDraw.Draw(canvas)
        # about one nucleus per 900 level-0 px^2 of tissue, capped on coarse levels
        per_tile = mask.mean() * size * size * ds * ds * self.spec.nuclei / 900.0
        n = min(int(per_tile), size * size // 24)
        xy = rng.integers(0, size, (n, 2))
        xy = xy[mask[xy[:, 1], xy[:, 0]]]
        radii = np.maximum(rng.uniform(2.5, 5.5, len(xy)) / ds, 0.6)
        shades = rng.integers(-20, 20, len(xy))
        for (x, y), r, d in zip(xy.tolist(), radii.tolist(), shades.tolist(), strict=True):
            fill = (nucleus[0] + d, nucleus[1] + d, nucleus[2] + d)
            draw.ellipse((x - r, y - r * 0.8, x + r, y + r * 0.8), fill=fill)
        pixels = np.asarray(canvas)
        if self.spec.stain is not None:
            cores = self.tissue_mask(l0_x, l0_y, ds, size, size, above=_CORE)
            return _stained(pixels, mask, cores, self.spec.stain, self.spec.amounts)
        return pixels


# transmitted light and stain amounts of the stained synthetic slides
_STAIN_IO = 245.0
_STROMA_E, _NUCLEUS_H, _NUCLEUS_E, _CORE_H = 0.55, 1.1, 0.2, 0.8
_CORE = 0.9  # field above the tissue threshold where tissue is cellular (haematoxylin-rich)


def _stained(
    painted: npt.NDArray[np.uint8],
    mask: npt.NDArray[np.bool_],
    cores: npt.NDArray[np.bool_],
    stain: tuple[tuple[float, float, float], tuple[float, float, float]],
    amounts: tuple[float, float] = (1.0, 1.0),
) -> npt.NDArray[np.uint8]:
    """Repaint a tile by Beer-Lambert with known stain vectors: eosin over the tissue (its
    texture from the painted stroma's green), haematoxylin where nuclei were drawn and over
    the tissue's cellular cores (large areas of nearly pure haematoxylin, so low levels have
    them too)."""
    h, e = (np.asarray(v, np.float32) / np.linalg.norm(v) for v in stain)
    green = painted[..., 1].astype(np.float32)
    nucleus = mask & (green < 110)  # the nuclei's painted green is 38-78, stroma's ~160
    texture = np.clip((255.0 - green) / 95.0, 0.3, 1.7)
    c_e = np.where(mask, _STROMA_E * texture, 0.0)
    c_e = np.where(nucleus, _NUCLEUS_E, np.where(cores, 0.1 * c_e, c_e))
    c_h = np.where(cores, _CORE_H * texture, 0.0)
    c_h = np.where(nucleus, _NUCLEUS_H * np.clip(texture / 1.6, 0.6, 1.2), c_h)
    od = amounts[0] * c_h[..., None] * h + amounts[1] * c_e[..., None] * e
    rgb = np.clip(_STAIN_IO * np.exp(-od) + 0.5, 0, 255)
    out: npt.NDArray[np.uint8] = rgb.astype(np.uint8)
    return out


def _level_downsamples(spec: SlideSpec) -> list[int]:
    """1, 4, 16, 64 while the level is still at least one tile wide."""
    out = [1]
    for ds in (4, 16, 64):
        if min(spec.width, spec.height) // ds >= spec.tile_size // 2:
            out.append(ds)
    return out


def _jpeg_split(tile: npt.NDArray[np.uint8], quality: int) -> tuple[bytes, bytes]:
    """Encode a tile and split it into (tables stream, abbreviated tile stream)."""
    buf = io.BytesIO()
    Image.fromarray(tile).save(buf, "JPEG", quality=quality, subsampling="4:2:0")
    data = buf.getvalue()
    tables, body = bytearray(b"\xff\xd8"), bytearray(b"\xff\xd8")
    pos = 2
    while pos < len(data):
        marker = data[pos + 1]
        if marker == 0xDA:  # start of scan: the rest is entropy-coded data up to EOI
            body += data[pos:]
            break
        length = int.from_bytes(data[pos + 2 : pos + 4], "big")
        segment = data[pos : pos + 2 + length]
        if marker in (0xDB, 0xC4):  # quantisation and Huffman tables are shared
            tables += segment
        elif marker != 0xE0:  # drop JFIF APP0; keep SOF
            body += segment
        pos += 2 + length
    tables += b"\xff\xd9"
    return bytes(tables), bytes(body)


def _corrupt(stream: bytes) -> bytes:
    """Break a JPEG the way ``unreadable.svs`` is broken: SOS marker 0xFFDA -> 0xFFDB."""
    pos = stream.index(b"\xff\xda")
    return stream[:pos] + b"\xff\xdb" + stream[pos + 2 :]


def _tile_origins(width: int, height: int, tile: int) -> Iterator[tuple[int, int]]:
    for ty in range(math.ceil(height / tile)):
        for tx in range(math.ceil(width / tile)):
            yield tx * tile, ty * tile


def write_svs(
    path: str,
    spec: SlideSpec | None = None,
    corrupt_tiles: Iterable[tuple[int, int]] = (),
) -> str:
    """Write an Aperio SVS. ``corrupt_tiles`` are level-0 (column, row) storage tile indices."""
    spec = spec or SlideSpec()
    painter = _Painter(spec)
    broken = set(corrupt_tiles)
    t = spec.tile_size
    mag = round(10.0 / spec.mpp)
    with tifffile.TiffWriter(path, bigtiff=spec.width * spec.height > 2**31) as tif:
        for level, ds in enumerate(_level_downsamples(spec)):
            lw, lh = spec.width // ds, spec.height // ds
            tables = b""
            streams: list[bytes] = []
            for l_x, l_y in _tile_origins(lw, lh, t):
                tile = painter.paint(level, l_x * ds, l_y * ds, ds, t)
                tile_tables, body = _jpeg_split(tile, spec.quality)
                if tables and tile_tables != tables:
                    raise RuntimeError("JPEG tables differ between tiles; cannot share them")
                tables = tile_tables
                if level == 0 and (l_x // t, l_y // t) in broken:
                    body = _corrupt(body)
                streams.append(body)
            description = (
                f"Aperio Image Library v12.0.15 \r\n{spec.width}x{spec.height} ({t}x{t}) "
                f"JPEG/RGB Q={spec.quality}|AppMag = {mag}|MPP = {spec.mpp:.4f}|"
                f"Filename = synthetic-{spec.seed}"
            )
            if level > 0:
                description = f"Aperio Image Library v12.0.15 \r\n{lw}x{lh} -> {lw}x{lh}"
            tif.write(
                iter(streams),
                shape=(lh, lw, 3),
                dtype=np.uint8,
                tile=(t, t),
                compression="jpeg",
                photometric="ycbcr",
                subsampling=(2, 2),
                description=description,
                extratags=[(347, 7, len(tables), tables, True)],
                metadata=None,
                subfiletype=0,
            )
            if level == 0:  # real SVS files keep a stripped thumbnail right after level 0
                _write_thumbnail(tif, painter, spec)
    return path


def _write_thumbnail(tif: tifffile.TiffWriter, painter: _Painter, spec: SlideSpec) -> None:
    ds = max(spec.width, spec.height) / 768
    w, h = max(1, round(spec.width / ds)), max(1, round(spec.height / ds))
    mask = painter.tissue_mask(0, 0, ds, w, h)[..., None]
    tissue, glass = (_DARK_TISSUE, _DARK_BACKGROUND) if spec.dark_field else (_STROMA, _BACKGROUND)
    thumb = np.where(mask, tissue, glass).astype(np.uint8)
    tif.write(
        thumb,
        photometric="rgb",
        compression="jpeg",
        rowsperstrip=16,
        description=f"Aperio Image Library v12.0.15 \r\n{spec.width}x{spec.height} -> {w}x{h}",
        metadata=None,
    )


def write_tiff(
    path: str,
    spec: SlideSpec | None = None,
    compression: str = "jpeg",
    corrupt_tiles: Iterable[tuple[int, int]] = (),
) -> str:
    """Write a generic tiled TIFF pyramid (reduced pages), MPP in the resolution tags.

    ``corrupt_tiles`` (level-0 column, row) are overwritten with garbage bytes.
    """
    spec = spec or SlideSpec()
    painter = _Painter(spec)
    t = spec.tile_size
    res = 10_000.0 / spec.mpp  # pixels per centimetre
    broken = set(corrupt_tiles)
    with tifffile.TiffWriter(path, bigtiff=spec.width * spec.height > 2**31) as tif:
        for level, ds in enumerate(_level_downsamples(spec)):
            lw, lh = spec.width // ds, spec.height // ds
            tiles = (
                painter.paint(level, x * ds, y * ds, ds, t) for x, y in _tile_origins(lw, lh, t)
            )
            tif.write(
                tiles,
                shape=(lh, lw, 3),
                dtype=np.uint8,
                tile=(t, t),
                compression=compression,
                photometric="rgb",
                resolution=(res / ds, res / ds),
                resolutionunit="CENTIMETER",
                subfiletype=0 if level == 0 else 1,
                metadata=None,
            )
    if broken:
        _overwrite_tiles(path, broken)
    return path


def _overwrite_tiles(path: str, tiles: set[tuple[int, int]]) -> None:
    with tifffile.TiffFile(path) as tif:
        page = tif.pages.first
        across = math.ceil(page.imagewidth / page.tilewidth)
        spans = [
            (page.dataoffsets[row * across + col], page.databytecounts[row * across + col])
            for col, row in tiles
        ]
    with open(path, "r+b") as fh:
        for offset, count in spans:
            fh.seek(offset)
            fh.write(b"\x00\xff" * (count // 2))


def tissue_of(spec: SlideSpec) -> Callable[[float, float, float, int, int], npt.NDArray[np.bool_]]:
    """The slide's tissue mask as ``mask(l0_x, l0_y, downsample, w, h)`` (ground truth)."""
    painter = _Painter(replace(spec, artefacts=()))

    def mask(l0_x: float, l0_y: float, ds: float, w: int, h: int) -> npt.NDArray[np.bool_]:
        return painter.tissue_mask(round(l0_x), round(l0_y), ds, w, h)

    return mask


def with_qc_artefacts(spec: SlideSpec, scale: float = 1.0) -> SlideSpec:
    """``spec`` with the standard artefact set of `_artefacts.qc_layout` on its
    tissue (four pen inks, three blurs, two folds, two bubbles)."""
    layout = qc_layout(spec.width, spec.height, tissue_of(spec), spec.seed, scale)
    return replace(spec, artefacts=layout)
