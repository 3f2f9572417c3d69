"""Where slide bytes come from: a local file, or an object store / web server named by a URL.

Readers ask a byte source for ranges, and say which ranges they will want next (``prefetch``);
no reader knows where its bytes come from.

* Local files: ``pread`` (in the reader); `read_ahead` asks the kernel to read the next
  ranges ahead (``posix_fadvise(WILLNEED)``), so a cold page cache does not stall the decoder.
* `RemoteBytes`: obstore (Rust's object_store: S3 ``s3://``, GCS ``gs://``, Azure ``az://``,
  plain HTTP ``https://``). The ranges of one call are coalesced and fetched concurrently on
  a few threads per process (obstore releases the GIL while it waits) into a per-process
  `RangeStore` bounded in bytes; reads take their bytes from it, or fetch them when nobody
  asked earlier. obstore retries timeouts, connection errors, 429 and 5xx with backoff. Then,
  if the object no longer answers a metadata request, the store is down:
  `TransientReadError` (or `SlideNotFoundError` when the object is gone), a slide fault,
  nothing quarantined; if it answers, only these bytes keep failing: a ValueError, which the
  reader turns into a failed (quarantined) tile.

Why obstore, not fsspec/s3fs: measured here against one S3 endpoint, a range request costs the
client ~0.35 ms of CPU through obstore and ~2.5 ms through s3fs (botocore resolves endpoints
and signs in Python), more than decoding the tile; at the same concurrency obstore is the one
that keeps a 2-core reader decoding.

Credentials and endpoints come from the storage client's usual environment
(``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_ENDPOINT_URL``, ``AWS_REGION``,
``GOOGLE_APPLICATION_CREDENTIALS``, ...); nothing here stores them.
"""

from __future__ import annotations

import concurrent.futures
import fnmatch
import hashlib
import io
import logging
import os
import posixpath
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any
from urllib.parse import unquote, urlsplit

from wsi_loader.errors import (
    ForkUnsafeError,
    SlideNotFoundError,
    SlideOpenError,
    TransientReadError,
)

log = logging.getLogger(__name__)

Range = tuple[int, int]  # (offset, size)
COALESCE_GAP = 64 * 1024  # ranges closer than this are fetched by one request
MAX_REQUEST = 8 * 2**20  # but no request larger than this (requests run concurrently)
RETRIES = 2  # our attempts on top of obstore's own retries (which do the backoff)
BACKOFF_S = 0.1
PARSE_BLOCK = 256 * 1024  # block size of the file object tifffile parses the header through
FETCH_THREADS = 64  # concurrent range requests per process (they wait; obstore frees the GIL)
# obstore's retries of timeouts, connection errors, 429 and 5xx
RETRY_CONFIG: Any = {
    "max_retries": 4,
    "backoff": {
        "init_backoff": timedelta(milliseconds=100),
        "max_backoff": timedelta(seconds=2),
        "base": 2,
    },
    "retry_timeout": timedelta(seconds=60),
}
CLIENT_OPTIONS: Any = {
    "allow_http": True,  # an http:// URL or endpoint is what the user asked for
    "connect_timeout": timedelta(seconds=10),
    "timeout": timedelta(seconds=120),
}


def is_url(path: str) -> bool:
    """True for ``scheme://...`` paths other than ``file://`` (which `local_path` strips)."""
    scheme, sep, _ = path.partition("://")
    return bool(sep) and scheme.replace("+", "").isalnum() and scheme.lower() != "file"


def local_path(path: str) -> str:
    """``file:///a/b`` -> ``/a/b``; anything else unchanged."""
    return path[len("file://") :] if path.lower().startswith("file://") else path


def expand_home(path: str) -> str:
    """``~/x`` as a shell would expand it: YAML files and ``--opt=~/x`` reach us unexpanded.
    URLs (which never start with '~') are unchanged."""
    return os.path.expanduser(path) if path.startswith("~") else path


def url_join(folder: str, name: str) -> str:
    """``name`` relative to a URL folder (absolute URLs are kept)."""
    if is_url(name):
        return name
    scheme, _, rest = folder.partition("://")
    return f"{scheme}://{posixpath.normpath(posixpath.join(rest, name))}"


FORK_ADVICE = (
    "obstore, which reads slides from URLs, was used by this process's parent before it forked, "
    "and its runtime does not survive fork() (its threads stay behind): start the worker "
    "processes with multiprocessing_context='forkserver' or 'spawn' (make_loader does so "
    "by itself for indexes of remote slides)"
)


