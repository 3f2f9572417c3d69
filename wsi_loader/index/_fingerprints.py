"""What identifies a slide's files: its size, newest mtime and a fingerprint of names, sizes,
mtimes and head/tail bytes (`identify`, `fingerprint`), and a digest of its content alone
(`content_key`), for local files (a DICOM slide: its whole series) and URLs.

Content digests come in two kinds, told apart by their text: ``tiff:<hex>:<ends>`` (size,
head and tail bytes and the TIFF directory with every tile's offset and byte count: SVS,
generic tiled TIFF, NDPI, OME-TIFF, Philips TIFF; then the other kind's digest) and a bare
``<hex>`` (size, head and tail bytes: every other file, every object, and every digest an
index recorded before TIFF directories were covered). Copies, local or remote, are compared
by the size-and-ends part (`ends_digest`). A
recorded digest is compared with one of its own kind (`content_key`'s ``like``), so an index
written before keeps matching its unchanged slides.
"""

from __future__ import annotations

import errno
import hashlib
import os
import posixpath
import stat

from wsi_loader.errors import SlideError
from wsi_loader.index._inputs import dicom_series_files, is_dicom, is_dicom_name
from wsi_loader.index._tiff_directory import directory_bytes
from wsi_loader.slides.storage._sources import is_url, remote_content, remote_stat

TIFF_KIND = "tiff:"  # the prefix of digests that cover the TIFF directory


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


def _local_content(path: str, size: int, head_tail: bytes, like: str | None) -> str:
    """The content digest of a local file: of the TIFF kind when it is a TIFF, unless ``like``
    is a digest of the older kind (which is then computed, to compare with it)."""
    if like is not None and not like.startswith(TIFF_KIND):
        return content_digest(size, head_tail)
    directory = directory_bytes(path, size)
    if directory is None:  # not a TIFF (DICOM, MRXS, ...): size and head and tail, as before
        return content_digest(size, head_tail)
    digest = hashlib.blake2b(digest_size=16)
    digest.update(f"{size};{len(head_tail)};".encode())
    digest.update(head_tail)
    digest.update(directory)
    # the size-and-ends digest rides along: copies of one slide, local and remote, are told
    # by it (`ends_digest`), as an object's directory is not read
    return f"{TIFF_KIND}{digest.hexdigest()}:{content_digest(size, head_tail)}"


def ends_digest(content: str) -> str:
    """The size-and-ends digest (size, first and last 64 KiB) in a content digest of either
    kind: what a local file and an object are compared by (copies of one slide in an
    archive, one slide in two splits)."""
    return content.rsplit(":", 1)[-1]


def content_key(path: str, like: str | None = None) -> str:
    """A digest of a file's content, without its name or mtime: equal for copies of one slide,
    local or remote (used to keep a slide out of two splits, and to tell a replaced slide).
    A TIFF's covers its size, first and last 64 KiB and directory (every tile's offset and
    byte count), read without decoding a pixel; another file's its size and first and last 64
    KiB; an object's its size and first and last 64 KiB (its version, ETag, is in the
    fingerprint). ``like``: a digest recorded earlier, whose kind this one takes, to compare
    with it. Raises OSError (or `SlideError` for a URL)."""
    if is_url(path):
        size = remote_stat(path).size
        return content_digest(size, remote_content(path, size))
    st = _require_regular(path)
    return _local_content(path, st.st_size, _head_tail(path, st.st_size), like)


def identify(path: str) -> tuple[int, int, str, str]:
    """(size, mtime_ns, fingerprint, content) of a slide, each file read once.

    The fingerprint covers names, sizes, mtimes and the first and last 64 KiB of every file
    (DICOM: the series folder), so a rewrite that keeps size and mtime is still noticed; the
    content digest (`content_key`, of the current kind) covers the first file only. Raises
    OSError when the file is gone. An object (URL): its size, mtime, version (ETag) and first
    and last 64 KiB, three requests."""
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
            content = _local_content(file, st.st_size, head_tail, None)
    if files[0] != path:  # DICOM: the content digest is the entry's own file
        content = content_key(path)
    return size, mtime, digest.hexdigest(), content


def fingerprint(path: str) -> tuple[int, int, str]:
    """(size, mtime_ns, digest) of a slide: `identify` without the content digest."""
    size, mtime, digest, _ = identify(path)
    return size, mtime, digest


def unchanged(path: str, fingerprint: str | None, content: str | None) -> str | None:
    """The content digest to record for a slide indexed with ``fingerprint`` and ``content``
    when it is still that slide (the fingerprint and the content digest equal), else None.

    A digest of the older kind (size, head and tail) on a TIFF whose fingerprint is equal
    (names, sizes, mtimes, head and tail) is taken as the same slide once and comes back of
    the current kind, so that an index written before is not seen as all slides changed and
    its next rebuild tells a tile rewritten in the middle."""
    try:
        _, _, digest, now = identify(path)
    except (OSError, SlideError):
        return None
    if digest != fingerprint:
        return None
    if content is None or content == now:
        return now
    if content.startswith(TIFF_KIND) or not now.startswith(TIFF_KIND):
        return None  # a digest of the same kind, other contents: the directory changed
    return now


def slide_version(path: str, content: str | None, fingerprint: str | None) -> str | None:
    """What decides that outputs were made from this slide (features, predictions, an export's
    tiles): its content, not its mtime (a ``touch``, or an archive copied without its
    timestamps, is the same slide). A local file: its content digest (a TIFF's covers its
    directory, every tile's offset and size); an object: the fingerprint, which holds the
    store's version (ETag) and size and no mtime; a record without a content digest: the
    fingerprint."""
    if is_url(path):
        return fingerprint
    return "content:" + content if content else fingerprint
