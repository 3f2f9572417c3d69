"""Where slide bytes come from: a local file, or an object store / web server named by a URL.

Readers ask a byte source for ranges, and say which ranges they will want next (``prefetch``);
no reader knows where its bytes come from.

* `LocalBytes`: one descriptor and ``pread``. Prefetch asks the kernel to read ahead
  (``posix_fadvise(WILLNEED)``), so a cold page cache does not stall the decoder.
* `RemoteBytes`: fsspec (s3fs for ``s3://``, gcsfs for ``gs://``, aiohttp for ``https://``).
  The ranges of one call are coalesced and fetched concurrently on fsspec's event loop (no
  thread per request) into a per-process `RangeStore` bounded in bytes; reads take their bytes
  from it, or fetch them when nobody asked earlier. Timeouts, connection resets, 429 and 5xx
  are retried with backoff. Then, if the object no longer answers a metadata request, the
  store is down: `TransientReadError` (or `SlideNotFoundError` when the object is gone), a
  slide fault, nothing quarantined; if it answers, only these bytes keep failing: a
  ValueError, which the reader turns into a failed (quarantined) tile.

Credentials come from the storage client's usual environment and configuration
(``AWS_ACCESS_KEY_ID``, ``AWS_ENDPOINT_URL``, ``~/.aws``, gcloud...); nothing here stores them.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import hashlib
import logging
import os
import posixpath
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import IO, Any, cast

from wsi_loader.errors import SlideNotFoundError, SlideOpenError, TransientReadError

log = logging.getLogger(__name__)

Range = tuple[int, int]  # (offset, size)
COALESCE_GAP = 64 * 1024  # ranges closer than this are fetched by one request
MAX_REQUEST = 8 * 2**20  # but no request larger than this (requests run concurrently)
RETRIES = 4
BACKOFF_S = 0.1  # first wait before a retry; doubles
PARSE_BLOCK = 256 * 1024  # block size of the file object tifffile parses the header through


def is_url(path: str) -> bool:
    """True for ``scheme://...`` paths other than ``file://`` (which `local_path` strips)."""
    scheme, sep, _ = path.partition("://")
    return bool(sep) and scheme.replace("+", "").isalnum() and scheme.lower() != "file"


def local_path(path: str) -> str:
    """``file:///a/b`` -> ``/a/b``; anything else unchanged."""
    return path[len("file://") :] if path.lower().startswith("file://") else path


def url_join(folder: str, name: str) -> str:
    """``name`` relative to a URL folder (absolute URLs are kept)."""
    if is_url(name):
        return name
    scheme, _, rest = folder.partition("://")
    return f"{scheme}://{posixpath.normpath(posixpath.join(rest, name))}"


def _fsspec() -> Any:
    try:
        import fsspec
    except ImportError as exc:  # an optional dependency
        raise SlideOpenError(
            "reading slides from URLs needs fsspec and the client of the storage "
            "(pip install 'wsi_loader[remote]')"
        ) from exc
    return fsspec


def filesystem(url: str) -> tuple[Any, str]:
    """The fsspec filesystem of ``url`` and the path inside it (instances are cached by fsspec,
    per process)."""
    try:
        fs, path = _fsspec().core.url_to_fs(url)
    except (ImportError, ValueError) as exc:  # no client for the scheme, or a bad URL
        raise SlideOpenError(f"cannot open this URL: {exc}", path=url) from exc
    return fs, path


def retryable(exc: BaseException) -> bool:
    """Network and server trouble (timeouts, resets, 429, 5xx), not a missing object, a refused
    credential, or a bug."""
    if isinstance(exc, FileNotFoundError | PermissionError | IsADirectoryError):
        # fsspec's HTTP client says "not found" for a server it cannot reach: look at why
        cause = exc.__cause__
        return cause is not None and cause is not exc and retryable(cause)
    status = getattr(exc, "status", None)  # aiohttp.ClientResponseError
    if isinstance(status, int):
        return status == 429 or status >= 500
    if isinstance(exc, OSError | TimeoutError | asyncio.TimeoutError):
        return True
    return any(cls.__module__.startswith("aiohttp") for cls in type(exc).__mro__)


