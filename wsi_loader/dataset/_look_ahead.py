"""Tell each reading process which batches it reads next, so their bytes travel while it decodes.

A DataLoader hands batch ``k`` of an epoch to worker ``k % workers`` (in order; torch resets the
round robin at every epoch), so the batches worker ``w`` reads after batch ``k`` are
``k + workers``, ``k + 2 * workers``, ... The main process knows them: it runs the sampler.
`LookAhead` wraps the batch sampler and sends each batch with the rows of the next ``depth``
batches of the same worker (`BatchPlan`); the worker requests their bytes (remote range
requests, kernel read-ahead) before it decodes its own batch (`TileReader.read(ahead=...)`).
If a batch lands elsewhere (a worker died, a custom loader), the only cost is bytes fetched in
vain, bounded by the reading process's prefetch budget.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Iterator, Sequence, Sized
from typing import NamedTuple


class BatchPlan(NamedTuple):
    """The rows of one batch and of the batches its reader reads after it, and the sampler's
    epoch (random per-tile transforms draw from it: the same in every worker)."""

    rows: list[int]
    ahead: list[int]
    epoch: int = 0


class LookAhead:
    """Batches of ``batches`` as `BatchPlan` objects, for ``streams`` readers (workers, or 1)
    each told its next ``depth`` batches."""

    def __init__(
        self,
        batches: Iterable[Sequence[int]],
        streams: int,
        depth: int,
        epoch_of: object = None,
    ) -> None:
        if streams < 1 or depth < 0:
            raise ValueError(f"streams must be >= 1 and depth >= 0, got {streams}, {depth}")
        self.batches = batches
        self.streams = streams
        self.depth = depth
        self.epoch_of = epoch_of  # the sampler whose ``epoch`` the batches carry

    def __len__(self) -> int:
        if not isinstance(self.batches, Sized):
            raise TypeError("the batch sampler has no length")
        return len(self.batches)

    def __iter__(self) -> Iterator[BatchPlan]:
        epoch = int(getattr(self.epoch_of, "epoch", 0) or 0)
        batches = iter(self.batches)
        window: deque[list[int]] = deque()
        wanted = self.streams * self.depth  # batches to know beyond the current one
        for batch in batches:
            window.append(list(batch))
            if len(window) > wanted:
                break
        while window:
            rows = window.popleft()
            # the same reader's next batches: every streams-th one from here
            same = [window[j] for j in range(self.streams - 1, len(window), self.streams)]
            yield BatchPlan(rows, [row for batch in same[: self.depth] for row in batch], epoch)
            nxt = next(batches, None)
            if nxt is not None:
                window.append(list(nxt))
