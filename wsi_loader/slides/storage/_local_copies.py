"""Local copies of remote slides that only OpenSlide reads (NDPI, SCN, BIF, Philips TIFF...).

OpenSlide reads local files only, so such a slide is downloaded whole into a cache folder, then
read locally. The folder is shared by every process of the machine (DataLoader workers, other
jobs): a download holds an exclusive ``flock`` on the copy's lock file, so a second process
waits for it instead of fetching the object again; the bytes go to a temporary name and are
renamed into place only when complete (a killed download leaves no half slide). The folder is
bounded in bytes, least recently used copies first out (a copy in use by an open handle stays
readable after its name is removed: POSIX keeps the open file). Room is reserved under one
folder-wide lock before a download (a ``.reserved-*`` file holding its size, locked while the
download runs and counted by every process); a download waits until its room can be made, so
concurrent downloads cannot overfill the folder. A copy
leaves with its lock file, removed only while held (a waiter that finds its lock file replaced
opens the new one). Copies are written with the process's umask, like any file, so a folder
shared by a group is readable by the group. A copy is named by a digest of the URL and of the
object's version (ETag), so a rewritten object is fetched again.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import re
import tempfile
import time
from collections.abc import Iterator
from pathlib import PurePosixPath

from wsi_loader.errors import SlideOpenError, TransientReadError, WsiLoaderError
from wsi_loader.files import locked
from wsi_loader.slides.storage._sources import download, remote_stat, url_digest

log = logging.getLogger(__name__)

DEFAULT_FOLDER = "~/.cache/wsi_loader/slides"
DEFAULT_MAX_BYTES = 100 * 2**30
# formats made of several files: one object cannot be opened on its own
MULTI_FILE = frozenset({".mrxs", ".vms", ".vmu", ".dcm", ".dicom"})


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


class LocalCopies:
    """A byte-bounded cache folder of whole-slide copies; picklable (options only)."""

    def __init__(self, folder: str = DEFAULT_FOLDER, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        if max_bytes < 1:
            raise ValueError(f"max_bytes must be >= 1, got {max_bytes}")
        self.folder = os.path.abspath(os.path.expanduser(folder))
        self.max_bytes = max_bytes
        self.downloads = 0  # objects this instance fetched (for tests and stats)

    def __getstate__(self) -> dict[str, object]:
        return {"folder": self.folder, "max_bytes": self.max_bytes, "downloads": 0}

    def local(self, url: str) -> str:
        """The path of a complete local copy of ``url``, downloading it when needed."""
        suffix = PurePosixPath(url.split("?", maxsplit=1)[0]).suffix.lower()
        if suffix in MULTI_FILE:
            raise SlideOpenError(
                f"{suffix} slides are several files and cannot be read from a URL one object at "
                "a time; mount the bucket (e.g. s3fs-fuse, gcsfuse) or copy the folder",
                path=url,
            )
        stat = remote_stat(url)
        if stat.size > self.max_bytes:
            raise SlideOpenError(
                f"the slide ({stat.size} bytes) is larger than the local copy cache "
                f"({self.max_bytes} bytes): raise remote_cache_bytes",
                path=url,
            )
        safe_suffix = suffix if re.fullmatch(r"\.[a-z0-9]{1,10}", suffix) else ""
        name = f"{url_digest(url)}-{url_digest(stat.version)}{safe_suffix}"
        path = os.path.join(self.folder, name)
        try:
            os.makedirs(self.folder, exist_ok=True)
            with locked(path + ".lock"):
                try:
                    if os.path.getsize(path) == stat.size:
                        os.utime(path)  # most recently used
                        return path
                except FileNotFoundError:
                    pass
                reservation = os.path.join(self.folder, f".reserved-{os.path.basename(path)}")
                held = self._reserve(reservation, stat.size, keep=path)
                try:
                    self._download(url, path, stat.size)
                finally:
                    with self._folder_locked():
                        with contextlib.suppress(FileNotFoundError):
                            os.unlink(reservation)
                        os.close(held)
                        self._evict(room=0, keep=path)
        except WsiLoaderError:
            raise  # the store's own faults (missing object, unreachable), said as they are
        except OSError as exc:  # the folder's: not one, not writable, full, over quota
            raise TransientReadError(
                f"cannot keep a local copy of the slide ({stat.size} bytes) in {self.folder}: "
                f"{exc.strerror or exc}; remote_cache_dir must be a writable folder with room "
                "for it (OpenSlide reads local files only)",
                path=url,
            ) from exc
        return path

    def _download(self, url: str, path: str, size: int) -> None:
        fd, part = tempfile.mkstemp(dir=self.folder, prefix=".part-", suffix=".tmp")
        os.close(fd)
        try:
            download(url, part)
            got = os.path.getsize(part)
            if got != size:
                raise SlideOpenError(
                    f"the download is {got} bytes where the object has {size}", path=url
                )
            os.chmod(part, 0o666 & ~_umask())  # mkstemp's 0600 would shut out a shared folder
            os.replace(part, path)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(part)
            raise
        self.downloads += 1
        log.info("copied %s to %s (%d bytes)", url, path, size)

    def _reserve(self, reservation: str, size: int, keep: str) -> int:
        """Reserve ``size`` bytes for a download, waiting until they fit: beside the copies
        and the other downloads' reservations, once least recently used copies not in use
        are evicted. Starting without room would end over the limit whenever the copies to
        evict are in use (their locks held) when the download ends. The reservation file is
        held under ``flock`` for the download (returned: the descriptor), so one left by a
        killed process is told by its free lock."""
        pause, said = 0.01, False
        while True:
            with self._folder_locked():
                if self._evict(room=size, keep=keep):
                    fd = os.open(
                        reservation, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644
                    )
                    try:
                        with contextlib.suppress(OSError):  # a file system without locks
                            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                        os.write(fd, str(size).encode("ascii"))
                    except BaseException:
                        os.close(fd)
                        raise
                    return fd
            if not said:
                log.info(
                    "waiting for room in %s: %d bytes are held by downloads or copies in use",
                    self.folder,
                    size,
                )
                said = True
            time.sleep(pause)
            pause = min(pause * 2, 0.5)

    @contextlib.contextmanager
    def _folder_locked(self) -> Iterator[None]:
        """The lock under which the folder's bytes are counted, reserved and evicted."""
        with locked(os.path.join(self.folder, ".evict.lock")):
            yield

    def _usage(self) -> tuple[list[tuple[int, int, str]], int]:
        """The copies, as (mtime_ns, size, path), and the bytes reserved by downloads running
        now. A reservation whose download was killed (its lock free) is dropped."""
        copies, reserved = [], 0
        for entry in os.scandir(self.folder):
            with contextlib.suppress(FileNotFoundError, ValueError):
                if entry.name.startswith(".reserved-"):
                    if _abandoned(entry.path):
                        os.unlink(entry.path)
                        continue
                    with open(entry.path) as fh:
                        reserved += int(fh.read() or 0)
                    continue
                if entry.name.startswith(".") or entry.name.endswith(".lock"):
                    continue
                st = entry.stat(follow_symlinks=False)
                copies.append((st.st_mtime_ns, st.st_size, entry.path))
        return copies, reserved

    def _evict(self, room: int, keep: str) -> bool:
        """Remove least recently used copies until ``room`` more bytes fit beside the copies
        and the reservations (under `_folder_locked`); returns whether they fit. The copy
        ``keep`` stays: it is the one being fetched or just fetched."""
        copies, reserved = self._usage()
        used = sum(size for _, size, _ in copies) + reserved
        for _, size, path in sorted(copies):
            if used + room <= self.max_bytes:
                break
            if path == keep:
                continue
            if _remove_copy(path):
                used -= size
                log.info("removed the local copy %s (cache full)", path)
        for entry in os.scandir(self.folder):  # lock files of copies gone (evicted earlier)
            if entry.name.endswith(".lock") and not entry.name.startswith("."):
                copy = entry.path[: -len(".lock")]
                if copy != keep and not os.path.exists(copy):
                    _remove_copy(copy)
        return used + room <= self.max_bytes


def _abandoned(reservation: str) -> bool:
    """Whether a reservation's download is gone: its lock is free (the process died), or, on a
    file system without locks, the file is over an hour old."""
    try:
        fd = os.open(reservation, os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    except OSError:
        return os.fstat(fd).st_mtime < time.time() - 3600
    else:
        return True
    finally:
        os.close(fd)


def _remove_copy(path: str) -> bool:
    """Remove a copy and its lock file, unless someone holds the lock (downloading it, or
    checking it before use). Returns whether the copy is gone."""
    lock_path = path + ".lock"
    try:
        fd = os.open(lock_path, os.O_RDWR | os.O_NOFOLLOW)
    except FileNotFoundError:
        fd = None
    try:
        if fd is not None:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return False  # in use
            except OSError:
                pass  # a file system without locks: remove it all the same
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        if fd is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(lock_path)  # waiters notice (see _locked)
        return True
    finally:
        if fd is not None:
            os.close(fd)
