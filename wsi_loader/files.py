"""Output files that appear whole or not at all.

Everything the library writes under a name someone reads (index generations, exported tiles
and shards, feature files, rendered images) is written to a temporary name next to it and
renamed over it. When the writing fails (a full disk, a quota, an interrupt), the temporary
file or folder is removed at once: it would otherwise hold the space the user must free, and
the final name still holds the old version, or nothing.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

from wsi_loader.errors import OutputError


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
