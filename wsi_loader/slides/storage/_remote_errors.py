"""What a failed remote request means, and the retries around it (see `storage`).

A failure is classified by `kind`: "missing" (404: `SlideNotFoundError`, which bucket or object),
"denied" (401/403), "changed" (412 to our If-Match: `SlideChangedError`), "no-credentials",
"transient" (network trouble, stalls, short answers, 5xx, 429: retried, then
`TransientReadError`) or "other" (`SlideOpenError`; a bug stays a bug). Errors of both clients
(libcurl's, obstore's) are told apart here, and said in words without a client's debug dump.
"""

from __future__ import annotations

import concurrent.futures
import logging
import re
import time
from collections.abc import Callable
from typing import Any
from urllib.parse import unquote, urlsplit
from xml.etree import ElementTree

from wsi_loader.errors import (
    SlideChangedError,
    SlideNotFoundError,
    SlideOpenError,
    TransientReadError,
)
from wsi_loader.slides.storage import _curl
from wsi_loader.slides.storage._curl import Answer, NetworkError, StalledError

log = logging.getLogger(__name__)

RETRIES = 2  # our attempts on top of the client's own
BACKOFF_S = 0.1


def object_key(url: str) -> str:
    """The object's key (path in its bucket or on its server) of a URL."""
    return unquote(urlsplit(url).path).lstrip("/")


class ShortAnswerError(ConnectionError):
    """An answer with fewer bytes than the range asked for: the transport's fault."""


class WrongRangeError(ConnectionError):
    """A 206 answer whose Content-Range is not the range asked for (a confused cache or
    proxy): the transport's fault, retried; its bytes are never used."""


def check_content_range(header: str | None, offset: int, size: int) -> None:
    """Raise `WrongRangeError` unless ``header`` (a 206's Content-Range) is exactly
    ``offset .. offset + size - 1``."""
    match = re.fullmatch(r"bytes\s+(\d+)-(\d+)/(\d+|\*)", (header or "").strip())
    if match is not None and int(match[1]) == offset and int(match[2]) < offset + size - 1:
        got = int(match[2]) + 1 - offset
        raise ShortAnswerError(f"{got} of {size} bytes at {offset}")  # the start, cut short
    if match is None or (int(match[1]), int(match[2])) != (offset, offset + size - 1):
        raise WrongRangeError(
            f"the server answered Content-Range {header!r} for bytes {offset}-{offset + size - 1}"
        )


class StatusError(Exception):
    """An HTTP error status; ``code`` is S3's error code (``NoSuchBucket``...) when given."""

    def __init__(self, status: int, code: str, text: str) -> None:
        super().__init__(f"HTTP {status}{f' {code}' if code else ''}{f': {text}' if text else ''}")
        self.status, self.code, self.text = status, code, text


def status_error(answer: Answer) -> StatusError:
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
CREDENTIALS_ADVICE = {
    "s3": "set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (obstore does not read ~/.aws "
    'profiles; `eval "$(aws configure export-credentials --format env)"` exports a profile\'s)',
    "gs": "set GOOGLE_APPLICATION_CREDENTIALS to a service-account key file (or "
    "GOOGLE_SERVICE_ACCOUNT)",
    "az": "set AZURE_STORAGE_ACCOUNT_NAME with AZURE_STORAGE_ACCOUNT_KEY (or a SAS token)",
}
_TRANSIENT_STATUS = frozenset({408, 425, 429, 500, 502, 503, 504})


def kind(exc: BaseException) -> str:
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
    return kind(exc) == "transient"


def short(exc: BaseException, limit: int = 500) -> str:
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
        reason = _CURL_REASONS.get(exc.code, short(exc, 200))
        if exc.code in _CURL_REASONS:
            return f"cannot reach {host} ({reason}: {short(exc, 200)})"
        return f"network error talking to {host}: {reason}"
    if isinstance(exc, StalledError):
        return f"a request got no answer in time ({exc})"
    if isinstance(exc, concurrent.futures.TimeoutError | TimeoutError):
        return f"a request got no answer in time ({exc or type(exc).__name__})"
    if isinstance(exc, ShortAnswerError):
        return f"answers came short ({exc})"
    if isinstance(exc, WrongRangeError):
        return f"answers were for other bytes ({exc})"
    return f"{type(exc).__name__}: {short(exc)}"


def _endpoint_host(url: str) -> str:
    endpoint = _curl.endpoint_for(url)
    return urlsplit(endpoint.base).netloc if endpoint is not None else urlsplit(url).netloc


def failure(url: str, what: str, exc: BaseException, attempts: int) -> Exception:
    what_kind = kind(exc)
    text = short(exc)
    if what_kind == "missing":
        if isinstance(exc, StatusError) and exc.code == "NoSuchBucket":
            bucket = urlsplit(url).netloc
            return SlideNotFoundError(f"the bucket {bucket!r} does not exist", path=url)
        if "NoSuchBucket" in text:  # obstore's
            bucket = urlsplit(url).netloc
            return SlideNotFoundError(f"the bucket {bucket!r} does not exist", path=url)
        return SlideNotFoundError(f"the object {object_key(url)!r} does not exist", path=url)
    if what_kind == "denied":
        return SlideOpenError(f"access denied: {text}", path=url)
    if what_kind == "changed":
        return SlideChangedError(
            "the object was rewritten since it was opened (its ETag changed); rebuild the index",
            path=url,
        )
    if what_kind == "no-credentials":
        scheme = urlsplit(url).scheme
        advice = CREDENTIALS_ADVICE.get("s3" if scheme == "s3a" else scheme, "")
        return SlideOpenError(
            "no credentials for this store: none in the environment, and the machine's "
            f"instance metadata service gave none{f'; {advice}' if advice else ''} "
            f"({type(exc).__name__}: {short(exc, 200)})",
            path=url,
        )
    if what_kind == "transient":
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
        except Exception as exc:  # classified by `kind`; the rest propagates
            if not retryable(exc) or attempt == retries:
                raise failure(url, what, exc, attempt + 1) from exc
            log.debug("%s of %s failed (attempt %d): %s", what, url, attempt + 1, exc)
            time.sleep(BACKOFF_S * 2**attempt)
    raise AssertionError("unreachable")
