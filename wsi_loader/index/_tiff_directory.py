"""The raw bytes of a TIFF file's directory (`directory_bytes`): every IFD's entries and the
out-of-line values they point at (TileOffsets and TileByteCounts or StripOffsets and
StripByteCounts among them), following the IFD chain and SubIFDs, never a pixel. A slide's
content digest covers them (`_fingerprints.content_key`): a tile re-encoded in the middle of
a file changes its offset or byte count, wherever the arrays lie (an SVS's run to megabytes,
far beyond the first and last 64 KiB).
"""

from __future__ import annotations

import struct
from typing import BinaryIO

# bytes per value of each TIFF field type (TIFF 6, BigTIFF's LONG8, SLONG8, IFD8)
_TYPE_SIZES = {1: 1, 2: 1, 3: 2, 4: 4, 5: 8, 6: 1, 7: 1, 8: 2, 9: 4, 10: 8, 11: 4, 12: 8, 13: 4}
_TYPE_SIZES.update({16: 8, 17: 8, 18: 8})
_SUBIFDS = 330
_MAX_IFDS = 4096  # a cycle or a forged chain stops here (slides have tens)
_MAX_VALUE = 1 << 30  # one tag's value: more than any real offset array (a forged count)


def directory_bytes(path: str, size: int) -> bytes | None:
    """The directory of the TIFF (or BigTIFF) file at ``path`` (``size`` bytes), None when it
    is no TIFF. A damaged directory gives the bytes read up to the damage: still a function
    of the file's bytes, so the digest stays equal for equal files."""
    with open(path, "rb") as fh:
        header = fh.read(16)
        magic = header[:4]
        if magic in (b"II*\0", b"MM\0*"):
            big = False
        elif magic in (b"II+\0", b"MM\0+"):
            big = True
        else:
            return None
        order = "<" if magic[:2] == b"II" else ">"
        if len(header) < (16 if big else 8):
            return header
        first = struct.unpack(order + ("Q" if big else "I"), header[8:16] if big else header[4:8])
        return _walk(fh, size, order, big, first[0])


def _walk(fh: BinaryIO, size: int, order: str, big: bool, first: int) -> bytes:
    """Every IFD reachable from ``first`` (the chain and SubIFDs), its entries and the values
    stored outside them, in the order met."""
    count_fmt, entry_size, inline, offset_fmt = ("Q", 20, 8, "Q") if big else ("H", 12, 4, "I")
    count_size = struct.calcsize(count_fmt)
    offset_size = struct.calcsize(offset_fmt)
    parts: list[bytes] = []
    todo = [first]
    seen: set[int] = set()
    while todo and len(seen) < _MAX_IFDS:
        offset = todo.pop(0)
        if offset in seen or not 0 < offset < size:
            continue
        seen.add(offset)
        fh.seek(offset)
        raw = fh.read(count_size)
        if len(raw) < count_size:
            break
        (count,) = struct.unpack(order + count_fmt, raw)
        entries = fh.read(min(count * entry_size, size - offset))
        parts.append(raw + entries)
        for start in range(0, len(entries) - entry_size + 1, entry_size):
            entry = entries[start : start + entry_size]
            tag, kind = struct.unpack(order + "HH", entry[:4])
            (n,) = struct.unpack(order + offset_fmt, entry[4 : 4 + offset_size])
            value = entry[4 + offset_size :]
            nbytes = n * _TYPE_SIZES.get(kind, 1)
            if nbytes <= inline:
                value = value[:nbytes]
            else:
                (at,) = struct.unpack(order + offset_fmt, value)
                fh.seek(at)
                value = fh.read(max(0, min(nbytes, _MAX_VALUE, size - at)))
                parts.append(value)
            if tag == _SUBIFDS and kind in (4, 13, 16, 18):
                width = 8 if kind in (16, 18) else 4
                fmt = order + ("Q" if width == 8 else "I") * (len(value) // width)
                todo.extend(struct.unpack(fmt, value[: len(value) // width * width]))
        fh.seek(offset + count_size + count * entry_size)
        raw = fh.read(offset_size)
        if len(raw) < offset_size:
            break
        todo.append(struct.unpack(order + offset_fmt, raw)[0])
    return b"".join(parts)
