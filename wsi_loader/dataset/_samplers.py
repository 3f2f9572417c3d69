"""Samplers over tile rows with memory independent of the number of tiles (permutations from
`wsi_loader.permutation`).

* `DistributedTileSampler`: torch's DistributedSampler contract (disjoint shards, full coverage,
  padding smaller than the world size, ``set_epoch``), but the shuffle is a keyed pseudo-random
  permutation (a Feistel network with cycle-walking) evaluated on demand, so a 10^9-row index
  needs no 10^9-element permutation. ``slide_window=k`` shuffles slides, then tiles within
  windows of k consecutive slides, so a worker's handle pool stays warm.
* `BalancedTileSampler`: draws label (or slide) groups uniformly, then a tile uniformly within
  the group: from per-slide counts only for slide labels and slides; for tile labels (an index
  labelled from annotations) from the rows ordered by label (4 bytes per tile).

Both have ``state_dict()`` / ``load_state_dict()`` to resume mid-epoch.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sized
from typing import Any, Literal

import numpy as np
import numpy.typing as npt
import torch.distributed as dist
from torch.utils.data import Sampler

from wsi_loader.index._table import SlideIndex
from wsi_loader.permutation import RandomPermutation, key_rng, seed_sequence

__all__ = [
    "BalancedTileSampler",
    "DistributedTileSampler",
    "RandomPermutation",
    "key_rng",
    "seed_sequence",
]

IntArray = npt.NDArray[np.int64]
_CHUNK = 65536


def _world(num_replicas: int | None, rank: int | None) -> tuple[int, int]:
    initialised = dist.is_available() and dist.is_initialized()
    if num_replicas is None:
        num_replicas = dist.get_world_size() if initialised else 1
    if rank is None:
        rank = dist.get_rank() if initialised else 0
    if not isinstance(num_replicas, int) or num_replicas < 1:
        raise ValueError(f"num_replicas must be a positive int, got {num_replicas!r}")
    if not isinstance(rank, int) or not 0 <= rank < num_replicas:
        raise ValueError(f"rank must be in [0, {num_replicas - 1}], got {rank!r}")
    return num_replicas, rank


class _Resumable:
    """Epoch and mid-epoch position bookkeeping shared by the samplers."""

    seed: int
    num_replicas: int
    rank: int
    num_samples: int
    epoch: int = 0
    _start: int = 0
    _yielded: int = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    def state_dict(self, consumed: int | None = None) -> dict[str, Any]:
        """Where this epoch stands. DataLoader prefetches, so pass ``consumed`` (samples your
        loop has actually used on this rank) for an exact resume; otherwise the count of
        samples this sampler has yielded is saved."""
        return {
            "epoch": self.epoch,
            "seed": self.seed,
            "position": self._yielded if consumed is None else int(consumed),
            "num_replicas": self.num_replicas,
            "rank": self.rank,
            "length": self.num_samples,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """The next ``__iter__`` continues epoch ``state['epoch']`` at ``state['position']``.

        A state saved by a sampler with another seed, world size, rank or length (a different
        index or split) is refused: resuming it would repeat or skip samples."""
        mine = {
            "seed": self.seed,
            "num_replicas": self.num_replicas,
            "rank": self.rank,
            "length": self.num_samples,
        }
        for key, value in mine.items():
            if key in state and int(state[key]) != value:
                raise ValueError(
                    f"state was saved with {key} {state[key]}, this sampler has {value}; "
                    "resume with the same seed, world size, rank and index"
                )
        self.epoch = int(state["epoch"])
        self._start = int(state["position"])


class DistributedTileSampler(_Resumable, Sampler[int]):
    """Shard (and shuffle) tile rows across ranks; the contract of torch's DistributedSampler."""

    def __init__(
        self,
        dataset: Sized,
        num_replicas: int | None = None,
        rank: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        slide_window: int | None = None,
    ) -> None:
        self.num_replicas, self.rank = _world(num_replicas, rank)
        if not isinstance(seed, int):
            raise ValueError(f"seed must be an int, got {seed!r}")
        if slide_window is not None and (not isinstance(slide_window, int) or slide_window < 1):
            raise ValueError(f"slide_window must be a positive int or None, got {slide_window!r}")
        self.n = len(dataset)
        self.shuffle, self.seed, self.drop_last = shuffle, seed, drop_last
        self.slide_window = slide_window
        self._starts: IntArray | None = None
        if slide_window is not None:
            index = getattr(dataset, "index", None)
            if not isinstance(index, SlideIndex):
                raise ValueError("slide_window needs a dataset with a SlideIndex (.index)")
            self._starts = index.slide_starts()
        if drop_last:
            self.num_samples = self.n // self.num_replicas
        else:
            self.num_samples = math.ceil(self.n / self.num_replicas)
        self.total_size = self.num_samples * self.num_replicas

    def __len__(self) -> int:
        return self.num_samples

    def __iter__(self) -> Iterator[int]:
        start, self._start, self._yielded = self._start, 0, self._start
        if self.n == 0:
            return
        sequence = self._windowed if self._starts is not None else self._plain
        for first in range(start, self.num_samples, _CHUNK):
            steps = np.arange(first, min(first + _CHUNK, self.num_samples), dtype=np.int64)
            positions = (self.rank + steps * self.num_replicas) % self.n  # wrap = padding
            for row in sequence(positions).tolist():
                self._yielded += 1
                yield row

    def _plain(self, positions: IntArray) -> IntArray:
        if not self.shuffle:
            return positions
        return RandomPermutation(self.n, self.seed, self.epoch)(positions)

    def _windowed(self, positions: IntArray) -> IntArray:
        assert self._starts is not None and self.slide_window is not None
        counts = np.diff(self._starts)
        slides = len(counts)
        order = (
            key_rng(self.seed, self.epoch).permutation(slides)
            if self.shuffle
            else np.arange(slides)
        )
        cum = np.concatenate([[0], np.cumsum(counts[order])]).astype(np.int64)
        window_of = (np.searchsorted(cum, positions, side="right") - 1) // self.slide_window
        out = np.empty_like(positions)
        for window in np.unique(window_of).tolist():
            sel = window_of == window
            lo = cum[window * self.slide_window]
            hi = cum[min((window + 1) * self.slide_window, slides)]
            offsets = positions[sel] - lo
            if self.shuffle:
                offsets = RandomPermutation(int(hi - lo), self.seed, self.epoch, window + 1)(
                    offsets
                )
            pos = lo + offsets
            j = np.searchsorted(cum, pos, side="right") - 1
            out[sel] = self._starts[order[j]] + (pos - cum[j])
        return out


