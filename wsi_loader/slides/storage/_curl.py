"""Fork-safe HTTP for slides in S3 buckets and on web servers: libcurl's multi interface
(pycurl), one per process, made when first needed and driven by the threads that wait.

Why libcurl and not obstore here: obstore's Rust runtime is made once per process and does not
survive fork() (a child of a process that used it panics or hangs), so make_loader had to start
its workers another way, and a script without ``if __name__ == "__main__":`` failed. A libcurl
multi handle is plain C state: each process makes its own when it first asks for bytes, so
workers fork as they do for local slides. It also costs less client CPU per range request
than obstore driven from threads or Python's http.client (benchmarks/README.md, "Range
requests").

`Transfers` runs the requests of a process. Each request may carry ``hedge_after`` (a second,
identical request goes out when the first is slower than that: the first answer wins, the other
is dropped) and ``deadline`` (every attempt still running then is dropped and the request fails
with `StalledError`); both come from the latency seen so far (`_request_plan.CostModel`).

S3 requests are signed (AWS Signature V4: object requests by `_sigv4.Signer`, which keeps the
day's signing key; listings by libcurl) with the keys of the standard environment
(``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_SESSION_TOKEN``, ``AWS_ENDPOINT_URL``,
``AWS_REGION``/``AWS_DEFAULT_REGION``); stores whose credentials come from elsewhere (an instance
role, GCS, Azure) are read through obstore (`_remote`).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import selectors
import ssl
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote, urlsplit

from wsi_loader.slides.storage._sigv4 import Signer

CONNECT_TIMEOUT_S = 10
RECEIVE_BUFFER = 64 * 1024  # bytes libcurl reads from a socket at once (its default: 16 KiB)
WATCH_S = 0.005  # how often waiting drivers look at the sockets and for requests to hedge


class NetworkError(ConnectionError):
    """A request that got no complete answer: refused, reset, a name that does not resolve."""

    def __init__(self, message: str, code: int = 0) -> None:
        super().__init__(message)
        self.code = code


class StalledError(TimeoutError):
    """No answer within the request's deadline (from the latency seen so far, at most the
    store's request deadline)."""


@dataclass
class Answer:
    status: int
    headers: dict[str, str]
    body: bytes


@dataclass
class Request:
    """One HTTP request: ``url`` already encoded; ``sink`` receives the body (a download)
    instead of memory."""

    method: str
    url: str
    headers: list[str] = field(default_factory=list)
    byte_range: tuple[int, int] | None = None  # (offset, size)
    sigv4: str | None = None  # libcurl's AWS_SIGV4 ("aws:amz:REGION:s3")
    credentials: tuple[str, str] | None = None  # (key, secret)
    hedge_after: float | None = None  # seconds
    deadline: float | None = None  # seconds from the start
    sink: Callable[[bytes], int | None] | None = None  # returns 0 to stop
    low_speed: bool = False  # fail when under 1 kB/s for 60 s (long downloads, no deadline)
    # the future's result made of the answer, in the driving thread (what it raises is the
    # future's exception): one future per range request, not one more chained to it
    finish: Callable[[Answer], Any] | None = None


class _Attempt:
    __slots__ = ("chunks", "handle", "headers", "job", "status")

    def __init__(self, job: _Job, handle: Any) -> None:
        self.job, self.handle = job, handle
        self.chunks: list[bytes] = []  # the body as libcurl hands it over (joined once)
        self.headers: dict[str, str] = {}
        self.status = 0


class _Job:
    __slots__ = ("attempts", "failures", "future", "hedged", "request", "started")

    def __init__(self, request: Request, future: Pending) -> None:
        self.request = request
        self.future = future
        self.attempts: list[_Attempt] = []
        self.started = 0.0
        self.hedged = False
        self.failures: list[NetworkError] = []


def _ca_file() -> str | None:
    paths = ssl.get_default_verify_paths()  # honours SSL_CERT_FILE
    for path in (paths.cafile, paths.openssl_cafile):
        if path and os.path.exists(path):
            return path
    return None


class Pending(concurrent.futures.Future[Any]):
    """A request's future whose waiters drive the transfers (see `Transfers`)."""

    def __init__(self, transfers: Transfers) -> None:
        super().__init__()
        self._transfers = transfers

    def result(self, timeout: float | None = None) -> Any:
        self._transfers.drive_until(self, timeout)
        return super().result(0)

    def exception(self, timeout: float | None = None) -> BaseException | None:
        self._transfers.drive_until(self, timeout)
        return super().exception(0)


