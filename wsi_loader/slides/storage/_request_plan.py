"""Which range requests to make: merging close ranges by what a request costs here, and when a
slow request is asked again or given up.

`CostModel` learns, from the last `WINDOW` answered requests of a process to one store, the
rule ``seconds(n bytes) = latency + n / bandwidth`` (least squares; the bandwidth stays at its
prior until the sizes seen differ enough to measure it). From it:

* **merge gap** (`CostModel.merge_gap`): two ranges of one object are fetched by one request
  when the bytes between them take less time to transfer than a request's fixed cost, i.e.
  when ``gap <= latency * bandwidth`` (the bandwidth-delay product), kept between `MIN_GAP` and
  `MAX_GAP`, and no request grows beyond `MAX_REQUEST`. On a 20 ms link at 100 MB/s that is
  2 MB (capped at 1 MiB); on a 1 ms link at 1 GB/s, 1 MB; ranges farther apart go as separate,
  concurrent requests.
* **hedge** (`CostModel.hedge_after`): a request still unanswered after `HEDGE_FACTOR` times
  the 95th percentile of "seconds taken / seconds expected" of recent requests (at least
  `MIN_HEDGE_S`) is sent a second time; the first answer wins. Large storage clients do this
  for tail latency (a stalled connection, an overloaded server node).
* **deadline** (`CostModel.deadline`): `DEADLINE_FACTOR` times the hedge delay (at least
  `MIN_DEADLINE_S`): a request with no answer by then is given up and retried, instead of
  waiting out a client's two-minute timeout.

Until `WARM` requests were answered, the model uses its priors (`PRIOR_LATENCY_S`,
`PRIOR_BANDWIDTH`) and the cautious `COLD_HEDGE_S` / `COLD_DEADLINE_S` (the first requests also
pay for connections and TLS handshakes).
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Iterable

import numpy as np

Range = tuple[int, int]  # (offset, size)

MAX_REQUEST = 8 * 2**20  # no request larger than this (requests run concurrently)
MIN_GAP = 16 * 1024
MAX_GAP = 2**20
WINDOW = 256
WARM = 16
PRIOR_LATENCY_S = 0.02
PRIOR_BANDWIDTH = 100e6  # bytes/s
HEDGE_FACTOR = 3.0
MIN_HEDGE_S = 0.05
DEADLINE_FACTOR = 8.0
MIN_DEADLINE_S = 2.0
COLD_HEDGE_S = 2.0
COLD_DEADLINE_S = 30.0


class CostModel:
    """What a request to one store costs, learnt as the run goes (see the module doc).
    Thread-safe; cheap to ask (the fit is redone every 64 answers)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._seen: deque[tuple[int, float]] = deque(maxlen=WINDOW)  # (bytes, seconds)
        self.latency = PRIOR_LATENCY_S
        self.bandwidth = PRIOR_BANDWIDTH
        self._slow_ratio = 1.0  # 95th percentile of taken / expected
        self._since_fit = 0

    def observe(self, size: int, seconds: float) -> None:
        """A request of ``size`` bytes answered in ``seconds`` (not hedged, not retried)."""
        with self._lock:
            self._seen.append((size, seconds))
            self._since_fit += 1
            if self._since_fit >= 64 or len(self._seen) == WARM:
                self._fit()

    def _fit(self) -> None:
        self._since_fit = 0
        sizes = np.array([s for s, _ in self._seen], dtype=np.float64)
        times = np.array([t for _, t in self._seen], dtype=np.float64)
        slope = 1.0 / self.bandwidth
        spread = sizes - sizes.mean()
        if spread.std() > 0.25 * max(sizes.mean(), 1.0):  # sizes differ enough to tell
            fitted = float(spread @ (times - times.mean()) / (spread @ spread))  # least squares
            if fitted > 0:
                slope = float(np.clip(fitted, 1 / 50e9, 1 / 1e6))
        self.bandwidth = 1.0 / slope
        self.latency = max(float(np.median(times - sizes * slope)), 1e-5)
        expected = self.latency + sizes * slope
        self._slow_ratio = max(float(np.percentile(times / expected, 95)), 1.0)

    @property
    def warm(self) -> bool:
        return len(self._seen) >= WARM

    def expected(self, size: int) -> float:
        return self.latency + size / self.bandwidth

    def merge_gap(self) -> int:
        return int(np.clip(self.latency * self.bandwidth, MIN_GAP, MAX_GAP))

    def hedge_after(self, size: int) -> float:
        if not self.warm:
            return COLD_HEDGE_S
        return max(MIN_HEDGE_S, HEDGE_FACTOR * self._slow_ratio * self.expected(size))

    def deadline(self, size: int) -> float:
        if not self.warm:
            return COLD_DEADLINE_S
        return max(MIN_DEADLINE_S, DEADLINE_FACTOR * self.hedge_after(size))


def coalesce_groups(
    ranges: Iterable[Range], gap: int, max_request: int = MAX_REQUEST
) -> list[tuple[Range, list[Range]]]:
    """Requests for ``ranges``: sorted ranges closer than ``gap`` bytes (or touching, or
    overlapping, or one inside another) merged into requests of at most ``max_request``
    bytes, each with the ranges it serves."""
    groups: list[tuple[list[int], list[Range]]] = []
    for offset, size in sorted(set(ranges)):
        if groups:
            last, members = groups[-1]
            end = max(last[0] + last[1], offset + size)
            if offset - (last[0] + last[1]) <= gap and end - last[0] <= max_request:
                last[1] = end - last[0]
                members.append((offset, size))
                continue
        groups.append(([offset, size], [(offset, size)]))
    return [((o, s), members) for (o, s), members in groups]
