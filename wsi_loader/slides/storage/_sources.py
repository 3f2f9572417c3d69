"""Where slide bytes come from: a local file, or an object store / web server named by a URL.

Readers ask a byte source for ranges, and say which ranges they will want next (``prefetch``);
no reader knows where its bytes come from.

* Local files: ``pread`` (in the reader); `read_ahead` asks the kernel to read the next
  ranges ahead (``posix_fadvise(WILLNEED)``), so a cold page cache does not stall the decoder.
* `RemoteBytes`: an object read by range requests through the process's `RangeStore`
  (`_range_cache`): the ranges of the next batches are planned together (merged by a cost
  model learnt from this store's answers, `_request_plan`), fetched concurrently, and kept
  within a byte budget, so a range already held or in flight is never asked again.
* Clients, made in each process when it first asks (a forked worker makes its own):
  ``s3://`` with keys in the environment and ``http(s)://`` go through libcurl
  (`_curl`: fork-safe, half the CPU per request); other stores (``gs://``, ``az://``,
  S3 with an instance role) through obstore (Rust's object_store), whose runtime does not
  survive fork: `survives_fork` says which.

Faults. Each range request has a deadline and a hedge derived from the latency seen so far
(`_request_plan.CostModel`). An answer shorter than the range asked for, a reset, a stall, a 5xx
or 429 is retried (`RETRIES` on top of the client's own); when short answers, resets or stalls
keep coming it is a `TransientReadError` (never a tile or slide fault), when the server keeps
refusing one range while the object answers, a failed tile. A 404 is permanent: not retried, said in
words (`SlideNotFoundError`: which bucket or object is missing); a 403 is access denied. An
object whose ETag changed since it was opened answers 412 to our ``If-Match``: that, and only
that, is a rewritten slide (`SlideChangedError`).

Integrity: range answers carry no checksum in S3, GCS or plain HTTP, so a byte flipped on the
way is caught only by TLS (``https://``, and every S3/GCS/Azure endpoint) or by the decoder;
over plain ``http://`` integrity is the network's, and reading slides so from another machine
is warned once per store and process. Every 206 answer's ``Content-Range`` must be the range
asked for (else retried, as a short answer is). A slide whose first and last bytes read
differently from the index's is declared rewritten only when a fresh HEAD shows another size
or date (the dataset's check); otherwise it is a transient read error, retried. Whole-object
downloads (`download`) are checked against the object's size, and against its MD5 where the
ETag is one (S3 objects uploaded in one part).

Credentials and endpoints come from the storage client's usual environment
(``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_SESSION_TOKEN``, ``AWS_ENDPOINT_URL``,
``AWS_REGION``, ``GOOGLE_APPLICATION_CREDENTIALS``, ...); nothing here stores them.
"""

from __future__ import annotations

import concurrent.futures
import fnmatch
import hashlib
import io
import logging
import os
import posixpath
from collections.abc import Iterable
from typing import Any
from urllib.parse import urlsplit

from wsi_loader.errors import SlideOpenError, TransientReadError
from wsi_loader.slides.storage import _curl
from wsi_loader.slides.storage._range_cache import DEFAULT_DEADLINE_S, RangeStore
from wsi_loader.slides.storage._remote import RemoteStat, client_for
from wsi_loader.slides.storage._remote_errors import (
    RETRIES,
    StatusError,
    object_key,
    with_retries,
)
from wsi_loader.slides.storage._request_plan import MAX_REQUEST, CostModel, Range, coalesce_groups

log = logging.getLogger(__name__)

__all__ = ["MAX_REQUEST", "Range", "RangeStore", "RemoteBytes", "RemoteStat", "coalesce"]

COALESCE_GAP = 64 * 1024  # `coalesce`'s default (local read-ahead; remote gaps: CostModel)
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


def survives_fork(url: str) -> bool:
    """Whether a process forked after reading ``url`` can read it too (libcurl's clients are
    made per process; obstore's runtime is not)."""
    return not is_url(url) or _curl.endpoint_for(url) is not None


def remote_stat(
    url: str, retries: int = RETRIES, deadline: float = DEFAULT_DEADLINE_S
) -> RemoteStat:
    """Size, modification time and version of an object; `SlideNotFoundError` when it does
    not exist, `TransientReadError` when the store cannot be reached or gives no answer
    within ``deadline`` seconds."""
    client = client_for(url)
    return with_retries(  # type: ignore[no-any-return]
        url, "metadata request", lambda: client.head(url, deadline), retries
    )


def read_range(url: str, offset: int, size: int, retries: int = RETRIES) -> bytes:
    """Bytes ``offset`` .. ``offset + size`` of an object (with retries)."""
    client = client_for(url)
    return with_retries(  # type: ignore[no-any-return]
        url,
        "range read",
        lambda: client.submit(url, offset, size, None, DEFAULT_DEADLINE_S).result(),
        retries,
    )


def download(url: str, dest: str) -> None:
    """The whole object into the file ``dest`` (streamed), checked against its size (and its
    MD5 where the ETag is one)."""
    client = client_for(url)
    stat = remote_stat(url)
    with_retries(url, "download", lambda: client.download(url, dest, stat.size, stat.etag))


