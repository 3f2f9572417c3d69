"""Where slide bytes come from: a local file, or an object store / web server named by a URL.

Readers ask a byte source for ranges, and say which ranges they will want next (``prefetch``);
no reader knows where its bytes come from.

* Local files: ``pread`` (in the reader); `read_ahead` asks the kernel to read the next
  ranges ahead (``posix_fadvise(WILLNEED)``), so a cold page cache does not stall the decoder.
* `RemoteBytes`: an object read by range requests through the process's `RangeStore`
  (`range_cache`): the ranges of the next batches are planned together (merged by a cost
  model learnt from this store's answers, `request_plan`), fetched concurrently, and kept
  within a byte budget, so a range already held or in flight is never asked again.
* Clients, made in each process when it first asks (a forked worker makes its own):
  ``s3://`` with keys in the environment and ``http(s)://`` go through libcurl
  (`curl_client`: fork-safe, half the CPU per request); other stores (``gs://``, ``az://``,
  S3 with an instance role) through obstore (Rust's object_store), whose runtime does not
  survive fork: `survives_fork` says which.

Faults. Each range request has a deadline and a hedge derived from the latency seen so far
(`request_plan.CostModel`). An answer shorter than the range asked for, a reset, a stall, a 5xx
or 429 is the transport's: retried (`RETRIES` on top of the client's own), then
`TransientReadError`; never a tile or slide fault. A 404 is permanent: not retried, said in
words (`SlideNotFoundError`: which bucket or object is missing); a 403 is access denied. An
object whose ETag changed since it was opened answers 412 to our ``If-Match``: that, and only
that, is a rewritten slide (`SlideChangedError`).

Integrity: range answers carry no checksum in S3, GCS or plain HTTP, so a byte flipped on the
way is caught only by TLS (``https://``, and every S3/GCS/Azure endpoint) or by the decoder;
over plain ``http://`` integrity is the network's. Whole-object downloads (`download`) are
checked against the object's size, and against its MD5 where the ETag is one (S3 objects
uploaded in one part).

Credentials and endpoints come from the storage client's usual environment
(``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_SESSION_TOKEN``, ``AWS_ENDPOINT_URL``,
``AWS_REGION``, ``GOOGLE_APPLICATION_CREDENTIALS``, ...); nothing here stores them.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import fnmatch
import hashlib
import io
import logging
import os
import posixpath
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import timedelta
from email.utils import parsedate_to_datetime
from typing import Any
from urllib.parse import quote, unquote, urlsplit
from xml.etree import ElementTree

from wsi_loader.errors import (
    ForkUnsafeError,
    SlideChangedError,
    SlideNotFoundError,
    SlideOpenError,
    TransientReadError,
)
from wsi_loader.slides import curl_client
from wsi_loader.slides.curl_client import Answer, Endpoint, NetworkError, Request, StalledError
from wsi_loader.slides.range_cache import RangeStore
from wsi_loader.slides.request_plan import MAX_REQUEST, CostModel, Range, coalesce_groups

__all__ = ["MAX_REQUEST", "Range", "RangeStore", "RemoteBytes", "coalesce"]

log = logging.getLogger(__name__)

COALESCE_GAP = 64 * 1024  # `coalesce`'s default (local read-ahead; remote gaps: CostModel)
RETRIES = 2  # our attempts on top of the client's own
BACKOFF_S = 0.1
PARSE_BLOCK = 256 * 1024  # block size of the file object tifffile parses the header through
FETCH_THREADS = 64  # concurrent obstore range requests per process (they wait; GIL released)
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


def survives_fork(url: str) -> bool:
    """Whether a process forked after reading ``url`` can read it too (libcurl's clients are
    made per process; obstore's runtime is not)."""
    return not is_url(url) or curl_client.endpoint_for(url) is not None


FORK_ADVICE = (
    "obstore, which reads slides from gs://, az:// and S3 buckets without keys in the "
    "environment, was used by this process's parent before it forked, and its runtime does not "
    "survive fork(): start the worker processes with multiprocessing_context='forkserver' or "
    "'spawn' (make_loader does so by itself for such slides)"
)


# -- errors -------------------------------------------------------------------------------------
class ShortAnswerError(ConnectionError):
    """An answer with fewer bytes than the range asked for: the transport's fault."""


class StatusError(Exception):
    """An HTTP error status; ``code`` is S3's error code (``NoSuchBucket``...) when given."""

    def __init__(self, status: int, code: str, text: str) -> None:
        super().__init__(f"HTTP {status}{f' {code}' if code else ''}{f': {text}' if text else ''}")
        self.status, self.code, self.text = status, code, text


def _status_error(answer: Answer) -> StatusError:
    code = text = ""
    if answer.body.lstrip().startswith(b"<"):
        try:  # S3's <Error><Code>NoSuchBucket</Code><Message>...</Message></Error>
            root = ElementTree.fromstring(answer.body[:65536])
            code = (root.findtext("Code") or "").strip()
            text = (root.findtext("Message") or "").strip()
        except ElementTree.ParseError:
            pass
    return StatusError(answer.status, code, text[:200])


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
_TRANSIENT_STATUS = frozenset({408, 425, 429, 500, 502, 503, 504})


def _kind(exc: BaseException) -> str:
    """ "missing", "denied", "changed", "no-credentials", "transient" (network or server
    trouble), or "other"."""
    name = type(exc).__name__
    if isinstance(exc, StatusError):
        if exc.status == 404:
            return "missing"
        if exc.status in (401, 403):
            return "denied"
        if exc.status == 412:
            return "changed"
        return "transient" if exc.status in _TRANSIENT_STATUS else "other"
    if name == "NotFoundError" or isinstance(exc, FileNotFoundError):
        return "missing"
    if name == "GenericError" and any(part in str(exc) for part in _METADATA_PATHS):
        return "no-credentials"  # retrying cannot help
    if name in ("PermissionDeniedError", "UnauthenticatedError") or isinstance(
        exc, PermissionError
    ):
        return "denied"
    if name == "PreconditionError":
        return "changed"
    if name == "GenericError" and "non-2xx status code: 404" in str(exc):
        return "missing"  # obstore lists a missing bucket as a generic error
    if name == "GenericError" or isinstance(exc, ConnectionError | TimeoutError):
        return "transient"
    return "other"


def retryable(exc: BaseException) -> bool:
    """Network and server trouble, not a missing object, a refused credential, or a bug."""
    return _kind(exc) == "transient"


def _short(exc: BaseException, limit: int = 500) -> str:
    """An error's message on one line, without the debug dump obstore appends."""
    return " ".join(str(exc).split("Debug source:")[0].split())[:limit]


_CURL_REASONS = {
    6: "the name does not resolve",
    7: "connection refused",
    28: "timed out",
    35: "the TLS handshake failed",
    52: "the server closed the connection without answering",
    56: "the connection was reset",
    60: "its TLS certificate is not trusted",
}


def _network_text(url: str, exc: BaseException) -> str:
    if isinstance(exc, NetworkError):
        parts = urlsplit(url)
        host = parts.netloc if parts.scheme in ("http", "https") else _endpoint_host(url)
        reason = _CURL_REASONS.get(exc.code, _short(exc, 200))
        if exc.code in _CURL_REASONS:
            return f"cannot reach {host} ({reason}: {_short(exc, 200)})"
        return f"network error talking to {host}: {reason}"
    if isinstance(exc, StalledError):
        return f"a request got no answer in time ({exc})"
    if isinstance(exc, ShortAnswerError):
        return f"answers came short ({exc})"
    return f"{type(exc).__name__}: {_short(exc)}"


def _endpoint_host(url: str) -> str:
    endpoint = curl_client.endpoint_for(url)
    return urlsplit(endpoint.base).netloc if endpoint is not None else urlsplit(url).netloc


def _failure(url: str, what: str, exc: BaseException, attempts: int) -> Exception:
    kind = _kind(exc)
    text = _short(exc)
    if kind == "missing":
        if isinstance(exc, StatusError) and exc.code == "NoSuchBucket":
            bucket = urlsplit(url).netloc
            return SlideNotFoundError(f"the bucket {bucket!r} does not exist", path=url)
        if "NoSuchBucket" in text:  # obstore's
            bucket = urlsplit(url).netloc
            return SlideNotFoundError(f"the bucket {bucket!r} does not exist", path=url)
        return SlideNotFoundError(f"the object {_key(url)!r} does not exist", path=url)
    if kind == "denied":
        return SlideOpenError(f"access denied: {text}", path=url)
    if kind == "changed":
        return SlideChangedError(
            "the object was rewritten since it was opened (its ETag changed); rebuild the index",
            path=url,
        )
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
            f"{what} failed after {attempts} attempts: {_network_text(url, exc)}", path=url
        )
    if isinstance(exc, StatusError) or type(exc).__module__.startswith("obstore"):
        return SlideOpenError(f"{what}: {_network_text(url, exc)}", path=url)
    return exc if isinstance(exc, Exception) else RuntimeError(str(exc))