class Transfers:
    """The HTTP requests of one process, over one libcurl multi handle (its connections are
    kept alive and reused). Make one per process (`_remote` keeps one per pid); never
    use one made before a fork.

    No thread of its own: whoever waits for an answer (`Pending.result`) drives libcurl, and
    `submit` sends what it can at once. Answers that arrive while nobody waits sit in the
    kernel's socket buffers until the next drive, which `poke` gives cheaply from the reading
    path. A thread that ran the transfers would cost the reader a GIL hand-over per answer,
    about doubling the client CPU of a range (benchmarks/README.md, "Range requests").

    libcurl is driven through its socket interface (``curl_multi_socket_action``): it tells
    us which sockets to watch (`_on_socket`) and when to wake it (`_on_timer`), and we wake it
    only for the sockets that are ready. ``curl_multi_perform`` instead walks every request in
    flight on every call, each with a ``recv`` that finds nothing: with a look-ahead's many
    ranges in flight, many failed ``recv`` calls per answered request.
    """

    def __init__(self) -> None:
        import pycurl

        self._curl = pycurl
        self.pid = os.getpid()
        self._drive = threading.RLock()  # one thread at a time drives libcurl
        self._active: dict[Any, _Attempt] = {}
        self._spare: list[Any] = []
        self._ca = _ca_file()
        self._sockets = selectors.DefaultSelector()  # what libcurl asked us to watch
        self._timer_at: float | None = None  # when libcurl wants to be woken (monotonic)
        self._multi = pycurl.CurlMulti()
        self._multi.setopt(pycurl.M_SOCKETFUNCTION, self._on_socket)
        self._multi.setopt(pycurl.M_TIMERFUNCTION, self._on_timer)
        self._next_watch = 0.0
        self._last_drive = 0.0
        self._unsent = False  # requests added since the last drive
        self.hedges = 0  # second requests sent for slow ones
        self.stalls = 0  # requests given up at their deadline

    def pending(self) -> Pending:
        """A future that waiting on drives these transfers."""
        return Pending(self)

    def submit(self, request: Request) -> Pending:
        """Queue a request in libcurl; it goes out at the next drive (`poke`, or a wait)."""
        job = _Job(request, self.pending())
        with self._drive:
            job.started = time.monotonic()
            self._start(job)
            self._unsent = True
        return job.future

    def request(self, request: Request) -> Answer:
        answer: Answer = self.submit(request).result()
        return answer

    def poke(self) -> None:
        """Move the transfers on without waiting: requests submitted since the last drive go
        out; otherwise at most every `WATCH_S` (called on the reading path, so that answers
        do not wait in socket buffers for long)."""
        due = self._unsent or time.monotonic() - self._last_drive > WATCH_S
        if self._active and due and self._drive.acquire(blocking=False):
            try:
                self._step(0.0)
            finally:
                self._drive.release()

    def drive_until(self, future: concurrent.futures.Future[Any], timeout: float | None) -> None:
        """Drive the transfers until ``future`` is done (another thread may be driving: then
        wait for it a little and try again); `TimeoutError` after ``timeout`` seconds."""
        end = None if timeout is None else time.monotonic() + timeout
        while not future.done():
            left = None if end is None else end - time.monotonic()
            if left is not None and left <= 0:
                raise concurrent.futures.TimeoutError()
            wait = WATCH_S if left is None else min(WATCH_S, left)
            if self._drive.acquire(blocking=False):
                try:
                    self._step(wait if self._active else 0.0)
                    idle = not self._active
                finally:
                    self._drive.release()
                if idle and not future.done():  # nothing of ours in flight: a derived future
                    concurrent.futures.wait([future], timeout=wait)
            else:
                concurrent.futures.wait([future], timeout=wait)

    # -- libcurl's socket interface (callbacks run inside socket_action, lock held) ----------
    def _on_socket(self, what: int, fd: int, multi: Any, data: Any) -> None:
        pycurl = self._curl
        if what == pycurl.POLL_REMOVE:
            with contextlib.suppress(KeyError, ValueError, OSError):
                self._sockets.unregister(fd)
            return
        events = (selectors.EVENT_READ if what & pycurl.POLL_IN else 0) | (
            selectors.EVENT_WRITE if what & pycurl.POLL_OUT else 0
        )
        try:
            self._sockets.modify(fd, events)
        except KeyError:  # not watched yet
            self._sockets.register(fd, events)

    def _on_timer(self, milliseconds: int) -> None:
        self._timer_at = None if milliseconds < 0 else time.monotonic() + milliseconds / 1000

    def _on_timeout(self) -> None:
        """Wake libcurl for its timers when they are due (new requests are due at once)."""
        if self._timer_at is not None and time.monotonic() >= self._timer_at:
            self._timer_at = None  # libcurl sets the next one
            self._multi.socket_action(self._curl.SOCKET_TIMEOUT, 0)

    def _step(self, wait: float) -> None:
        """One turn of libcurl (lock held): send what is due, take in what the ready sockets
        hold, hand out the answers, hedge or give up slow requests; ``wait`` is how long to
        wait for a socket at most."""
        pycurl, selector = self._curl, self._sockets
        self._unsent = False
        self._on_timeout()
        if self._timer_at is not None:
            wait = min(wait, max(0.0, self._timer_at - time.monotonic()))
        ready = selector.select(wait) if selector.get_map() else ()
        if not ready and wait > 0 and not selector.get_map():
            time.sleep(wait)  # only a timer to wait for (a connection being made, a retry)
        for key, events in ready:
            flags = (pycurl.CSELECT_IN if events & selectors.EVENT_READ else 0) | (
                pycurl.CSELECT_OUT if events & selectors.EVENT_WRITE else 0
            )
            self._multi.socket_action(key.fd, flags)
        self._on_timeout()
        self._collect()
        now = time.monotonic()
        if now >= self._next_watch:
            self._watch(now)
            self._next_watch = now + WATCH_S
        self._last_drive = now

    def _collect(self) -> int:
        answered = 0
        while True:
            left, done, failed = self._multi.info_read()
            for handle in done:
                self._finish(handle, None)
            for handle, code, message in failed:
                self._finish(handle, (code, message))
            answered += len(done) + len(failed)
            if not left:
                return answered

    def _handle(self) -> Any:
        pycurl = self._curl
        handle = self._spare.pop() if self._spare else pycurl.Curl()
        handle.reset()
        handle.setopt(pycurl.CONNECTTIMEOUT, CONNECT_TIMEOUT_S)
        handle.setopt(pycurl.NOSIGNAL, 1)
        # a tile's range (10-60 KB) in one read and one call of the write function, not 2-4
        handle.setopt(pycurl.BUFFERSIZE, RECEIVE_BUFFER)
        if self._ca is not None:
            handle.setopt(pycurl.CAINFO, self._ca)
        return handle

    def _start(self, job: _Job) -> None:
        pycurl, request = self._curl, job.request
        handle = self._handle()
        attempt = _Attempt(job, handle)
        handle.setopt(pycurl.URL, request.url)
        if request.method == "HEAD":
            handle.setopt(pycurl.NOBODY, 1)
        elif request.method != "GET":
            handle.setopt(pycurl.CUSTOMREQUEST, request.method)
        if request.byte_range is not None:
            offset, size = request.byte_range
            handle.setopt(pycurl.RANGE, f"{offset}-{offset + size - 1}")
        if request.headers:
            handle.setopt(pycurl.HTTPHEADER, request.headers)
        if request.sigv4 and request.credentials:
            handle.setopt(pycurl.AWS_SIGV4, request.sigv4)
            handle.setopt(pycurl.USERNAME, request.credentials[0])
            handle.setopt(pycurl.PASSWORD, request.credentials[1])
        if request.low_speed:
            handle.setopt(pycurl.LOW_SPEED_LIMIT, 1024)
            handle.setopt(pycurl.LOW_SPEED_TIME, 60)
            handle.setopt(pycurl.BUFFERSIZE, 512 * 1024)
        handle.setopt(pycurl.WRITEFUNCTION, request.sink or attempt.chunks.append)
        if request.method == "HEAD":
            handle.setopt(pycurl.HEADERFUNCTION, lambda line: self._header(attempt, line))
        elif request.byte_range is not None:  # the status (getinfo) and Content-Range
            handle.setopt(pycurl.HEADERFUNCTION, lambda line: self._range_header(attempt, line))
        self._multi.add_handle(handle)
        self._active[handle] = attempt
        job.attempts.append(attempt)

    @staticmethod
    def _header(attempt: _Attempt, line: bytes) -> None:
        text = line.decode("latin-1").strip()
        if text.startswith("HTTP/"):
            attempt.headers = {}  # a new answer (after a 100 Continue or a redirect)
            parts = text.split(" ", 2)
            attempt.status = int(parts[1]) if len(parts) > 1 and parts[1].isdigit() else 0
        elif ":" in text:
            name, _, value = text.partition(":")
            attempt.headers[name.strip().lower()] = value.strip()

    @staticmethod
    def _range_header(attempt: _Attempt, line: bytes) -> None:
        """Keep only Content-Range (of the last answer: a 100 Continue or redirect comes first)."""
        if line[:5] == b"HTTP/":
            attempt.headers = {}
        elif line[:14].lower() == b"content-range:":
            attempt.headers["content-range"] = line[14:].decode("latin-1").strip()

    def _drop(self, attempt: _Attempt) -> None:
        handle = attempt.handle
        if self._active.pop(handle, None) is not None:
            self._multi.remove_handle(handle)
            if len(self._spare) < 64:
                self._spare.append(handle)

    def _finish(self, handle: Any, failure: tuple[int, str] | None) -> None:
        attempt = self._active.get(handle)
        if attempt is None:
            return
        job = attempt.job
        self._drop(attempt)
        if job.future.done():
            return
        if failure is not None:
            job.failures.append(NetworkError(failure[1], failure[0]))
            if any(a.handle in self._active for a in job.attempts):
                return  # the other attempt may still answer
            job.future.set_exception(job.failures[0])
        else:
            for other in job.attempts:  # the first answer wins
                self._drop(other)
            status = attempt.status or int(handle.getinfo(self._curl.RESPONSE_CODE))
            answer = Answer(status, attempt.headers, b"".join(attempt.chunks))
            finish = job.request.finish
            if finish is None:
                job.future.set_result(answer)
                return
            try:
                result = finish(answer)
            except Exception as exc:  # handed to whoever waits
                job.future.set_exception(exc)
            else:
                job.future.set_result(result)

    def _watch(self, now: float) -> None:
        """Hedge slow requests; give up those past their deadline."""
        jobs = {id(a.job): a.job for a in self._active.values()}
        for job in jobs.values():
            request, elapsed = job.request, now - job.started
            if request.deadline is not None and elapsed > request.deadline:
                for attempt in job.attempts:
                    self._drop(attempt)
                self.stalls += 1
                if not job.future.done():
                    host = urlsplit(request.url).netloc
                    job.future.set_exception(
                        StalledError(f"no answer from {host} within {request.deadline:.1f} s")
                    )
            elif (
                request.hedge_after is not None
                and not job.hedged
                and elapsed > request.hedge_after
                and request.sink is None
            ):
                job.hedged = True
                self.hedges += 1
                self._start(job)


