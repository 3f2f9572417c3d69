"""The clients that fetch remote bytes, one set per process (see `storage`): libcurl's for
``s3://`` with keys in the environment and ``http(s)://`` (`_curl`), obstore's for the
rest. `client_for` hands out this process's client of a URL's store, making it when first asked
for; a forked child makes its own."""

from __future__ import annotations

import concurrent.futures
import contextlib
import hashlib
import ipaddress
import logging
import os
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from email.utils import parsedate_to_datetime
from typing import Any
from urllib.parse import quote, urlsplit
from xml.etree import ElementTree

from wsi_loader.errors import ForkUnsafeError, SlideOpenError
from wsi_loader.slides.storage import _curl
from wsi_loader.slides.storage._curl import Answer, Endpoint, NetworkError, Request
from wsi_loader.slides.storage._range_cache import DEFAULT_DEADLINE_S
from wsi_loader.slides.storage._remote_errors import (
    CREDENTIALS_ADVICE,
    ShortAnswerError,
    StatusError,
    check_content_range,
    object_key,
    short,
    status_error,
)
from wsi_loader.slides.storage._request_plan import CostModel

log = logging.getLogger(__name__)

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


FORK_ADVICE = (
    "obstore, which reads slides from gs://, az:// and S3 buckets without keys in the "
    "environment, was used by this process's parent before it forked, and its runtime does not "
    "survive fork(): start the worker processes with multiprocessing_context='forkserver' or "
    "'spawn' (make_loader does so by itself for such slides)"
)


@dataclass(frozen=True)
class RemoteStat:
    size: int
    mtime_ns: int
    version: str  # ETag (or last-modified) of the object: changes when it is rewritten
    etag: str | None = None  # the strong ETag as sent (quoted), for If-Match


