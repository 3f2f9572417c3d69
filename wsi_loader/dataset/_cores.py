"""How many threads a reading process decodes with: the cores it may run on (its affinity
mask), shared out among the reading processes (`threads_per_process`), fewer while other
processes keep some of them busy (`FreeCores`)."""

from __future__ import annotations

import os
import time


def usable_cores() -> int:
    """The cores this process may run on (its affinity mask, e.g. a container's CPU set)."""
    return len(_affinity())


def threads_per_process(processes: int) -> int:
    """Threads for each of ``processes`` reading processes: the usable cores shared out."""
    return max(1, usable_cores() // max(1, processes))


def _idle_seconds(cpus: set[int]) -> float | None:
    """Idle + iowait time of the given CPUs since boot, from /proc/stat (None elsewhere)."""
    try:
        with open("/proc/stat", encoding="ascii") as fh:
            lines = fh.read().splitlines()
    except OSError:
        return None
    ticks = os.sysconf("SC_CLK_TCK")
    idle = 0
    for line in lines:
        name, _, rest = line.partition(" ")
        if name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in cpus:
            fields = rest.split()
            idle += int(fields[3]) + int(fields[4])
    return idle / ticks


class FreeCores:
    """How many cores this process could use now: its usable cores minus what other processes
    keep busy, measured over the last interval (its own CPU time plus the idle time of its
    cores, per second of wall time).

    Why: one decode thread per usable core is 1.3-1.7x one thread on an idle 2-core machine,
    but 0.8-0.9x when another process keeps a core busy (threads wait for a core and thrash
    caches). Measuring the load picks the right count in both states. Linux only (elsewhere
    the cores are taken as free). Sampled at most every ``interval`` seconds; reset after a
    fork (the counters are per process).
    """

    def __init__(self, interval: float = 0.1) -> None:
        self.interval = interval
        self._pid = -1
        self._last: tuple[float, float, float] | None = None
        self._free: float | None = None

    def __getstate__(self) -> dict[str, object]:
        return {"interval": self.interval, "_pid": -1, "_last": None, "_free": None}

    def __call__(self, limit: int) -> int:
        """At most ``limit``, at least 1."""
        if limit <= 1:
            return 1
        if self._pid != os.getpid():
            self._pid, self._last, self._free = os.getpid(), None, None
        now = time.monotonic()
        # /proc/stat is read only when a new sample is due, not at every batch
        if self._last is None or now - self._last[0] >= self.interval:
            idle = _idle_seconds(_affinity())
            if idle is None:
                return limit
            sample = (now, time.process_time(), idle)
            if self._last is not None:
                wall = sample[0] - self._last[0]
                own = (sample[1] - self._last[1]) / wall
                spare = (sample[2] - self._last[2]) / wall
                self._free = own + spare
            self._last = sample
        if self._free is None:
            return limit
        return max(1, min(limit, int(self._free + 0.5)))


def _affinity() -> set[int]:
    try:
        return set(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return set(range(os.cpu_count() or 1))
