"""The cache of decoded storage segments the tifffile backend's readers of a process share
(a segmented LRU bounded in bytes, with a part for segments decoded ahead of their read)."""

from __future__ import annotations

from collections import OrderedDict

from wsi_loader.slides._base import RGBArray, SegmentKey


class SegmentCache:
    """Cache of decoded storage segments, bounded in bytes, shared by a process's readers.

    Neighbouring windows that share storage tiles (256 px windows on 512 px tiles, overlapping
    grids, the context windows of neighbouring tiles) decode each tile once.

    A segmented LRU: a segment enters on probation, and one used again moves to the
    protected part (at most half the bytes), whose least recent segments fall back to
    probation. Why: a sampler that draws tiles at random over a big slide decodes a stream of
    segments used once, which in a plain LRU pushes out the few that are used over and over
    (the coarse-level segments under many tiles' context windows: 224 px at 2.0 um/px of a
    40x slide spans ~19 of its 0.5 um/px tiles). Only `get` is a use; ``key in cache`` only
    looks. A segment put with ``planned`` (decoded ahead by a thread for a window read next)
    waits apart until that read, its first `get`, which counts as the use it was decoded for;
    it is evicted only after every other segment: dropping work done for the next read would
    decode it again (a whole-slide scan decoded 1.55x its storage tiles that way).
    Eviction order: probation, protected, then the planned ones, each least recent first.
    """

    def __init__(self, max_bytes: int = 32 * 2**20) -> None:
        self.max_bytes = max_bytes
        self._planned: OrderedDict[SegmentKey, RGBArray] = OrderedDict()
        self._probation: OrderedDict[SegmentKey, RGBArray] = OrderedDict()
        self._protected: OrderedDict[SegmentKey, RGBArray] = OrderedDict()
        self._bytes = {"planned": 0, "probation": 0, "protected": 0}

    def _parts(self) -> list[tuple[str, OrderedDict[SegmentKey, RGBArray]]]:
        """The parts in eviction order."""
        return [
            ("probation", self._probation),
            ("protected", self._protected),
            ("planned", self._planned),
        ]

    def __len__(self) -> int:
        return len(self._protected) + len(self._probation) + len(self._planned)

    def __contains__(self, key: SegmentKey) -> bool:
        return key in self._protected or key in self._probation or key in self._planned

    def get(self, key: SegmentKey) -> RGBArray | None:
        """The segment (a use of it), None when absent."""
        pixels = self._protected.get(key)
        if pixels is not None:
            self._protected.move_to_end(key)
            return pixels
        pixels = self._planned.pop(key, None)
        if pixels is not None:  # the use it was decoded for: on probation from now
            self._bytes["planned"] -= pixels.nbytes
            self._probation[key] = pixels
            self._bytes["probation"] += pixels.nbytes
            return pixels
        pixels = self._probation.pop(key, None)
        if pixels is None:
            return None
        self._bytes["probation"] -= pixels.nbytes  # used again: protected
        self._protected[key] = pixels
        self._bytes["protected"] += pixels.nbytes
        while self._bytes["protected"] > self.max_bytes // 2:
            old, demoted = self._protected.popitem(last=False)
            self._bytes["protected"] -= demoted.nbytes
            self._probation[old] = demoted
            self._bytes["probation"] += demoted.nbytes
        return pixels

    def put(self, key: SegmentKey, pixels: RGBArray, planned: bool = False) -> None:
        """Keep a segment just decoded and used (``planned``: decoded for a use to come)."""
        if pixels.nbytes > self.max_bytes:
            return
        self.pop(key)
        part = "planned" if planned else "probation"
        (self._planned if planned else self._probation)[key] = pixels
        self._bytes[part] += pixels.nbytes
        while sum(self._bytes.values()) > self.max_bytes:
            name, segments = next((n, p) for n, p in self._parts() if p)
            _, evicted = segments.popitem(last=False)
            self._bytes[name] -= evicted.nbytes

    def pop(self, key: SegmentKey) -> RGBArray | None:
        for name, segments in self._parts():
            pixels = segments.pop(key, None)
            if pixels is not None:
                self._bytes[name] -= pixels.nbytes
                return pixels
        return None

    def clear(self) -> None:
        for name, segments in self._parts():
            segments.clear()
            self._bytes[name] = 0