# -- the clients of a process -------------------------------------------------------------------
class _CurlStore:
    """S3 (keys in the environment) and plain HTTP(S) through libcurl."""

    def __init__(self, endpoint: Endpoint, transfers: _curl.Transfers) -> None:
        self.endpoint = endpoint
        self.transfers = transfers
        self.model = CostModel()
        self._urls: dict[str, tuple[str, str, str]] = {}  # slide URL -> (URL, host, path)
        self.stalled_said = False  # the WARNING that the store stopped answering, given

    def _request(self, method: str, url: str, **options: Any) -> Request:
        """A request for the object of ``url``, signed when the store wants it."""
        target, headers = self._target(method, url)
        return Request(method, target, headers=headers + options.pop("headers", []), **options)

    def _target(self, method: str, url: str) -> tuple[str, list[str]]:
        """The URL to ask for the object of ``url``, and the headers that sign the request."""
        found = self._urls.get(url)
        if found is None:
            if len(self._urls) >= 4096:  # an archive of many slides: keep it small
                self._urls.clear()
            target = self.endpoint.object_url(object_key(url))
            parts = urlsplit(target)
            found = self._urls[url] = (target, parts.netloc, parts.path)
        target, host, path = found
        signer = self.endpoint.signer
        return target, [] if signer is None else signer.headers(method, host, path)

    def head(self, url: str, deadline: float = DEFAULT_DEADLINE_S) -> RemoteStat:
        answer = self.transfers.request(self._request("HEAD", url, deadline=deadline))
        if answer.status >= 300:
            if answer.status == 404 and self.endpoint.list_url:  # which is missing?
                answer = self._bucket_check(answer)
            raise status_error(answer)
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
        self,
        url: str,
        offset: int,
        size: int,
        etag: str | None,
        deadline: float = DEFAULT_DEADLINE_S,
    ) -> concurrent.futures.Future[bytes]:
        """One range request (no retries: the caller's), hedged and bounded by the model, and
        by ``deadline`` seconds at most."""
        model = self.model
        hedge_after = model.hedge_after(size)
        started = time.monotonic()

        def finish(answer: Answer) -> bytes:  # in the thread that drives the transfers
            data = self._range_body(answer, offset, size)
            taken = time.monotonic() - started
            if len(answer.body) == size and taken <= hedge_after:  # whole, and not hedged
                model.observe(size, taken)
            return data

        target, headers = self._target("GET", url)
        request = Request(
            "GET",
            target,
            headers=[*headers, f"If-Match: {etag}"] if etag else headers,
            byte_range=(offset, size),
            hedge_after=hedge_after,
            deadline=min(model.deadline(size), deadline),
            finish=finish,
        )
        future: concurrent.futures.Future[bytes] = self.transfers.submit(request)
        return future

    @staticmethod
    def _range_body(answer: Answer, offset: int, size: int) -> bytes:
        if answer.status == 206:
            check_content_range(answer.headers.get("content-range"), offset, size)
            body = answer.body
        elif answer.status == 200:  # a server that ignores Range sends it all
            body = answer.body[offset : offset + size]
        else:
            raise status_error(answer)
        if len(body) != size:
            raise ShortAnswerError(f"{len(body)} of {size} bytes at {offset}")
        return body

    def poke(self) -> None:
        """Send what was submitted, take in what arrived (see `_curl.Transfers`)."""
        self.transfers.poke()

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
            raise status_error(answer)
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
                raise status_error(answer)
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
        self.stalled_said = False

    def head(self, url: str, deadline: float = DEFAULT_DEADLINE_S) -> RemoteStat:
        import obstore

        meta = obstore.head(self.store, object_key(url))
        modified = meta.get("last_modified")
        mtime_ns = int(modified.timestamp() * 1e9) if hasattr(modified, "timestamp") else 0
        version = str(meta.get("e_tag") or meta.get("version") or mtime_ns).strip('"')
        return RemoteStat(size=int(meta["size"]), mtime_ns=mtime_ns, version=version)

    def get(self, url: str, offset: int, size: int) -> bytes:
        import obstore

        key = object_key(url)
        data = bytes(obstore.get_range(self.store, key, start=offset, end=offset + size))
        if len(data) != size:
            raise ShortAnswerError(f"{len(data)} of {size} bytes at {offset}")
        return data

    def submit(
        self,
        url: str,
        offset: int,
        size: int,
        etag: str | None,
        deadline: float = DEFAULT_DEADLINE_S,
    ) -> concurrent.futures.Future[bytes]:
        """(obstore's own timeouts apply: `CLIENT_OPTIONS`)"""
        return self.clients.pool().submit(self.get, url, offset, size)

    def poke(self) -> None:
        """Nothing to do: obstore's requests run on threads."""

    def download(self, url: str, dest: str, size: int, etag: str | None) -> None:
        import obstore

        with open(dest, "wb") as fh:
            for chunk in obstore.get(self.store, object_key(url)).stream(min_chunk_size=8 * 2**20):
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
        self.transfers: _curl.Transfers | None = None
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
        endpoint = _curl.endpoint_for(url)
        if endpoint is not None:
            try:
                if self.transfers is None:
                    self.transfers = _curl.Transfers()
            except ImportError as exc:  # an optional dependency
                raise SlideOpenError(
                    "reading slides from URLs needs pycurl (pip install 'wsi_loader[remote]')",
                    path=url,
                ) from exc
            warning = plain_http_warning(root)
            if warning is not None:
                log.warning(warning)
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
            advice = CREDENTIALS_ADVICE.get(urlsplit(url).scheme, "")
            hint = f"; {advice}" if "Account must be specified" in str(exc) else ""
            raise SlideOpenError(f"cannot open this URL: {short(exc)}{hint}", path=url) from exc
        return _ObStore(store, self)

    def pool(self) -> concurrent.futures.ThreadPoolExecutor:
        with self.lock:
            if self.threads is None:
                self.threads = concurrent.futures.ThreadPoolExecutor(
                    FETCH_THREADS, thread_name_prefix="wsi-fetch"
                )
            return self.threads


def plain_http_warning(url: str) -> str | None:
    """What to say when slides are read over plain ``http://`` from another machine (nothing
    checks a range's bytes then: TLS is what does), or None (https, or this machine)."""
    parts = urlsplit(url)
    if parts.scheme.lower() != "http":
        return None
    host = (parts.hostname or "").lower()
    if host == "localhost" or host.endswith(".localhost"):
        return None
    with contextlib.suppress(ValueError):
        if ipaddress.ip_address(host).is_loopback:
            return None
    return (
        f"slides are read over plain http from {parts.netloc}: nothing checks that the bytes "
        "of a range arrive as sent (bits flipped on the way decode as wrong pixels); use "
        "https:// where the server has it"
    )


_current = {"clients": _Clients()}


def _here() -> _Clients:
    clients = _current["clients"]
    if clients.pid != os.getpid():
        clients = _current["clients"] = _Clients(clients.used_obstore or clients.inherited)
    return clients


def client_for(url: str) -> Client:
    """This process's client of ``url``'s store."""
    return _here().client(url)
