"""Rewrites of a TIFF slide that keep its size, its first and last 64 KiB (and, restored by
the caller, its mtime): what a content digest of size, head and tail alone cannot tell."""

from __future__ import annotations

import os
from pathlib import Path

import tifffile

EDGE = 65536  # the head and tail a size-and-ends digest reads


def _middle(size: int, *spans: tuple[int, int]) -> bool:
    return all(start >= EDGE and start + length <= size - EDGE for start, length in spans)


def _middle_page(path: Path) -> tuple[list[int], tuple[int, ...], tuple[int, ...], int, int, int]:
    """A tiled page whose TileOffsets and TileByteCounts arrays lie beyond the first and last
    64 KiB: (its tiles that lie there too, offsets, byte counts, the offsets' and counts'
    file positions, bytes per entry)."""
    size = path.stat().st_size
    with tifffile.TiffFile(path) as tif:
        for page in tif.pages:
            tags = page.tags  # type: ignore[union-attr]
            if "TileOffsets" not in tags:
                continue
            offsets_tag, counts_tag = tags["TileOffsets"], tags["TileByteCounts"]
            width = 8 if offsets_tag.dtype in (16, 17) else 4
            offsets = tuple(int(v) for v in offsets_tag.value)
            counts = tuple(int(v) for v in counts_tag.value)
            spans = [(offsets_tag.valueoffset, width * len(offsets))]
            spans += [(counts_tag.valueoffset, width * len(counts))]
            inner = [
                i for i, span in enumerate(zip(offsets, counts, strict=True)) if _middle(size, span)
            ]
            if len(inner) > 2 and _middle(size, *spans):
                return (
                    inner,
                    offsets,
                    counts,
                    offsets_tag.valueoffset,
                    counts_tag.valueoffset,
                    width,
                )
    raise AssertionError(f"{path} has no tiled page wholly beyond its first and last 64 KiB")


def reencode_middle_tile(path: Path) -> None:
    """Put another tile's (shorter) JPEG stream in place of a tile of a page in the middle of
    the file, and its byte count in the TileByteCounts array: the file keeps its size, head
    and tail; that tile now shows other pixels."""
    inner, offsets, counts, _, counts_at, width = _middle_page(path)
    longest = max(inner, key=counts.__getitem__)
    shortest = min(inner, key=counts.__getitem__)
    assert counts[shortest] < counts[longest]
    with open(path, "r+b") as fh:
        fh.seek(offsets[shortest])
        stream = fh.read(counts[shortest])
        fh.seek(offsets[longest])
        fh.write(stream)
        fh.seek(counts_at + width * longest)
        fh.write(counts[shortest].to_bytes(width, "little"))


def swap_middle_offsets(path: Path) -> None:
    """Swap two tiles' entries in the TileOffsets and TileByteCounts arrays of a page in the
    middle of the file (no tile's bytes change): the two tiles change places."""
    inner, offsets, counts, offsets_at, counts_at, width = _middle_page(path)
    a, b = inner[0], inner[-1]
    with open(path, "r+b") as fh:
        for at, values in ((offsets_at, offsets), (counts_at, counts)):
            fh.seek(at + width * a)
            fh.write(values[b].to_bytes(width, "little"))
            fh.seek(at + width * b)
            fh.write(values[a].to_bytes(width, "little"))


def rewrite_keeping_mtime(path: Path, rewrite: str) -> None:
    """``rewrite`` ('reencode' or 'swap') the slide at ``path``, its size and mtime kept."""
    st = path.stat()
    {"reencode": reencode_middle_tile, "swap": swap_middle_offsets}[rewrite](path)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert path.stat().st_size == st.st_size