class BalancedTileSampler(_Resumable, Sampler[int]):
    """Draw ``num_samples`` rows per epoch (split over ranks) balanced by label or by slide.

    ``by="label"``: every label (unlabelled tiles form one more group) is drawn equally often,
    tiles uniformly within it. The labels are the tiles' labels: their slide's, or their
    annotated class for an index built with ``label_from="annotations"`` (then this sampler
    keeps the rows ordered by label, 4 bytes per tile, 8 past 2^31 tiles). ``by="slide"``:
    every slide with tiles equally often. Draws are with replacement, deterministic for
    (seed, epoch, rank).
    """

    def __init__(
        self,
        dataset: Sized,
        by: Literal["label", "slide"] = "label",
        num_samples: int | None = None,
        seed: int = 0,
        num_replicas: int | None = None,
        rank: int | None = None,
    ) -> None:
        if by not in ("label", "slide"):
            raise ValueError(f"by must be 'label' or 'slide', got {by!r}")
        index = getattr(dataset, "index", None)
        if not isinstance(index, SlideIndex):
            raise ValueError("BalancedTileSampler needs a dataset with a SlideIndex (.index)")
        self.num_replicas, self.rank = _world(num_replicas, rank)
        total = num_samples if num_samples is not None else len(dataset)
        if not isinstance(total, int) or total < 0:
            raise ValueError(f"num_samples must be a non-negative int, got {num_samples!r}")
        self.by, self.seed = by, seed
        self.num_samples = math.ceil(total / self.num_replicas)
        self.starts = index.slide_starts()
        counts = np.diff(self.starts)
        self.counts = counts
        has_tiles = np.flatnonzero(counts > 0)
        if not len(has_tiles):
            raise ValueError("the index has no tiles to sample")
        # tile labels: the rows of each label, in a run of `_by_label`
        self._by_label: IntArray | None = None
        self._label_runs: tuple[IntArray, IntArray] = (np.zeros(0, np.int64),) * 2
        self.groups: list[IntArray] = []  # slides per group (slide labels, slides)
        if by == "label" and index.labels_from_annotations:
            labels = index.tile_labels()
            small = np.int32 if len(labels) < 2**31 else np.int64
            self._by_label = np.argsort(labels, kind="stable").astype(small)
            _, first, sizes = np.unique(
                labels[self._by_label], return_index=True, return_counts=True
            )
            self._label_runs = (first.astype(np.int64), sizes.astype(np.int64))
            self.group_count = len(first)
            return
        groups = index.slide_labels()[has_tiles] if by == "label" else has_tiles
        self.groups = [has_tiles[groups == g] for g in np.unique(groups)]
        self.group_count = len(self.groups)

    def __len__(self) -> int:
        return self.num_samples

    def _chunk(self, number: int, size: int) -> IntArray:
        """Rows of one chunk of draws: its own random stream, so any chunk can be regenerated."""
        rng = key_rng(self.seed, self.epoch, self.rank, number)
        group = rng.integers(self.group_count, size=size)
        u = rng.random(size)
        if self._by_label is not None:  # a tile uniformly among the rows of its label
            first, sizes = self._label_runs
            picked = first[group] + (u * sizes[group]).astype(np.int64)
            return self._by_label[picked].astype(np.int64)
        rows = np.empty(size, dtype=np.int64)
        for g, slides in enumerate(self.groups):
            sel = group == g
            weights = self.counts[slides].astype(np.float64)
            slide = slides[rng.choice(len(slides), size=int(sel.sum()), p=weights / weights.sum())]
            rows[sel] = self.starts[slide] + (u[sel] * self.counts[slide]).astype(np.int64)
        return rows

    def __iter__(self) -> Iterator[int]:
        start, self._start, self._yielded = self._start, 0, self._start
        for number in range(start // _CHUNK, math.ceil(self.num_samples / _CHUNK)):
            first = number * _CHUNK
            rows = self._chunk(number, min(_CHUNK, self.num_samples - first))
            for row in rows[max(start - first, 0) :].tolist():
                self._yielded += 1
                yield row