def with_retries(url: str, what: str, call: Callable[[], Any], retries: int = RETRIES) -> Any:
    """``call()``, again (after the client's own retries) when it fails for a network
    reason."""
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
    etag: str | None = None  # the strong ETag as sent (quoted), for If-Match


# -- the clients of a process -------------------------------------------------------------------
class _CurlStore:
    """S3 (keys in the environment) and plain HTTP(S) through libcurl."""

    def __init__(self, endpoint: Endpoint, transfers: curl_client.Transfers) -> None:
        self.endpoint = endpoint
        self.transfers = transfers
        self.model = CostModel()

    def _request(self, method: str, url: str, **options: Any) -> Request:
        key = unquote(urlsplit(url).path).lstrip("/")
        return Request(
            method,
            self.endpoint.object_url(key),
            headers=self.endpoint.headers() + options.pop("headers", []),
            sigv4=self.endpoint.sigv4,
            credentials=self.endpoint.credentials,
            **options,
        )

    def head(self, url: str) -> RemoteStat:
        answer = self.transfers.request(self._request("HEAD", url, deadline=60.0))
        if answer.status >= 300:
            if answer.status == 404 and self.endpoint.list_url:  # which is missing?
                answer = self._bucket_check(answer)
            raise _status_error(answer)
        headers = answer.headers
        if "content-length" not in headers:
            raise StatusError(answer.status, "", "the server gave no Content-Length")
        mtime_ns = 0
        if "last-modified" in headers:
            with contextlib.suppress(TypeError, ValueError):
                mtime_ns = int(parsedate_to_datetime(headers["last-modified"]).timestamp() * 1e9)
        etag = headers.get("etag")
        strong = etag if etag and not etag.startswith("W/") else None
        version = (etag or "").strip('"') or str(mtime_ns)
        return RemoteStat(int(headers["content-length"]), mtime_ns, version, strong)

    def _bucket_check(self, answer: Answer) -> Answer:
        """A HEAD has no body to say what is missing: ask the bucket (one cheap listing)."""
        assert self.endpoint.list_url is not None
        probe = Request(
            "GET",
            f"{self.endpoint.list_url}?list-type=2&max-keys=0",
            headers=self.endpoint.headers(),
            sigv4=self.endpoint.sigv4,
            credentials=self.endpoint.credentials,
            deadline=60.0,
        )
        listed = self.transfers.request(probe)
        return listed if listed.status == 404 else answer

    def submit(
        self, url: str, offset: int, size: int, etag: str | None
    ) -> concurrent.futures.Future[bytes]:
        """One range request (no retries: the caller's), hedged and bounded by the model."""
        request = self._request(
            "GET",
            url,
            headers=[f"If-Match: {etag}"] if etag else [],
            byte_range=(offset, size),
            hedge_after=self.model.hedge_after(size),
            deadline=self.model.deadline(size),
        )
        started = time.monotonic()
        out: concurrent.futures.Future[bytes] = concurrent.futures.Future()
        answer = self.transfers.submit(request)

        def done(future: concurrent.futures.Future[Answer]) -> None:
            try:
                data = self._range_body(future.result(), offset, size)
            except BaseException as exc:  # handed to whoever waits
                out.set_exception(exc)
                return
            if len(future.result().body) == size and not request_hedged(future):
                self.model.observe(size, time.monotonic() - started)
            out.set_result(data)

        def request_hedged(_: concurrent.futures.Future[Answer]) -> bool:
            return time.monotonic() - started > (request.hedge_after or float("inf"))

        answer.add_done_callback(done)
        return out

    @staticmethod
    def _range_body(answer: Answer, offset: int, size: int) -> bytes:
        if answer.status == 206:
            body = answer.body
        elif answer.status == 200:  # a server that ignores Range sends it all
            body = answer.body[offset : offset + size]
        else:
            raise _status_error(answer)
        if len(body) != size:
            raise ShortAnswerError(f"{len(body)} of {size} bytes at {offset}")
        return body

    def download(self, url: str, dest: str, size: int, etag: str | None) -> None:
        md5 = hashlib.md5(usedforsecurity=False)
        trouble: list[OSError] = []  # the disk's (full, over quota): said as it is, not retried
        with open(dest, "wb") as fh:

            def sink(chunk: bytes) -> int | None:
                try:
                    fh.write(chunk)
                except OSError as exc:
                    trouble.append(exc)
                    return 0  # libcurl stops the transfer
                md5.update(chunk)
                return None

            request = self._request("GET", url, sink=sink, low_speed=True)
            try:
                answer = self.transfers.request(request)
            except NetworkError:
                if trouble:
                    raise trouble[0] from None
                raise
        if answer.status != 200:
            raise _status_error(answer)
        got = os.path.getsize(dest)
        if got != size:
            raise ShortAnswerError(f"the download is {got} bytes where the object has {size}")
        plain = (etag or "").strip('"')
        is_md5 = len(plain) == 32 and all(c in "0123456789abcdef" for c in plain.lower())
        if is_md5 and md5.hexdigest() != plain.lower():  # a one-part S3 upload's ETag is its MD5
            raise ShortAnswerError("the download's MD5 is not the object's ETag")

    def list(self, url: str, prefix: str) -> list[str]:
        if self.endpoint.list_url is None:
            raise SlideOpenError("plain web servers cannot be listed", path=url)
        keys: list[str] = []
        token = ""
        while True:
            query = f"list-type=2&prefix={quote(prefix, safe='')}"
            if token:
                query += f"&continuation-token={quote(token, safe='')}"
            answer = self.transfers.request(
                Request(
                    "GET",
                    f"{self.endpoint.list_url}?{query}",
                    headers=self.endpoint.headers(),
                    sigv4=self.endpoint.sigv4,
                    credentials=self.endpoint.credentials,
                    deadline=120.0,
                )
            )
            if answer.status != 200:
                raise _status_error(answer)
            root = ElementTree.fromstring(answer.body)
            space = root.tag.partition("}")[0] + "}" if root.tag.startswith("{") else ""
            keys += [e.findtext(f"{space}Key") or "" for e in root.iter(f"{space}Contents")]
            token = root.findtext(f"{space}NextContinuationToken") or ""
            if root.findtext(f"{space}IsTruncated") != "true" or not token:
                return keys