class _Clients:
    """obstore stores by ``scheme://bucket`` (one HTTP client each, reused), and the fetch
    threads, of this process: recreated after a fork (a child never uses its parent's
    connections or threads). obstore's own runtime cannot be recreated: a child forked after
    its parent used obstore refuses to (`ForkUnsafeError`) instead of hanging."""

    def __init__(self, inherited: bool = False) -> None:
        self.inherited = inherited  # the parent used obstore before forking this process
        self.used = False
        self.pid = os.getpid()
        self.stores: dict[str, Any] = {}
        self.threads: concurrent.futures.ThreadPoolExecutor | None = None
        self.lock = threading.Lock()

    def store(self, root: str, url: str) -> Any:
        if self.inherited:
            raise ForkUnsafeError(FORK_ADVICE)
        with self.lock:
            found = self.stores.get(root)
            if found is None:
                self.used = True
                try:
                    from obstore.store import from_url
                except ImportError as exc:  # an optional dependency
                    raise SlideOpenError(
                        "reading slides from URLs needs obstore (pip install 'wsi_loader[remote]')",
                        path=url,
                    ) from exc
                try:
                    found = from_url(root, client_options=CLIENT_OPTIONS, retry_config=RETRY_CONFIG)
                except Exception as exc:  # an unknown scheme, a bad configuration
                    advice = _CREDENTIALS_ADVICE.get(urlsplit(url).scheme, "")
                    hint = f"; {advice}" if "Account must be specified" in str(exc) else ""
                    raise SlideOpenError(
                        f"cannot open this URL: {_short(exc)}{hint}", path=url
                    ) from exc
                self.stores[root] = found
            return found

    def pool(self) -> concurrent.futures.ThreadPoolExecutor:
        with self.lock:
            if self.threads is None:
                self.threads = concurrent.futures.ThreadPoolExecutor(
                    FETCH_THREADS, thread_name_prefix="wsi-fetch"
                )
            return self.threads


_current = {"clients": _Clients()}


def _here() -> _Clients:
    clients = _current["clients"]
    if clients.pid != os.getpid():
        clients = _current["clients"] = _Clients(clients.used or clients.inherited)
    return clients


def locate(url: str) -> tuple[Any, str]:
    """The obstore store of ``url`` and the object's path in it."""
    parts = urlsplit(url)
    if not parts.netloc:
        raise SlideOpenError("a URL needs a bucket or host", path=url)
    root = f"{parts.scheme}://{parts.netloc}"
    return _here().store(root, url), unquote(parts.path).lstrip("/")


# What obstore's error says when it found no credentials in the environment and asked the
# machine's instance metadata service (AWS IMDS, GCE metadata server, Azure IMDS) instead.
_METADATA_PATHS = (
    "/latest/api/token",
    "/latest/meta-data",
    "computeMetadata",
    "/metadata/identity",
)
_CREDENTIALS_ADVICE = {
    "s3": "set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (obstore does not read ~/.aws "
    'profiles; `eval "$(aws configure export-credentials --format env)"` exports a profile\'s)',
    "gs": "set GOOGLE_APPLICATION_CREDENTIALS to a service-account key file (or "
    "GOOGLE_SERVICE_ACCOUNT)",
    "az": "set AZURE_STORAGE_ACCOUNT_NAME with AZURE_STORAGE_ACCOUNT_KEY (or a SAS token)",
}


def _kind(exc: BaseException) -> str:
    """ "missing", "denied", "no-credentials", "transient" (network or server trouble), or
    "other"."""
    name = type(exc).__name__
    if name == "NotFoundError" or isinstance(exc, FileNotFoundError):
        return "missing"
    if name == "GenericError" and any(part in str(exc) for part in _METADATA_PATHS):
        return "no-credentials"  # retrying cannot help
    if name in ("PermissionDeniedError", "UnauthenticatedError") or isinstance(
        exc, PermissionError
    ):
        return "denied"
    if name == "GenericError" or isinstance(exc, ConnectionError | TimeoutError):
        return "transient"
    return "other"


def retryable(exc: BaseException) -> bool:
    """Network and server trouble, not a missing object, a refused credential, or a bug."""
    return _kind(exc) == "transient"


def _short(exc: BaseException, limit: int = 500) -> str:
    """An error's message on one line, without the debug dump obstore appends."""
    return " ".join(str(exc).split("Debug source:")[0].split())[:limit]


def _failure(url: str, what: str, exc: BaseException, attempts: int) -> Exception:
    kind = _kind(exc)
    text = _short(exc)
    if kind == "missing":
        return SlideNotFoundError("the object does not exist", path=url)
    if kind == "denied":
        return SlideOpenError(f"access denied: {text}", path=url)
    if kind == "no-credentials":
        scheme = urlsplit(url).scheme
        advice = _CREDENTIALS_ADVICE.get("s3" if scheme == "s3a" else scheme, "")
        return SlideOpenError(
            "no credentials for this store: none in the environment, and the machine's "
            f"instance metadata service gave none{f'; {advice}' if advice else ''} "
            f"({type(exc).__name__}: {_short(exc, 200)})",
            path=url,
        )
    if kind == "transient":
        return TransientReadError(
            f"{what} failed after {attempts} attempts: {type(exc).__name__}: {text}", path=url
        )
    if type(exc).__module__.startswith("obstore"):
        return SlideOpenError(f"{what}: {type(exc).__name__}: {text}", path=url)
    return exc if isinstance(exc, Exception) else RuntimeError(str(exc))


