"""Our S3 signatures against botocore's (the AWS SDK's own signer, here through the test
extra's s3fs): the same request at the same instant must carry the same headers."""

from __future__ import annotations

import calendar
import datetime
from urllib.parse import urlsplit

import pytest

from wsi_loader.slides.storage._curl import endpoint_for

auth = pytest.importorskip("botocore.auth")
awsrequest = pytest.importorskip("botocore.awsrequest")
credentials = pytest.importorskip("botocore.credentials")

NOW = datetime.datetime(2026, 12, 6, 23, 59, 58)  # a second before the signing key's day ends


def botocore_signed(
    method: str, url: str, region: str, token: str | None, monkeypatch: pytest.MonkeyPatch
) -> dict[str, str]:
    monkeypatch.setattr(auth, "get_current_datetime", lambda: NOW)
    request = awsrequest.AWSRequest(method=method, url=url)
    request.context["payload_signing_enabled"] = True  # the empty body's hash, as we send
    keys = credentials.Credentials("AKIDEXAMPLE", "wJalr/K7+MDENG", token)
    auth.S3SigV4Auth(keys, "s3", region).add_auth(request)
    return {name.lower(): value for name, value in request.headers.items()}


@pytest.mark.parametrize(
    ("endpoint", "key", "token"),
    [
        ("http://127.0.0.1:9000", "archive/slide 1.svs", None),
        ("https://s3.example.org", "weird/naïve+tiles(2)~x.svs", "FwoGZXIvYXdzE/token=="),
        (None, "a/b.tiff", None),  # AWS itself: https://BUCKET.s3.REGION.amazonaws.com
    ],
)
@pytest.mark.parametrize("method", ["GET", "HEAD"])
def test_object_requests_are_signed_as_botocore_signs_them(
    monkeypatch: pytest.MonkeyPatch, endpoint: str | None, key: str, token: str | None, method: str
) -> None:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIDEXAMPLE")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wJalr/K7+MDENG")
    monkeypatch.setenv("AWS_REGION", "eu-west-3")
    for name in ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    if endpoint:
        monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
    if token:
        monkeypatch.setenv("AWS_SESSION_TOKEN", token)
    found = endpoint_for(f"s3://bucket/{key}")
    assert found is not None and found.signer is not None
    url = found.object_url(key)
    parts = urlsplit(url)
    now = calendar.timegm(NOW.timetuple())
    ours = dict(
        line.split(": ", 1) for line in found.signer.headers(method, parts.netloc, parts.path, now)
    )
    theirs = botocore_signed(method, url, "eu-west-3", token, monkeypatch)
    assert {name.lower(): value for name, value in ours.items()} == theirs


def test_the_signing_key_follows_the_date(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIDEXAMPLE")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wJalr/K7+MDENG")
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9000")
    found = endpoint_for("s3://bucket/x.svs")
    assert found is not None and found.signer is not None
    before = calendar.timegm(NOW.timetuple())
    signer = found.signer
    first = signer.headers("GET", "127.0.0.1:9000", "/bucket/x.svs", before)
    later = signer.headers("GET", "127.0.0.1:9000", "/bucket/x.svs", before + 2)  # next day
    assert "20261206/" in first[0] and "20261207/" in later[0]
    monkeypatch.setattr(auth, "get_current_datetime", lambda: NOW + datetime.timedelta(seconds=2))
    request = awsrequest.AWSRequest(method="GET", url="http://127.0.0.1:9000/bucket/x.svs")
    request.context["payload_signing_enabled"] = True
    keys = credentials.Credentials("AKIDEXAMPLE", "wJalr/K7+MDENG")
    auth.S3SigV4Auth(keys, "s3", "us-east-1").add_auth(request)
    assert later[0] == f"Authorization: {request.headers['Authorization']}"
