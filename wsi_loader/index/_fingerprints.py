"""What identifies a slide's files: its size, newest mtime and a fingerprint of names, sizes,
mtimes and head/tail bytes (`identify`, `fingerprint`), and a digest of its content alone
(`content_key`), for local files (a DICOM slide: its whole series) and URLs.
"""

from __future__ import annotations

import errno
import hashlib
import os
import posixpath
import stat

from wsi_loader.index._inputs import dicom_series_files, is_dicom, is_dicom_name
from wsi_loader.slides.storage._sources import is_url, remote_content, remote_stat


def _require_regular(path: str) -> os.stat_result:
    """``os.stat(path)``, refusing anything but a regular file (opening a FIFO blocks)."""
    st = os.stat(path)
    if not stat.S_ISREG(st.st_mode):
        raise OSError(errno.EINVAL, "not a regular file (a FIFO, device or folder)", path)
    return st


def _head_tail(path: str, size: int) -> bytes:
    """The first and last 64 KiB of a file (the whole file when it is smaller)."""
    with open(path, "rb") as fh:
        chunks = [fh.read(65536)]
        if size > 65536:
            fh.seek(max(65536, size - 65536))
            chunks.append(fh.read(65536))
    return b"".join(chunks)


def content_digest(size: int, head_tail: bytes) -> str:
    digest = hashlib.blake2b(digest_size=16)
    digest.update(str(size).encode())
    digest.update(head_tail)
    return digest.hexdigest()


def content_key(path: str) -> str:
    """A digest of a file's size and first and last 64 KiB, without its name or mtime: equal
    for copies of one slide, local or remote (used to keep a slide out of two splits, and to
    tell a replaced slide). Raises OSError (or `SlideError` for a URL)."""
    if is_url(path):
        size = remote_stat(path).size
        return content_digest(size, remote_content(path, size))
    st = _require_regular(path)
    return content_digest(st.st_size, _head_tail(path, st.st_size))


def identify(path: str) -> tuple[int, int, str, str]:
    """(size, mtime_ns, fingerprint, content) of a slide, each file read once.

    The fingerprint covers names, sizes, mtimes and the first and last 64 KiB of every file
    (DICOM: the series folder), so a rewrite that keeps size and mtime is still noticed; the
    content digest (`content_key`) covers the first file's bytes only. Raises OSError when the
    file is gone. An object (URL): its size, mtime, version (ETag) and first and last 64 KiB,
    three requests."""
    if is_url(path):
        stat = remote_stat(path)
        head_tail = remote_content(path, stat.size)
        remote = hashlib.blake2b(digest_size=16)
        remote.update(f"{posixpath.basename(path)}:{stat.size}:{stat.version};".encode())
        remote.update(head_tail)
        return stat.size, stat.mtime_ns, remote.hexdigest(), content_digest(stat.size, head_tail)
    files = [path]
    if is_dicom_name(path) or is_dicom(path):
        files = dicom_series_files(path) or [path]
    digest = hashlib.blake2b(digest_size=16)
    size = mtime = 0
    content = ""
    for file in files:
        st = _require_regular(file)
        size += st.st_size
        mtime = max(mtime, st.st_mtime_ns)
        name = os.fsencode(os.path.basename(file))  # file names need not be UTF-8
        digest.update(name + f":{st.st_size}:{st.st_mtime_ns};".encode())
        head_tail = _head_tail(file, st.st_size)
        digest.update(head_tail)
        if file == files[0]:
            content = content_digest(st.st_size, head_tail)
    if files[0] != path:  # DICOM: the content digest is the entry's own file
        content = content_key(path)
    return size, mtime, digest.hexdigest(), content


def fingerprint(path: str) -> tuple[int, int, str]:
    """(size, mtime_ns, digest) of a slide: `identify` without the content digest."""
    size, mtime, digest, _ = identify(path)
    return size, mtime, digest