def with_retries(url: str, what: str, call: Callable[[], Any], retries: int = RETRIES) -> Any:
    """``call()``, again (after obstore's own retries) when it fails for a network reason."""
    for attempt in range(retries + 1):
        try:
            return call()
        except Exception as exc:  # classified by `_kind`; the rest propagates
            if not retryable(exc) or attempt == retries:
                raise _failure(url, what, exc, attempt + 1) from exc
            log.debug("%s of %s failed (attempt %d): %s", what, url, attempt + 1, exc)
            time.sleep(BACKOFF_S * 2**attempt)
    raise AssertionError("unreachable")


@dataclass(frozen=True)
class RemoteStat:
    size: int
    mtime_ns: int
    version: str  # ETag (or last-modified) of the object: changes when it is rewritten


def remote_stat(url: str, retries: int = RETRIES) -> RemoteStat:
    """Size, modification time and version of an object; `SlideNotFoundError` when it does
    not exist, `TransientReadError` when the store cannot be reached."""
    import obstore

    store, path = locate(url)
    meta = with_retries(url, "metadata request", lambda: obstore.head(store, path), retries)
    modified = meta.get("last_modified")
    mtime_ns = int(modified.timestamp() * 1e9) if hasattr(modified, "timestamp") else 0
    version = str(meta.get("e_tag") or meta.get("version") or mtime_ns).strip('"')
    return RemoteStat(size=int(meta["size"]), mtime_ns=mtime_ns, version=version)


def read_range(url: str, offset: int, size: int, retries: int = RETRIES) -> bytes:
    """Bytes ``offset`` .. ``offset + size`` of an object."""
    store, path = locate(url)
    return _get_range(store, path, url, offset, size, retries)


def _get_range(store: Any, path: str, url: str, offset: int, size: int, retries: int) -> bytes:
    import obstore

    data = with_retries(
        url,
        "range read",
        lambda: obstore.get_range(store, path, start=offset, end=offset + size),
        retries,
    )
    return bytes(data)


def download(url: str, dest: str) -> None:
    """The whole object into the file ``dest`` (streamed)."""
    import obstore

    store, path = locate(url)

    def fetch() -> None:
        with open(dest, "wb") as fh:
            for chunk in obstore.get(store, path).stream(min_chunk_size=8 * 2**20):
                fh.write(chunk)

    with_retries(url, "download", fetch)


def list_objects(url: str, suffixes: Iterable[str]) -> list[str]:
    """Objects under a URL prefix (or matching a URL glob) whose names end with ``suffixes``,
    as full URLs, sorted."""
    import obstore

    store, path = locate(url)
    pattern = path if set("*?[") & set(path) else None
    prefix = path.split("*")[0].split("?")[0].split("[")[0] if pattern else path
    if prefix and not prefix.endswith("/") and pattern is None:
        prefix += "/"
    wanted = tuple(s.lower() for s in suffixes)
    parts = urlsplit(url)
    root = f"{parts.scheme}://{parts.netloc}/"

    def listing() -> list[str]:
        found = []
        for batch in obstore.list(store, prefix=prefix.rsplit("/", 1)[0] or None):
            for meta in batch:
                key = str(meta["path"])
                if not key.startswith(prefix) or posixpath.basename(key).startswith("."):
                    continue
                if pattern is not None and not fnmatch.fnmatchcase(key, pattern):
                    continue
                if key.lower().endswith(wanted):
                    found.append(root + key)
        return found

    try:
        return sorted(with_retries(url, "listing", listing))
    except SlideOpenError as exc:
        if parts.scheme not in ("http", "https"):
            raise  # a bucket's own reason (credentials, access) says it all
        raise SlideOpenError(
            f"cannot list this prefix ({exc}); plain web servers cannot be listed: name the "
            "slides, or list them in a CSV manifest",
            path=url,
        ) from exc


def remote_content(url: str, size: int) -> bytes:
    """The first and last 64 KiB of an object (two range requests), as `inputs._head_tail`."""
    head = read_range(url, 0, min(65536, size))
    if size <= 65536:
        return head
    start = max(65536, size - 65536)
    return head + read_range(url, start, size - start)


def coalesce(ranges: Iterable[Range], gap: int = COALESCE_GAP) -> list[Range]:
    """Merge sorted ranges closer than ``gap`` bytes into requests of at most `MAX_REQUEST`."""
    return [request for request, _ in coalesce_groups(ranges, gap)]