class _ObStore:
    """Any other store, through obstore (not fork-safe)."""

    def __init__(self, store: Any, clients: _Clients) -> None:
        self.store = store
        self.clients = clients
        self.model = CostModel()

    def head(self, url: str) -> RemoteStat:
        import obstore

        meta = obstore.head(self.store, _key(url))
        modified = meta.get("last_modified")
        mtime_ns = int(modified.timestamp() * 1e9) if hasattr(modified, "timestamp") else 0
        version = str(meta.get("e_tag") or meta.get("version") or mtime_ns).strip('"')
        return RemoteStat(size=int(meta["size"]), mtime_ns=mtime_ns, version=version)

    def get(self, url: str, offset: int, size: int) -> bytes:
        import obstore

        data = bytes(obstore.get_range(self.store, _key(url), start=offset, end=offset + size))
        if len(data) != size:
            raise ShortAnswerError(f"{len(data)} of {size} bytes at {offset}")
        return data

    def submit(
        self, url: str, offset: int, size: int, etag: str | None
    ) -> concurrent.futures.Future[bytes]:
        return self.clients.pool().submit(self.get, url, offset, size)

    def download(self, url: str, dest: str, size: int, etag: str | None) -> None:
        import obstore

        with open(dest, "wb") as fh:
            for chunk in obstore.get(self.store, _key(url)).stream(min_chunk_size=8 * 2**20):
                fh.write(chunk)
        got = os.path.getsize(dest)
        if got != size:
            raise ShortAnswerError(f"the download is {got} bytes where the object has {size}")

    def list(self, url: str, prefix: str) -> list[str]:
        import obstore

        return [
            str(meta["path"])
            for batch in obstore.list(self.store, prefix=prefix.rsplit("/", 1)[0] or None)
            for meta in batch
        ]


