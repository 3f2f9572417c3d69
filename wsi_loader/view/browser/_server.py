"""Running the viewer: in the foreground (`serve`, the ``wsi-loader serve`` command, stopped by
Ctrl-C) or on a background thread of this process (`ViewerServer`, what `show` uses in a
notebook). Both bind the socket themselves, so the URL printed is the one served (port 0 or a
busy default port get a free one), and both run uvicorn.
"""

from __future__ import annotations

import contextlib
import errno
import html
import logging
import os
import socket
import threading
import time
import urllib.parse
import webbrowser
from collections.abc import Callable
from typing import Any

import uvicorn

from wsi_loader.errors import ConfigError
from wsi_loader.index._lookup import resolve_slide
from wsi_loader.index._table import SlideIndex
from wsi_loader.view.browser._app import create_app, frontend_missing
from wsi_loader.view.browser._limits import ConnectionLimits, bounded_protocol
from wsi_loader.view.browser._security import check_token, is_loopback
from wsi_loader.view.browser._tiles import TileOptions

log = logging.getLogger(__name__)

DEFAULT_PORTS = range(8000, 8020)  # tried in turn when no port is given; then any free port
STARTUP_TIMEOUT_S = 30
SHUTDOWN_GRACE_S = 3  # open connections get this long to finish when the server stops


MAX_PORT = 65535


def check_port(port: object) -> int | None:
    """``port`` if it is None or a TCP port number (0: any free port), else a `ConfigError`
    (the socket module's own error is an ``OverflowError`` traceback)."""
    if port is None:
        return None
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= MAX_PORT:
        raise ConfigError(
            f"{port!r} is not a port (0-{MAX_PORT}; 0 takes any free one)", key="port", value=port
        )
    return port


def bind(host: str, port: int | None) -> socket.socket:
    """A listening socket on ``host``: ``port``, or the first free default port, or any."""
    check_port(port)
    family = socket.AF_INET6 if ":" in host.strip("[]") else socket.AF_INET
    candidates = [port] if port is not None else [*DEFAULT_PORTS, 0]
    last: OSError | None = None
    for candidate in candidates:
        # IPPROTO_TCP named: asyncio sets TCP_NODELAY only on sockets that say so, and without
        # it a response's headers and body wait on the client's delayed ACK (40 ms a tile)
        sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host.strip("[]"), candidate))
        except OSError as exc:
            sock.close()
            last = exc
            if exc.errno == errno.EADDRINUSE and port is None:
                continue
            raise ConfigError(
                f"cannot listen on {host}:{candidate}: {exc.strerror}", key="port", value=candidate
            ) from exc
        sock.listen(2048)
        sock.set_inheritable(True)
        return sock
    raise ConfigError(f"no free port on {host}: {last}", key="port", value=port)


WILDCARDS = ("0.0.0.0", "", "::", "[::]")  # binds that listen on every address


def reachable_hosts(host: str) -> list[str]:
    """The addresses a server bound to ``host`` answers on: ``host`` itself, or for a
    wildcard bind (0.0.0.0, ::) loopback and this machine's own addresses (those of its
    name, and the one its default route leaves from)."""
    if host not in WILDCARDS:
        return [host]
    v6 = ":" in host
    found = ["127.0.0.1", *(["::1"] if v6 else [])]
    families = (socket.AF_INET, socket.AF_INET6) if v6 else (socket.AF_INET,)
    for family in families:
        with contextlib.suppress(OSError):
            for *_, address in socket.getaddrinfo(socket.gethostname(), None, family):
                found.append(str(address[0]))
        with contextlib.suppress(OSError), socket.socket(family, socket.SOCK_DGRAM) as probe:
            # connecting a UDP socket sends nothing: it picks the outgoing interface
            probe.connect(("192.0.2.1", 9) if family == socket.AF_INET else ("2001:db8::1", 9))
            found.append(str(probe.getsockname()[0]))
    return list(dict.fromkeys(a for a in found if not a.startswith("fe80")))


def urls_of(host: str, port: int, token: str | None) -> list[str]:
    """The URLs a server on ``host``: ``port`` can be opened at (`reachable_hosts`)."""
    return [url_of(address, port, token) for address in reachable_hosts(host)]


def url_of(host: str, port: int, token: str | None, slide: int | None = None) -> str:
    """The URL to open (the token in it, as Jupyter prints it)."""
    shown = "127.0.0.1" if host in WILDCARDS else host
    shown = f"[{shown}]" if ":" in shown and not shown.startswith("[") else shown
    query = {k: v for k, v in (("slide", slide), ("token", token)) if v is not None}
    suffix = f"?{urllib.parse.urlencode(query)}" if query else ""
    return f"http://{shown}:{port}/{suffix}"


def _config(app: Any, log_level: str, limits: ConnectionLimits | None) -> uvicorn.Config:
    limits = limits or ConnectionLimits()
    return uvicorn.Config(
        app,
        http=bounded_protocol(limits),
        # asyncio accepts up to `backlog` connections at a time before any is counted: a burst
        # of a whole 2048-deep queue would outrun the connection limit
        backlog=limits.connections,
        log_level=log_level,
        access_log=False,
        timeout_graceful_shutdown=SHUTDOWN_GRACE_S,
        server_header=False,
        lifespan="on",
    )


def _index(index: SlideIndex | str | os.PathLike[str]) -> SlideIndex:
    return index if isinstance(index, SlideIndex) else SlideIndex.open(index)