def list_objects(url: str, suffixes: Iterable[str]) -> list[str]:
    """Objects under a URL prefix (or matching a URL glob) whose names end with ``suffixes``,
    as full URLs, sorted."""
    client = client_for(url)
    path = object_key(url)
    pattern = path if set("*?[") & set(path) else None
    prefix = path.split("*")[0].split("?")[0].split("[")[0] if pattern else path
    if prefix and not prefix.endswith("/") and pattern is None:
        prefix += "/"
    wanted = tuple(s.lower() for s in suffixes)
    parts = urlsplit(url)
    root = f"{parts.scheme}://{parts.netloc}/"

    def listing() -> list[str]:
        found = []
        for key in client.list(url, prefix):
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
    """The first and last 64 KiB of an object (two range requests), as
    `_fingerprints._head_tail`."""
    head = read_range(url, 0, min(65536, size))
    if size <= 65536:
        return head
    start = max(65536, size - 65536)
    return head + read_range(url, start, size - start)


def coalesce(ranges: Iterable[Range], gap: int = COALESCE_GAP) -> list[Range]:
    """Merge sorted ranges closer than ``gap`` bytes into requests of at most `MAX_REQUEST`."""
    return [request for request, _ in coalesce_groups(ranges, gap)]


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
        self._client = client_for(url)  # in this process: readers never cross a fork
        self.stat = remote_stat(url, retries, store.deadline_s)

    @property
    def size(self) -> int:
        return self.stat.size

    @property
    def key(self) -> tuple[str, str]:
        """What the store files this object's bytes under: a new version, new bytes."""
        return (self.url, self.stat.version)

    @property
    def model(self) -> CostModel:
        return self._client.model

    def open_for_parsing(self) -> io.BufferedReader:
        """A seekable file object for tifffile's header parse (a few block requests)."""
        return io.BufferedReader(_BlockFile(self), buffer_size=65536)

    def submit(self, offset: int, size: int) -> concurrent.futures.Future[bytes]:
        """Start one range request (hedged, with a deadline; no retries)."""
        future = self._client.submit(self.url, offset, size, self.stat.etag, self.store.deadline_s)
        transfers = getattr(self._client, "transfers", None)
        if transfers is not None:
            self.store.hedged = transfers.hedges
        return future

    def fetch(self, offset: int, size: int) -> bytes:
        """One range request now (with the retries), bypassing the store."""
        return with_retries(  # type: ignore[no-any-return]
            self.url,
            "range read",
            lambda: self.submit(offset, size).result(),
            self.retries,
        )

    def read(self, offset: int, size: int) -> bytes:
        """A range's bytes: from the store when held or in flight, else fetched now (and
        kept). A range that keeps failing is a `TransientReadError` (the transport: short
        answers, stalls, 5xx) when the object still answers; a 404 or a new ETag say so."""
        data = self.store.take(self.key, offset, size)
        self._client.poke()  # answers to earlier requests move on while this one decodes
        if data is None:
            self.store.start(self, [(offset, size)])
            data = self.store.take(self.key, offset, size)
        if data is not None:
            return data
        with self.store._lock:
            self.store.requests += 1
            self.store.bytes_fetched += size
            self.store.bytes_read += size
        try:
            return self.fetch(offset, size)
        except TransientReadError as exc:
            failure = exc
        message = f"bytes {offset}..{offset + size} keep failing while the object answers"
        if _stalled(failure) and self._client.stalled_said:  # said already: not asked again
            raise TransientReadError(f"bytes {offset}..{offset + size}: {failure}", path=self.url)
        # the store down, or the object gone or changed: a slide fault (raised here)
        try:
            remote_stat(self.url, retries=0, deadline=self.store.deadline_s)
        except TransientReadError as exc:
            if _stalled(exc) and not self._client.stalled_said:
                self._client.stalled_said = True
                log.warning(
                    "the store at %s stopped answering (no answer within %g s): its reads fail "
                    "as transient read errors until it answers again (remote_timeout_s)",
                    urlsplit(self.url).netloc,
                    self.store.deadline_s,
                )
            raise
        if isinstance(failure.__cause__, StatusError):
            # only these bytes, refused by the server: a failed tile (quarantined), raised
            # outside the handler so that it does not carry the transient error as its cause
            raise ValueError(f"{message}: {failure}")
        # short answers, stalls, resets: the transport's, never the tile's or the slide's
        raise TransientReadError(f"{message}: {failure}", path=self.url)

    def prefetch(self, ranges: Iterable[Range]) -> None:
        """Start fetching ``ranges`` in the background (planned, within the budget)."""
        self.store.start(self, ranges)
        self._client.poke()  # the requests go out now


def _stalled(exc: BaseException) -> bool:
    """Whether ``exc`` or what caused it is a request that got no answer in time."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, TimeoutError | concurrent.futures.TimeoutError):
            return True
        seen = seen.__cause__
    return False


def url_digest(url: str) -> str:
    """A short, file-name-safe digest of a URL."""
    return hashlib.blake2b(url.encode(), digest_size=8).hexdigest()
