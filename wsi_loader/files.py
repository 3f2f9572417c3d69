"""Output files that appear whole or not at all, and file locks where file systems have them.

Everything the library writes under a name someone reads (index generations, exported tiles
and shards, feature files, rendered images) is written to a temporary name next to it and
renamed over it. When the writing fails (a full disk, a quota, an interrupt), the temporary
file or folder is removed at once: it would otherwise hold the space the user must free, and
the final name still holds the old version, or nothing.

Processes coordinate through ``flock`` (one build per index folder, generations in use,
quarantine appends, export parts, local copies). Some shared file systems have no locks:
Lustre mounted without ``flock`` (a common HPC default: ENOSYS), NFS without a lock manager
(ENOLCK). There `lock` says so once per file system and lets the work go on uncoordinated.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import shutil
from collections.abc import Iterator, Mapping
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

from wsi_loader.errors import OutputError

log = logging.getLogger(__name__)

NO_LOCKS = frozenset({errno.ENOSYS, errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOTSUP})
_said: set[int] = set()  # devices whose missing locks were said (once per process)


def lock(fd: int, operation: int, path: str | os.PathLike[str]) -> bool:
    """``fcntl.flock(fd, operation)``; False where the file system of ``path`` has no locks
    (said once per file system). Other errors, and a non-blocking lock that is taken
    (``BlockingIOError``), are raised."""
    try:
        fcntl.flock(fd, operation)
    except OSError as exc:
        if exc.errno not in NO_LOCKS:
            raise
        device = os.fstat(fd).st_dev
        if device not in _said:
            _said.add(device)
            log.warning(
                "file locks are not supported on the file system of %s (%s): processes that "
                "share the index, its quarantine, exports or caches there are not coordinated "
                "(a second build into one folder is not detected, a rebuild may delete a "
                "generation another process still opens by name); on Lustre, mount with "
                "the 'flock' option",
                path,
                exc.strerror,
            )
        return False
    return True


@contextmanager
def locked(path: str | os.PathLike[str]) -> Iterator[None]:
    """Hold an exclusive ``flock`` on the file ``path`` (created if missing, with the umask's
    permissions, never through a symlink) for the block; closing the descriptor releases it.
    A lock file may be removed by whoever holds it (`LocalCopies` removes a copy's with the
    copy): a waiter that then gets the lock of a file no longer at ``path`` locks the new one."""
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o666)
        try:
            lock(fd, fcntl.LOCK_EX, path)
            try:
                same = os.path.samestat(os.fstat(fd), os.stat(path, follow_symlinks=False))
            except FileNotFoundError:
                same = False
            if same:
                yield
                return
        finally:
            os.close(fd)


def append_line(path: str | os.PathLike[str], record: Mapping[str, Any]) -> None:
    """Append ``record`` to the JSON-lines file ``path`` as one line, with one ``write``
    (``O_APPEND``, never through a symlink). The caller holds `locked` on the file or on a
    lock file beside it, so lines from several processes never interleave. A writer killed
    mid-line leaves a torn last line: this one then starts on a fresh line, and readers skip
    the torn one. A short write (a full disk) raises OSError (ENOSPC)."""
    line = (json.dumps(record, sort_keys=True) + "\n").encode("utf-8")
    fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o644)
    try:
        size = os.fstat(fd).st_size
        if size and os.pread(fd, 1, size - 1) != b"\n":
            line = b"\n" + line
        if os.write(fd, line) != len(line):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), os.fspath(path))
    finally:
        os.close(fd)


def temporary_name(path: Path, tag: str | None = None) -> Path:
    """A hidden name next to ``path``, unique per process (``tag``: another unique part)."""
    return path.with_name(f".{path.name}.tmp-{tag or os.getpid()}")


def remove(path: Path) -> None:
    """Delete a file or a folder tree, if there (errors ignored: this runs on failure)."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with suppress(OSError):
            path.unlink()


@contextmanager
def replacing(path: Path, tmp: Path | None = None) -> Iterator[Path]:
    """Yield a temporary path (default `temporary_name`) for the caller to write a file or
    folder at; it replaces ``path`` when the block ends, and is removed when the block
    raises (anything, KeyboardInterrupt included). A system error becomes `OutputError`
    naming ``path`` (a failed ``write`` on an open file names no file)."""
    tmp = tmp or temporary_name(path)
    try:
        yield tmp
        os.replace(tmp, path)
    except OutputError:
        remove(tmp)
        raise
    except OSError as exc:
        remove(tmp)
        raise OutputError(exc.strerror or str(exc), path=str(path), code=exc.errno) from exc
    except BaseException:
        remove(tmp)
        raise


def write_file(path: Path, data: bytes, tmp: Path | None = None) -> None:
    """Write ``data`` as ``path``, whole and on disk (fsync) before it has that name. Formats
    written by libraries with their own error handling (HDF5) are built in memory first, so
    that a full disk fails here, as an `OutputError`."""
    with replacing(path, tmp) as written, open(written, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())


# what makes a spreadsheet read a cell as a formula (OWASP's "CSV injection"), and the quote
FORMULA_STARTS = ("=", "+", "-", "@", "\t", "\r")
CELL_QUOTE = "'"


def csv_cell(value: Any) -> Any:
    """``value`` as a CSV cell we write: text starting with ``= + - @``, a tab or CR gets a
    leading ``'`` (OWASP), so that Excel and LibreOffice show a slide named ``=cmd|calc!A0``
    as text instead of running it; text already starting with ``'`` gets one more (so that
    `csv_text` gives back exactly what was written). Numbers (int, float) stay numbers: pass
    them as numbers, not as their text."""
    if isinstance(value, str) and value.startswith((*FORMULA_STARTS, CELL_QUOTE)):
        return CELL_QUOTE + value
    return value


def csv_row(values: Any) -> list[Any]:
    """`csv_cell` of each value of a row."""
    return [csv_cell(v) for v in values]


def csv_text(cell: str) -> str:
    """The text a `csv_cell` cell was written from (the leading quote it added removed):
    what our own readers of our CSV files use."""
    return cell[1:] if cell.startswith(CELL_QUOTE) else cell


def expand_home(path: str) -> str:
    """``~/x`` as a shell would expand it: YAML files and ``--opt=~/x`` reach us unexpanded.
    URLs (which never start with '~') are unchanged."""
    return os.path.expanduser(path) if path.startswith("~") else path