def coalesce_groups(
    ranges: Iterable[Range], gap: int = COALESCE_GAP
) -> list[tuple[Range, list[Range]]]:
    """`coalesce`, each request with the ranges it serves (one pass over the sorted ranges)."""
    groups: list[tuple[list[int], list[Range]]] = []
    for offset, size in sorted(set(ranges)):
        if groups:
            last, members = groups[-1]
            end = max(last[0] + last[1], offset + size)
            if offset - (last[0] + last[1]) <= gap and end - last[0] <= MAX_REQUEST:
                last[1] = end - last[0]
                members.append((offset, size))
                continue
        groups.append(([offset, size], [(offset, size)]))
    return [((o, s), members) for (o, s), members in groups]


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
    then). Owned by one thread (the reading one); the fetches run on the fetch threads.
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
        for (offset, size), members in coalesce_groups(todo):
            if not self._make_room(size):
                log.debug("prefetch budget of %d bytes is spent", self.max_bytes)
                break
            block = _Block(offset, size, source.submit(offset, size))
            self.requests += 1
            self.bytes_fetched += size
            self._blocks[(source.url, offset)] = block
            self._bytes += size
            block.wanted.update(members)
            for r in members:
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


def read_ahead(fd: int, ranges: Iterable[Range]) -> None:
    """Ask the kernel to read these ranges of a local file ahead (returns at once)."""
    advise = getattr(os, "posix_fadvise", None)
    if advise is None:
        return
    for offset, size in coalesce(ranges):
        try:
            advise(fd, offset, size, os.POSIX_FADV_WILLNEED)
        except OSError:
            return  # a file system without read-ahead: reads still work


class _BlockFile(io.RawIOBase):
    """A read-only, seekable file over an object, fetched in blocks of `PARSE_BLOCK` bytes,
    each once: what tifffile parses a remote TIFF's header, IFDs and offset arrays through."""

    def __init__(self, source: RemoteBytes) -> None:
        super().__init__()
        self.source = source
        self.position = 0
        self.blocks: dict[int, bytes] = {}

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.position

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.position, io.SEEK_END: self.source.size}
        self.position = max(0, base[whence] + offset)
        return self.position

    def _block(self, number: int) -> bytes:
        if number not in self.blocks:
            start = number * PARSE_BLOCK
            size = min(PARSE_BLOCK, self.source.size - start)
            self.blocks[number] = self.source.fetch(start, size)
        return self.blocks[number]

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        want = min(len(view), self.source.size - self.position)
        done = 0
        while done < want:
            number, at = divmod(self.position + done, PARSE_BLOCK)
            chunk = self._block(number)[at : at + want - done]
            if not chunk:
                break
            view[done : done + len(chunk)] = chunk
            done += len(chunk)
        self.position += done
        return done


class RemoteBytes:
    """An object read by range requests, through a process's `RangeStore`."""

    def __init__(self, url: str, store: RangeStore, retries: int = RETRIES) -> None:
        self.url = url
        self.store = store
        self.retries = retries
        self._store, self._path = locate(url)  # in this process: readers never cross a fork
        self.stat = remote_stat(url, retries)

    @property
    def size(self) -> int:
        return self.stat.size

    def open_for_parsing(self) -> io.BufferedReader:
        """A seekable file object for tifffile's header parse (a few block requests)."""
        return io.BufferedReader(_BlockFile(self), buffer_size=65536)

    def submit(self, offset: int, size: int) -> concurrent.futures.Future[bytes]:
        """Start one range request (with its retries) on this process's fetch threads."""
        return _here().pool().submit(self.fetch, offset, size)

    def fetch(self, offset: int, size: int) -> bytes:
        """One range request now (with the retries), bypassing the store."""
        return _get_range(self._store, self._path, self.url, offset, size, self.retries)

    def read(self, offset: int, size: int) -> bytes:
        """A range's bytes: from the store when prefetched, else fetched now."""
        data = self.store.take(self.url, offset, size)
        if data is not None:
            return data
        self.store.requests += 1
        self.store.bytes_fetched += size
        self.store.bytes_read += size
        try:
            return self.fetch(offset, size)
        except TransientReadError as exc:
            failure = exc
        # the store down (a slide fault), or only this range failing (a tile fault)? Raised
        # outside the handler: a tile fault must not carry the resource error as its cause
        remote_stat(self.url, retries=0)
        raise ValueError(
            f"bytes {offset}..{offset + size} keep failing while the object answers: {failure}"
        )

    def prefetch(self, ranges: Iterable[Range]) -> None:
        """Start fetching ``ranges`` in the background (coalesced, within the budget)."""
        self.store.start(self, ranges)


def url_digest(url: str) -> str:
    """A short, file-name-safe digest of a URL."""
    return hashlib.blake2b(url.encode(), digest_size=8).hexdigest()