def _failure(url: str, what: str, exc: BaseException, attempts: int) -> Exception:
    if retryable(exc):
        if isinstance(exc, FileNotFoundError) and exc.__cause__ is not None:
            exc = exc.__cause__
        return TransientReadError(
            f"{what} failed after {attempts} attempts: {type(exc).__name__}: {exc}", path=url
        )
    if isinstance(exc, FileNotFoundError):
        return SlideNotFoundError("the object does not exist", path=url)
    if isinstance(exc, PermissionError):
        return SlideOpenError(f"access denied: {exc}", path=url)
    return exc if isinstance(exc, Exception) else RuntimeError(str(exc))


@dataclass(frozen=True)
class RemoteStat:
    size: int
    mtime_ns: int
    version: str  # ETag (or last-modified) of the object: changes when it is rewritten


def remote_stat(url: str, retries: int = RETRIES) -> RemoteStat:
    """Size, modification time and version of an object; `SlideNotFoundError` when it does
    not exist, `TransientReadError` when the store cannot be reached."""
    fs, path = filesystem(url)

    def fresh_info() -> dict[str, Any]:
        fs.invalidate_cache(path)  # a listing cached by an earlier call may be stale by now
        return dict(fs.info(path))

    info = with_retries(url, "stat", fresh_info, retries)
    if info.get("type") == "directory":
        raise SlideOpenError("a folder (prefix), not an object", path=url)
    modified = info.get("LastModified") or info.get("mtime") or info.get("updated")
    mtime_ns = 0
    if hasattr(modified, "timestamp"):
        mtime_ns = int(modified.timestamp() * 1e9)
    elif isinstance(modified, int | float):
        mtime_ns = int(modified * 1e9)
    version = str(info.get("ETag") or info.get("etag") or info.get("md5Hash") or mtime_ns)
    size = info.get("size")
    if not isinstance(size, int):
        raise SlideOpenError("the server does not say the object's size", path=url)
    return RemoteStat(size=size, mtime_ns=mtime_ns, version=version.strip('"'))


def read_range(url: str, offset: int, size: int, retries: int = RETRIES) -> bytes:
    """Bytes ``offset`` .. ``offset + size`` of an object (fewer at its end)."""
    fs, path = filesystem(url)
    data = with_retries(
        url, "range read", lambda: fs.cat_file(path, start=offset, end=offset + size), retries
    )
    return bytes(data)


def with_retries(url: str, what: str, call: Callable[[], Any], retries: int) -> Any:
    for attempt in range(retries + 1):
        try:
            return call()
        except Exception as exc:  # classified by `retryable`; the rest propagates
            if not retryable(exc) or attempt == retries:
                raise _failure(url, what, exc, attempt + 1) from exc
            log.debug("%s of %s failed (attempt %d): %s", what, url, attempt + 1, exc)
            time.sleep(BACKOFF_S * 2**attempt)
    raise AssertionError("unreachable")


def list_objects(url: str, suffixes: Iterable[str]) -> list[str]:
    """Objects under a URL prefix (or matching a URL glob) whose names end with ``suffixes``,
    as full URLs, sorted."""
    fs, path = filesystem(url)
    wanted = tuple(s.lower() for s in suffixes)
    try:
        found = fs.glob(path) if set("*?[") & set(path) else fs.find(path)
    except FileNotFoundError:
        return []
    except Exception as exc:  # an unreachable store or bucket
        raise _failure(url, "listing", exc, 1) from exc
    return sorted(
        fs.unstrip_protocol(p)
        for p in found
        if p.lower().endswith(wanted) and not posixpath.basename(p).startswith(".")
    )


def remote_content(url: str, size: int) -> bytes:
    """The first and last 64 KiB of an object (two range requests), as `inputs._head_tail`."""
    head = read_range(url, 0, 65536)
    if size <= 65536:
        return head
    start = max(65536, size - 65536)
    return head + read_range(url, start, size - start)


