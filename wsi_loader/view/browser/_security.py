"""Who may ask the viewer for what.

* Loopback binds answer only requests addressed to a loopback name (``Host: 127.0.0.1:N``,
  ``localhost``, ``[::1]``): a web page elsewhere cannot reach the server through a DNS name
  that resolves to 127.0.0.1 (DNS rebinding).
* Any other bind needs a token (generated when not given, printed in the URL as Jupyter does):
  data (slides, tiles, overlays) is answered only to a request that carries it, as
  ``?token=``, an ``Authorization: token T`` header or the cookie set when the page was
  opened with it. The page and its scripts hold no data and need none.
* Every response says ``nosniff`` and sends no referrer (the token stays out of other logs).
"""

from __future__ import annotations

import hmac
import ipaddress
import secrets
from collections.abc import Iterable
from http.cookies import SimpleCookie

from starlette.datastructures import Headers, MutableHeaders, QueryParams
from starlette.responses import PlainTextResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from wsi_loader.errors import ConfigError

LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})
PUBLIC_PATHS = ("/", "/favicon.ico")  # the page itself: no data in it
PUBLIC_PREFIXES = ("/static/",)  # its scripts and styles


def is_loopback(host: str) -> bool:
    """Whether binding ``host`` keeps the server on this machine."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_token(host: str, token: str | None) -> str | None:
    """The token a server on ``host`` uses: as given, generated for a non-loopback bind
    without one; an empty token for a non-loopback bind is refused."""
    if token is not None and not token.strip():
        if not is_loopback(host):
            raise ConfigError(
                f"serving on {host} (not loopback) without a token would show every slide of "
                "the index to anyone who can reach this machine; give --token or leave it out "
                "to have one generated",
                key="token",
                value=token,
            )
        return None
    if token is None and not is_loopback(host):
        return secrets.token_urlsafe(24)
    return token


def _host_name(host_header: str) -> str:
    """The name of a ``Host`` header, without its port (``[::1]:8000`` -> ``::1``)."""
    name, port = host_header, ""
    if host_header.startswith("["):
        end = host_header.find("]")
        if end < 0:
            return ""
        name, rest = host_header[1:end], host_header[end + 1 :]
        if rest and not rest.startswith(":"):
            return ""
        port = rest[1:]
    elif host_header.count(":") == 1:
        name, port = host_header.split(":")
    if port and not (port.isascii() and port.isdigit()):
        return ""  # not a port: not a name this server answers to
    return name


class Guard:
    """ASGI middleware applying the rules above."""

    def __init__(
        self, app: ASGIApp, *, token: str | None, loopback_only: bool, cookie: str
    ) -> None:
        self.app = app
        self.token = token
        self.loopback_only = loopback_only
        self.cookie = cookie

    def _presented(self, query: QueryParams, headers: Headers) -> Iterable[str]:
        yield query.get("token", "")
        auth = headers.get("authorization", "")
        if auth.lower().startswith("token "):
            yield auth[6:].strip()
        cookies: SimpleCookie = SimpleCookie()
        try:
            cookies.load(headers.get("cookie", ""))
        except Exception:  # a malformed cookie header carries no token
            return
        if self.cookie in cookies:
            yield cookies[self.cookie].value

    def _authorised(self, query: QueryParams, headers: Headers) -> bool:
        if self.token is None:
            return True
        expected = self.token.encode()
        return any(
            hmac.compare_digest(given.encode(), expected)
            for given in self._presented(query, headers)
            if given
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        query = QueryParams(scope.get("query_string", b"").decode("latin-1"))
        if self.loopback_only and _host_name(headers.get("host", "")) not in LOOPBACK_NAMES:
            await PlainTextResponse("unknown host", 400)(scope, receive, send)
            return
        path: str = scope["path"]
        public = path in PUBLIC_PATHS or path.startswith(PUBLIC_PREFIXES)
        authorised = self._authorised(query, headers)
        if not public and not authorised:
            await PlainTextResponse(
                "a token is needed: open the URL the server printed (with ?token=...)", 403
            )(scope, receive, send)
            return
        given = query.get("token")
        set_cookie = self.token is not None and authorised and given is not None

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                out = MutableHeaders(scope=message)
                out.append("X-Content-Type-Options", "nosniff")
                out.append("Referrer-Policy", "no-referrer")
                if set_cookie:
                    out.append(
                        "Set-Cookie",
                        f"{self.cookie}={self.token}; Path=/; HttpOnly; SameSite=Strict",
                    )
            await send(message)

        await self.app(scope, receive, send_with_headers)
