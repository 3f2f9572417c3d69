"""AWS Signature V4 for S3 object requests (GET and HEAD of one object, no query string, no
body), signed here rather than by libcurl.

Why: libcurl derives the signing key again for every request (five HMAC-SHA256 rounds, each
looking the digest up in OpenSSL's registry), a large share of a range read's CPU
(benchmarks/README.md, "Range requests"). The signing key
only changes with the date, so `Signer` keeps it: a request then costs one SHA-256 of its
canonical form and one HMAC.

Signed headers: ``host``, ``x-amz-content-sha256``, ``x-amz-date`` and, with temporary
credentials, ``x-amz-security-token`` (S3 wants every ``x-amz-*`` header signed; ``Range`` and
``If-Match`` need not be). Requests with a query string (bucket listings) are left to libcurl's
signer, which canonicalises queries.
"""

from __future__ import annotations

import hashlib
import hmac
import time

EMPTY_SHA256 = hashlib.sha256(b"").hexdigest()


class Signer:
    """Signs S3 requests with one set of keys for one region."""

    def __init__(
        self, key: str, secret: str, region: str, token: str | None = None, service: str = "s3"
    ) -> None:
        self.key, self.region, self.service, self.token = key, region, service, token
        self._secret = secret
        self._day = ""
        self._signing_key = b""
        self._signed = "host;x-amz-content-sha256;x-amz-date" + (
            ";x-amz-security-token" if token else ""
        )

    def _key_of(self, day: str) -> bytes:
        if day != self._day:
            key = ("AWS4" + self._secret).encode()
            for part in (day, self.region, self.service, "aws4_request"):
                key = hmac.digest(key, part.encode(), "sha256")
            self._day, self._signing_key = day, key
        return self._signing_key

    def headers(self, method: str, host: str, path: str, now: float | None = None) -> list[str]:
        """The headers that sign ``method`` of ``path`` on ``host`` (the URL's path,
        percent-encoded as sent; no query string) at ``now`` (seconds since the epoch; the
        clock by default)."""
        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(now))
        day = stamp[:8]
        token = f"x-amz-security-token:{self.token}\n" if self.token else ""
        canonical = (
            f"{method}\n{path or '/'}\n\n"
            f"host:{host}\nx-amz-content-sha256:{EMPTY_SHA256}\nx-amz-date:{stamp}\n"
            f"{token}\n{self._signed}\n{EMPTY_SHA256}"
        )
        scope = f"{day}/{self.region}/{self.service}/aws4_request"
        to_sign = (
            f"AWS4-HMAC-SHA256\n{stamp}\n{scope}\n{hashlib.sha256(canonical.encode()).hexdigest()}"
        )
        signature = hmac.digest(self._key_of(day), to_sign.encode(), "sha256").hex()
        signed = [
            f"Authorization: AWS4-HMAC-SHA256 Credential={self.key}/{scope}, "
            f"SignedHeaders={self._signed}, Signature={signature}",
            f"x-amz-content-sha256: {EMPTY_SHA256}",
            f"x-amz-date: {stamp}",
        ]
        if self.token:
            signed.append(f"x-amz-security-token: {self.token}")
        return signed