def serve(
    index: SlideIndex | str | os.PathLike[str],
    *,
    predictions: str | os.PathLike[str] | None = None,
    host: str = "127.0.0.1",
    port: int | None = None,
    token: str | None = None,
    open_browser: bool = False,
    tiles: TileOptions | None = None,
    on_ready: Callable[[list[str]], None] | None = None,
    limits: ConnectionLimits | None = None,
) -> None:
    """Serve the viewer of ``index`` until interrupted (Ctrl-C, SIGTERM).

    ``host``: 127.0.0.1 by default; any other address needs a token (generated and put in
    the URL when not given; an empty token is refused). ``port``: None tries 8000-8019, then
    any free port. ``predictions``: a ``wsi-loader predict`` output folder. ``on_ready`` gets
    the URLs once the server listens (the command prints them): one per address it answers
    on (loopback first; a wildcard host such as 0.0.0.0 lists this machine's addresses).
    ``limits``: connections open at once and the time a request's head may take
    (`ConnectionLimits`).
    """
    check_port(port)  # before the index is opened
    index = _index(index)
    token = check_token(host, token)
    missing = frontend_missing()
    if missing is not None:
        log.warning("%s; tiles and data are served, the page is not", missing)
    app = create_app(
        index, options=tiles, predictions=predictions, token=token, loopback_only=is_loopback(host)
    )
    sock = bind(host, port)
    server = uvicorn.Server(_config(app, "warning", limits))
    urls = urls_of(host, sock.getsockname()[1], token)
    ready = threading.Thread(target=_announce, args=(server, urls, on_ready, open_browser))
    ready.daemon = True
    ready.start()
    try:
        server.run(sockets=[sock])  # handles SIGINT / SIGTERM: stops, then returns
    finally:
        sock.close()


def _announce(
    server: uvicorn.Server,
    urls: list[str],
    on_ready: Callable[[list[str]], None] | None,
    open_browser: bool,
) -> None:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while not server.started and not server.should_exit and time.monotonic() < deadline:
        time.sleep(0.02)
    if not server.started:
        return
    if on_ready is not None:
        on_ready(urls)
    if open_browser:
        webbrowser.open(urls[0])


class ViewerServer:
    """The viewer on a background thread of this process (for notebooks and tests): started
    by the constructor, stopped by `stop` (or at exit; a context manager too). The arguments
    are `serve`'s."""

    def __init__(
        self,
        index: SlideIndex | str | os.PathLike[str],
        *,
        predictions: str | os.PathLike[str] | None = None,
        host: str = "127.0.0.1",
        port: int | None = 0,
        token: str | None = None,
        tiles: TileOptions | None = None,
        limits: ConnectionLimits | None = None,
    ) -> None:
        self.index = _index(index)
        self.token = check_token(host, token)
        self.host = host
        # the app first: a predictions folder it refuses leaves no socket open
        self.app = create_app(
            self.index,
            options=tiles,
            predictions=predictions,
            token=self.token,
            loopback_only=is_loopback(host),
        )
        self._socket = bind(host, port)
        self.port: int = self._socket.getsockname()[1]
        self._server = uvicorn.Server(_config(self.app, "error", limits))
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [self._socket]}, daemon=True
        )
        self._thread.name = f"wsi-loader-viewer-{self.port}"
        self._thread.start()
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the viewer did not start on {host}:{self.port}")
            time.sleep(0.01)

    @property
    def url(self) -> str:
        return url_of(self.host, self.port, self.token)

    def slide_url(self, slide: str | int | None = None) -> str:
        """The page opened on one slide (an id, path, name or stem of the index)."""
        return url_of(self.host, self.port, self.token, resolve_slide(self.index, slide))

    def stop(self) -> None:
        """Stop serving and close every slide (waits for the thread)."""
        self._server.should_exit = True
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=SHUTDOWN_GRACE_S + 10)
        with contextlib.suppress(OSError):
            self._socket.close()

    @property
    def running(self) -> bool:
        return self._thread.is_alive() and not self._server.should_exit

    def __enter__(self) -> ViewerServer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = "running" if self.running else "stopped"
        return f"ViewerServer({self.url!r}, {state})"


class ViewerFrame:
    """The viewer embedded in a notebook cell (an IFrame), with the server it shows."""

    def __init__(self, server: ViewerServer, slide: str | int | None, height: int) -> None:
        self.server = server
        self.src = server.slide_url(slide)
        self.height = height

    def _repr_html_(self) -> str:
        return (
            f'<iframe src="{html.escape(self.src)}" width="100%" height="{self.height}" '
            'style="border: 1px solid #ccc" allowfullscreen></iframe>'
        )

    def __repr__(self) -> str:
        return f"ViewerFrame({self.src!r})"


# Servers `show` started, one per index folder, reused by later calls and stopped by
# `stop_shown` (or when the process ends: their threads are daemons).
_shown: dict[str, ViewerServer] = {}
_shown_lock = threading.Lock()


def show(
    index: SlideIndex | str | os.PathLike[str],
    slide: str | int | None = None,
    *,
    height: int = 600,
    predictions: str | os.PathLike[str] | None = None,
) -> ViewerFrame:
    """The viewer of ``index`` in a notebook cell, opened on ``slide`` (id, path, name or
    stem; the first ok slide by default). The server runs on a background thread on
    127.0.0.1; one per index folder is started and reused (`stop_shown` stops them)."""
    opened = _index(index)
    key = f"{opened.path.resolve()}|{opened.meta.get('generation')}|{predictions}"
    with _shown_lock:
        server = _shown.get(key)
        if server is None or not server.running:
            server = _shown[key] = ViewerServer(opened, predictions=predictions)
    return ViewerFrame(server, slide, height)


def stop_shown() -> None:
    """Stop every server `show` started."""
    with _shown_lock:
        servers = list(_shown.values())
        _shown.clear()
    for server in servers:
        server.stop()
