"""The local file the tifffile backend parses: opened as a slide (our own descriptor, named
for tifffile), the identity that says it is still the file parsed, and what tifffile logs
while a thread parses it, kept instead of printed."""

from __future__ import annotations

import errno
import io
import logging
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager

from wsi_loader.errors import SlideNotFoundError, SlideOpenError
from wsi_loader.slides._base import NOT_REGULAR, open_regular


class _ParseMessages(logging.Filter):
    """What tifffile logs while a thread of ours parses a file, kept instead of printed.

    Why: tifffile logs its complaints about a malformed file (``invalid page offset`` for a
    truncated one) at ERROR on every parse, and a slide that fails is parsed again at every
    retry and batch: 336 lines over 5 epochs for one truncated slide, next to our own one
    WARNING for it. What it says goes into our error when the parse fails, and to DEBUG when
    it does not. Other threads' tifffile messages pass (the list is per thread)."""

    def __init__(self) -> None:
        super().__init__()
        self._local = threading.local()

    def filter(self, record: logging.LogRecord) -> bool:
        kept: list[str] | None = getattr(self._local, "kept", None)
        if kept is None:
            return True
        kept.append(record.getMessage())
        return False

    @contextmanager
    def kept(self) -> Iterator[list[str]]:
        """The messages tifffile logs in this thread inside the block."""
        outer = getattr(self._local, "kept", None)
        kept: list[str] = []
        self._local.kept = kept
        try:
            yield kept
        finally:
            self._local.kept = outer


parse_messages = _ParseMessages()
logging.getLogger("tifffile").addFilter(parse_messages)


def open_local(path: str) -> int:
    """`open_regular`, its errors as a slide's (the file is gone, or is not a file)."""
    try:
        return open_regular(path)
    except FileNotFoundError:
        raise SlideNotFoundError("slide file does not exist", path=path) from None
    except OSError as exc:
        reason = exc.strerror if exc.errno != errno.EINVAL else NOT_REGULAR
        raise SlideOpenError(f"cannot open the slide: {reason}", path=path) from exc


def named_file(fd: int, path: str) -> io.BufferedReader:
    """A buffered file object over ``fd`` (left open when it is closed) named ``path``, as
    tifffile names the files it opens itself (their folder is where it finds an OME-TIFF's
    companion files)."""
    raw = io.FileIO(fd, "rb", closefd=False)
    raw.name = path
    return io.BufferedReader(raw)


def identity(stat: os.stat_result) -> tuple[int, int, int, int]:
    """What says a file is still the one parsed: device, inode, size, modification time."""
    return (stat.st_dev, stat.st_ino, stat.st_size, stat.st_mtime_ns)