def _key(url: str) -> str:
    return unquote(urlsplit(url).path).lstrip("/")


Client = _CurlStore | _ObStore


class _Clients:
    """The clients of this process, by ``scheme://bucket``, made when first asked for; a
    forked child makes its own (`_here`). obstore's runtime cannot be remade: a child forked
    after its parent used obstore refuses to (`ForkUnsafeError`) instead of hanging."""

    def __init__(self, inherited: bool = False) -> None:
        self.inherited = inherited  # the parent used obstore before forking this process
        self.used_obstore = False
        self.pid = os.getpid()
        self.clients: dict[str, Client] = {}
        self.transfers: curl_client.Transfers | None = None
        self.threads: concurrent.futures.ThreadPoolExecutor | None = None
        self.lock = threading.Lock()

    def client(self, url: str) -> Client:
        parts = urlsplit(url)
        if not parts.netloc:
            raise SlideOpenError("a URL needs a bucket or host", path=url)
        root = f"{parts.scheme}://{parts.netloc}"
        with self.lock:
            found = self.clients.get(root)
            if found is None:
                found = self.clients[root] = self._make(root, url)
            return found

    def _make(self, root: str, url: str) -> Client:
        endpoint = curl_client.endpoint_for(url)
        if endpoint is not None:
            try:
                if self.transfers is None:
                    self.transfers = curl_client.Transfers()
            except ImportError as exc:  # an optional dependency
                raise SlideOpenError(
                    "reading slides from URLs needs pycurl (pip install 'wsi_loader[remote]')",
                    path=url,
                ) from exc
            return _CurlStore(endpoint, self.transfers)
        if self.inherited:
            raise ForkUnsafeError(FORK_ADVICE)
        self.used_obstore = True
        try:
            from obstore.store import from_url
        except ImportError as exc:  # an optional dependency
            raise SlideOpenError(
                "reading slides from this store needs obstore (pip install 'wsi_loader[remote]')",
                path=url,
            ) from exc
        try:
            store = from_url(root, client_options=CLIENT_OPTIONS, retry_config=RETRY_CONFIG)
        except Exception as exc:  # an unknown scheme, a bad configuration
            advice = _CREDENTIALS_ADVICE.get(urlsplit(url).scheme, "")
            hint = f"; {advice}" if "Account must be specified" in str(exc) else ""
            raise SlideOpenError(f"cannot open this URL: {_short(exc)}{hint}", path=url) from exc
        return _ObStore(store, self)

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
        clients = _current["clients"] = _Clients(clients.used_obstore or clients.inherited)
    return clients