# -- S3 and plain HTTP requests -----------------------------------------------------------------
@dataclass(frozen=True)
class Endpoint:
    """Where the objects of one ``scheme://bucket`` (or web server) are, and how to sign."""

    base: str  # URL prefix that object keys (encoded) are appended to
    sigv4: str | None = None  # libcurl's signing, for requests with a query (listings)
    credentials: tuple[str, str] | None = None
    token: str | None = None  # AWS_SESSION_TOKEN
    list_url: str | None = None  # S3: the bucket's URL for ListObjectsV2
    signer: Signer | None = None  # S3: signs object requests (HEAD, GET), see `_sigv4`

    def object_url(self, key: str) -> str:
        return self.base + quote(key, safe="/~")

    def headers(self) -> list[str]:
        return [f"x-amz-security-token: {self.token}"] if self.token else []


def s3_keys() -> tuple[str, str, str | None] | None:
    """The S3 keys of the environment, or None when there are none (obstore then looks
    further: instance roles, web identity)."""
    key, secret = os.environ.get("AWS_ACCESS_KEY_ID"), os.environ.get("AWS_SECRET_ACCESS_KEY")
    if not key or not secret:
        return None
    return key, secret, os.environ.get("AWS_SESSION_TOKEN") or None


def endpoint_for(url: str) -> Endpoint | None:
    """How to reach ``url`` with libcurl, or None when obstore must (see the module doc)."""
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme in ("http", "https"):
        return Endpoint(base=f"{scheme}://{parts.netloc}/")
    if scheme not in ("s3", "s3a"):
        return None
    keys = s3_keys()
    if keys is None:
        return None
    bucket = parts.netloc
    region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or "us-east-1"
    custom = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    if custom:  # a local or third-party S3: path-style requests, as obstore makes them
        bucket_url = f"{custom.rstrip('/')}/{quote(bucket)}"
    elif "." in bucket:  # dots break the certificate of virtual-hosted names
        bucket_url = f"https://s3.{region}.amazonaws.com/{quote(bucket)}"
    else:
        bucket_url = f"https://{bucket}.s3.{region}.amazonaws.com"
    return Endpoint(
        base=bucket_url + "/",
        sigv4=f"aws:amz:{region}:s3",
        credentials=(keys[0], keys[1]),
        token=keys[2],
        list_url=bucket_url,
        signer=Signer(keys[0], keys[1], region, keys[2]),
    )