def coalesce(ranges: Iterable[Range], gap: int = COALESCE_GAP) -> list[Range]:
    """Merge sorted ranges closer than ``gap`` bytes into requests of at most `MAX_REQUEST`."""
    merged: list[list[int]] = []
    for offset, size in sorted(set(ranges)):
        if merged:
            last = merged[-1]
            end = max(last[0] + last[1], offset + size)
            if offset - (last[0] + last[1]) <= gap and end - last[0] <= MAX_REQUEST:
                last[1] = end - last[0]
                continue
        merged.append([offset, size])
    return [(o, s) for o, s in merged]


class _Block:
    """One request's bytes (in flight or done) and the ranges of it still to be read."""

    __slots__ = ("future", "offset", "size", "wanted")

    def __init__(self, offset: int, size: int, future: concurrent.futures.Future[bytes]) -> None:
        self.offset, self.size, self.future = offset, size, future
        self.wanted: set[Range] = set()


class RangeStore:
    """Fetched and in-flight byte ranges of one process, bounded by ``max_bytes``.

    A block leaves when every range it was fetched for has been read, or, oldest first, when
    a new fetch needs its room; a fetch that does not fit is not started (the read fetches it
    then). Owned by one thread (the reading one); the fetches run on fsspec's event loop.
    """

    def __init__(self, max_bytes: int = 64 * 2**20) -> None:
        self.max_bytes = max_bytes
        self._pid = os.getpid()
        self._blocks: OrderedDict[tuple[str, int], _Block] = OrderedDict()
        self._by_range: dict[tuple[str, Range], _Block] = {}
        self._bytes = 0
        # counters, for benchmarks and `wsi-loader bench`
        self.requests = 0
        self.bytes_fetched = 0
        self.bytes_read = 0

    def __getstate__(self) -> dict[str, int]:
        return {"max_bytes": self.max_bytes}

    def __setstate__(self, state: dict[str, int]) -> None:
        self.__init__(**state)  # type: ignore[misc]

    def _check_process(self) -> None:
        if self._pid != os.getpid():  # a forked child: the parent's futures are not ours
            self.__init__(self.max_bytes)  # type: ignore[misc]

    def start(self, source: RemoteBytes, ranges: Iterable[Range]) -> None:
        """Start fetching ``ranges`` of ``source`` (coalesced) unless pending already."""
        self._check_process()
        todo = [r for r in ranges if (source.url, r) not in self._by_range]
        for offset, size in coalesce(todo):
            if not self._make_room(size):
                log.debug("prefetch budget of %d bytes is spent", self.max_bytes)
                break
            block = _Block(offset, size, source.submit(offset, size))
            self.requests += 1
            self.bytes_fetched += size
            self._blocks[(source.url, offset)] = block
            self._bytes += size
            for r in todo:
                if offset <= r[0] and r[0] + r[1] <= offset + size:
                    block.wanted.add(r)
                    self._by_range[(source.url, r)] = block

    def _make_room(self, size: int) -> bool:
        if size > self.max_bytes:
            return False
        for key in list(self._blocks):
            if self._bytes + size <= self.max_bytes:
                break
            block = self._blocks[key]
            if not block.future.done():
                continue  # in flight: someone asked for it, let it land
            self._drop(key, block)
        return self._bytes + size <= self.max_bytes

    def _drop(self, key: tuple[str, int], block: _Block) -> None:
        del self._blocks[key]
        self._bytes -= block.size
        for r in block.wanted:
            self._by_range.pop((key[0], r), None)

    def take(self, url: str, offset: int, size: int) -> bytes | None:
        """The bytes of a range fetched (or being fetched) earlier; waits for an in-flight
        fetch. None when nobody asked for it or its fetch failed (the caller fetches it)."""
        self._check_process()
        block = self._by_range.pop((url, (offset, size)), None)
        if block is None:
            return None
        block.wanted.discard((offset, size))
        if not block.wanted and (url, block.offset) in self._blocks:
            self._drop((url, block.offset), block)
        try:
            data = block.future.result()
        except Exception as exc:  # read again (with retries) by the caller
            log.debug("prefetch of %s failed: %s", url, exc)
            return None
        start = offset - block.offset
        self.bytes_read += size
        return data[start : start + size]

    def forget(self, url: str) -> None:
        """Drop every block of ``url`` (its object changed or its reader is gone for good)."""
        for key, block in list(self._blocks.items()):
            if key[0] == url:
                self._drop(key, block)

    @property
    def nbytes(self) -> int:
        return self._bytes