def client_for(url: str) -> Client:
    """This process's client of ``url``'s store."""
    return _here().client(url)


def remote_stat(url: str, retries: int = RETRIES) -> RemoteStat:
    """Size, modification time and version of an object; `SlideNotFoundError` when it does
    not exist, `TransientReadError` when the store cannot be reached."""
    client = client_for(url)
    return with_retries(url, "metadata request", lambda: client.head(url), retries)  # type: ignore[no-any-return]


def read_range(url: str, offset: int, size: int, retries: int = RETRIES) -> bytes:
    """Bytes ``offset`` .. ``offset + size`` of an object (with retries)."""
    client = client_for(url)
    return with_retries(  # type: ignore[no-any-return]
        url, "range read", lambda: client.submit(url, offset, size, None).result(), retries
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
    path = _key(url)
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
    """The first and last 64 KiB of an object (two range requests), as `inputs._head_tail`."""
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
        self.stat = remote_stat(url, retries)

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
        future = self._client.submit(self.url, offset, size, self.stat.etag)
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
        # the store down, or the object gone or changed: a slide fault (raised here)
        remote_stat(self.url, retries=0)
        message = f"bytes {offset}..{offset + size} keep failing while the object answers"
        if isinstance(failure.__cause__, StatusError):
            # only these bytes, refused by the server: a failed tile (quarantined), raised
            # outside the handler so that it does not carry the transient error as its cause
            raise ValueError(f"{message}: {failure}")
        # short answers, stalls, resets: the transport's, never the tile's or the slide's
        raise TransientReadError(f"{message}: {failure}", path=self.url)

    def prefetch(self, ranges: Iterable[Range]) -> None:
        """Start fetching ``ranges`` in the background (planned, within the budget)."""
        self.store.start(self, ranges)


def url_digest(url: str) -> str:
    """A short, file-name-safe digest of a URL."""
    return hashlib.blake2b(url.encode(), digest_size=8).hexdigest()