class LocalBytes:
    """A local file read by ``pread`` (no shared file position; one system call)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def read(self, offset: int, size: int) -> bytes:
        return os.pread(self.fd, size, offset)

    def prefetch(self, ranges: Iterable[Range]) -> None:
        """Ask the kernel to read these ranges ahead (returns at once)."""
        advise = getattr(os, "posix_fadvise", None)
        if advise is None:
            return
        for offset, size in coalesce(ranges):
            try:
                advise(self.fd, offset, size, os.POSIX_FADV_WILLNEED)
            except OSError:
                return  # a file system without read-ahead: reads still work


class RemoteBytes:
    """An object read by range requests, through a process's `RangeStore`."""

    def __init__(self, url: str, store: RangeStore, retries: int = RETRIES) -> None:
        self.url = url
        self.store = store
        self.retries = retries
        self.fs, self.fs_path = filesystem(url)
        self.stat = remote_stat(url, retries)

    @property
    def size(self) -> int:
        return self.stat.size

    def open_for_parsing(self) -> IO[bytes]:
        """A seekable file object for tifffile's header parse: blocks of `PARSE_BLOCK` bytes,
        each fetched once (a TIFF's header, IFDs and tile offset arrays: a few requests)."""
        try:
            return cast(
                IO[bytes],
                self.fs.open(
                    self.fs_path,
                    "rb",
                    block_size=PARSE_BLOCK,
                    cache_type="blockcache",
                    size=self.size,
                ),
            )
        except Exception as exc:
            raise _failure(self.url, "open", exc, 1) from exc

    def submit(self, offset: int, size: int) -> concurrent.futures.Future[bytes]:
        """Start one range request (with its retries) in the background."""
        if getattr(self.fs, "async_impl", False):
            loop = self.fs.loop
            return asyncio.run_coroutine_threadsafe(self._fetch_async(offset, size), loop)
        done: concurrent.futures.Future[bytes] = concurrent.futures.Future()
        try:  # a file system without an event loop: fetched now
            done.set_result(self._fetch(offset, size))
        except Exception as exc:  # handed to whoever reads it, as with async fetches
            done.set_exception(exc)
        return done

    async def _fetch_async(self, offset: int, size: int) -> bytes:
        for attempt in range(self.retries + 1):
            try:
                data = await self.fs._cat_file(self.fs_path, start=offset, end=offset + size)
                return bytes(data)
            except Exception as exc:  # classified by `retryable`
                if not retryable(exc) or attempt == self.retries:
                    raise _failure(self.url, "range read", exc, attempt + 1) from exc
                await asyncio.sleep(BACKOFF_S * 2**attempt)
        raise AssertionError("unreachable")

    def _fetch(self, offset: int, size: int) -> bytes:
        return read_range(self.url, offset, size, self.retries)

    def read(self, offset: int, size: int) -> bytes:
        """A range's bytes: from the store when prefetched, else fetched now."""
        data = self.store.take(self.url, offset, size)
        if data is not None:
            return data
        self.store.requests += 1
        self.store.bytes_fetched += size
        self.store.bytes_read += size
        try:
            return self._fetch(offset, size)
        except TransientReadError as exc:
            failure = exc
        # the store down (a slide fault), or only this range failing (a tile fault)? Raised
        # outside the handler: a tile fault must not carry the resource error as its cause
        remote_stat(self.url, retries=1)
        raise ValueError(
            f"bytes {offset}..{offset + size} keep failing while the object answers: {failure}"
        )

    def read_many(self, ranges: list[Range]) -> list[bytes]:
        """Several ranges, fetched concurrently (coalesced) and returned in order."""
        self.prefetch(ranges)
        return [self.read(o, s) for o, s in ranges]

    def prefetch(self, ranges: Iterable[Range]) -> None:
        """Start fetching ``ranges`` in the background (coalesced, within the budget)."""
        self.store.start(self, ranges)


def url_digest(url: str) -> str:
    """A short, file-name-safe digest of a URL."""
    return hashlib.blake2b(url.encode(), digest_size=8).hexdigest()
