"""Servers on 127.0.0.1 for the remote-storage tests and `benchmarks/bench_remote.py`, each run
in its own process (so a test's DataLoader workers, and the benchmark's timings, share no GIL
with them), started and stopped by the caller:

* `moto_s3`: moto's standalone S3 server (what s3fs's own tests use);
* ``http``: a static file server with HTTP Range support, and injectable faults: a JSON file
  ``.faults.json`` in its root maps a substring of "PATH RANGE-HEADER" to
  ``{"status": 503, "times": N}`` (the next N matching requests get that status;
  ``"times": -1`` forever; ``"status": 0`` drops the connection: a reset; ``"short"`` answers
  a range with its first half only, said so in honest headers; ``"stall"`` accepts the
  request and never answers (until the server stops, at most 120 s));
* ``proxy``: a TCP proxy that delays every request by a fixed time (a bucket in the same
  region: 5-20 ms) and counts requests and bytes (written to ``--stats`` on SIGUSR1);
* ``s3files``: the read side of the S3 API (HEAD and ranged GET of objects, path-style
  ``/BUCKET/KEY`` mapped to files under a folder; signatures not checked) with a fixed delay
  per request and the same counters: a bucket in the same region, cheap enough in CPU to
  benchmark a reader against on a 2-core machine (moto spends ~60 ms of CPU on every range
  request to a 150 MB object).

* `nginx_files`: Debian's nginx (``apt-get install nginx-light``) serving a folder over
  ``https://`` with a self-signed certificate (trusted through ``SSL_CERT_FILE``); it sends a
  range straight from the file (sendfile), the way a bucket's front end streams it, and logs
  every request with its bytes (`nginx_stats`).

``python tests/servers.py http PORT ROOT`` / ``proxy PORT TARGET_PORT DELAY_MS STATS`` /
``s3files PORT ROOT DELAY_MS STATS``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import pwd
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _wait_for_port(port: int, proc: subprocess.Popen[bytes], timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode} before listening")
        with socket.socket() as sock:
            if sock.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    proc.kill()
    raise RuntimeError(f"nothing listens on port {port} after {timeout} s")


@dataclass
class Server:
    proc: subprocess.Popen[bytes]
    port: int

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@contextlib.contextmanager
def _serving(args: list[str], port: int) -> Iterator[Server]:
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    server = Server(proc, port)
    try:
        _wait_for_port(port, proc)
        yield server
    finally:
        server.stop()


def exit_with(parent: int) -> None:
    """End this server process when ``parent`` (the test run) is gone, even if it was killed
    before it could stop us."""
    import threading

    def watch() -> None:
        while True:
            time.sleep(1)
            if os.getppid() != parent:
                os._exit(0)

    threading.Thread(target=watch, daemon=True).start()


@contextlib.contextmanager
def moto_s3() -> Iterator[Server]:
    """moto's S3 server on a free port of 127.0.0.1."""
    port = free_port()
    code = (
        f"import sys; sys.path.insert(0, {str(HERE.parent.parent)!r}); "
        f"from tests.servers import exit_with; exit_with({os.getpid()}); "
        "from moto.server import main; sys.exit(main(sys.argv[1:]))"
    )
    with _serving([sys.executable, "-c", code, "-H", "127.0.0.1", "-p", str(port)], port) as s:
        yield s


@contextlib.contextmanager
def _script(mode: str, *args: object) -> Iterator[Server]:
    """This file run as a server (``mode PORT ARGS...``) on a free port."""
    port = free_port()
    argv = [sys.executable, str(HERE), mode, str(port), *map(str, args)]
    with _serving(argv, port) as server:
        yield server


def http_files(root: Path) -> contextlib.AbstractContextManager[Server]:
    """A Range-capable static file server of ``root``."""
    return _script("http", root)


def delay_proxy(
    target_port: int, delay_ms: float, stats: Path
) -> contextlib.AbstractContextManager[Server]:
    """A proxy to 127.0.0.1:``target_port`` adding ``delay_ms`` to every request."""
    return _script("proxy", target_port, delay_ms, stats)


def s3_files(root: Path, delay_ms: float, stats: Path) -> contextlib.AbstractContextManager[Server]:
    """The read side of S3 over the files of ``root`` (``root/BUCKET/KEY``), ``delay_ms`` late."""
    return _script("s3files", root, delay_ms, stats)


def proxy_stats(server: Server, stats: Path) -> dict[str, int]:
    """The proxy's counters so far (requests, bytes sent to clients)."""
    with contextlib.suppress(FileNotFoundError):
        stats.unlink()
    server.proc.send_signal(signal.SIGUSR1)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        with contextlib.suppress(FileNotFoundError, json.JSONDecodeError):
            data: dict[str, int] = json.loads(stats.read_text())
            return data
        time.sleep(0.02)
    raise RuntimeError("the proxy wrote no stats")


NGINX = "/usr/sbin/nginx"
NGINX_CONF = """
{user}
worker_processes 1;
daemon off;
pid {folder}/nginx.pid;
error_log {folder}/error.log;
events {{ worker_connections 1024; }}
http {{
    log_format counted '$request_method $status $bytes_sent';
    access_log {folder}/access.log counted;
    sendfile on;
    keepalive_requests 100000;
    keepalive_timeout 300s;
    client_body_temp_path {folder}/tmp;
    proxy_temp_path {folder}/tmp;
    fastcgi_temp_path {folder}/tmp;
    uwsgi_temp_path {folder}/tmp;
    scgi_temp_path {folder}/tmp;
    server {{
        listen 127.0.0.1:{port} ssl;
        ssl_certificate {folder}/cert.pem;
        ssl_certificate_key {folder}/key.pem;
        root {root};
        types {{ application/octet-stream svs tif tiff ndpi; }}
    }}
}}
"""


@contextlib.contextmanager
def nginx_files(root: Path, folder: Path) -> Iterator[Server]:
    """nginx serving ``root`` over https on a free port of 127.0.0.1; its configuration,
    certificate (``folder/cert.pem``: point SSL_CERT_FILE at it) and logs live in ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "tmp").mkdir(exist_ok=True)
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
         "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
         "-keyout", str(folder / "key.pem"), "-out", str(folder / "cert.pem")],
        check=True, capture_output=True,
    )  # fmt: skip
    port = free_port()
    conf = folder / "nginx.conf"
    # run as root, nginx's workers become "nobody", who cannot read a private temp folder
    user = f"user {pwd.getpwuid(os.geteuid()).pw_name};" if os.geteuid() == 0 else ""
    conf.write_text(NGINX_CONF.format(folder=folder, port=port, root=root, user=user))
    with _serving([NGINX, "-c", str(conf), "-p", str(folder)], port) as server:
        yield server


def nginx_stats(folder: Path) -> dict[str, int]:
    """Requests and bytes sent so far, from nginx's access log in ``folder``."""
    requests = sent = 0
    with contextlib.suppress(FileNotFoundError), open(folder / "access.log") as fh:
        for line in fh:
            parts = line.split()
            if len(parts) == 3:
                requests += 1
                sent += int(parts[2])
    return {"requests": requests, "bytes_to_client": sent}


# -- the HTTP server ----------------------------------------------------------------------------
class RangeHandler(SimpleHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive: clients reuse connections, as with a bucket

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def _fault(self) -> int | str | None:
        faults_file = Path(self.directory) / ".faults.json"
        if not faults_file.exists():
            return None
        faults = json.loads(faults_file.read_text() or "{}")
        what = f"{self.path} {self.headers.get('Range', '')}"
        for pattern, fault in faults.items():
            if pattern in what and fault.get("times", 0) != 0:
                if fault["times"] > 0:
                    fault["times"] -= 1
                    faults_file.write_text(json.dumps(faults))
                status = fault["status"]
                return status if isinstance(status, str) else int(status)
        return None

    def send_head(self) -> Any:
        fault = self._fault()
        if fault == 0:  # a connection reset
            self.close_connection = True
            self.connection.shutdown(socket.SHUT_RDWR)
            return None
        if fault == "stall":
            time.sleep(120)
            self.close_connection = True
            return None
        if isinstance(fault, int):
            self.send_error(fault)
            return None
        match = re.fullmatch(r"bytes=(\d+)-(\d*)", self.headers.get("Range", ""))
        path = self.translate_path(self.path)
        if match is None or not os.path.isfile(path):
            return super().send_head()
        size = os.path.getsize(path)
        start = int(match.group(1))
        end = min(int(match.group(2)) if match.group(2) else size - 1, size - 1)
        if start >= size:
            self.send_error(416)
            return None
        if fault == "short":  # a server (or a proxy) that gives part of the range
            end = start + (end - start) // 2
        if fault == "wrong-range":  # a cache or proxy that answers another range of the object
            shift = 1 if end + 1 < size else -1
            start, end = start + shift, end + shift
        self._flip = fault == "flip"  # one bit flipped on the way (plain http, no TLS)
        fh = open(path, "rb")  # noqa: SIM115 - closed by the handler after copying
        fh.seek(start)
        self.send_response(206)
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Content-Range", f"bytes {start}-{end}/{size}")
        self.send_header("Content-Length", str(end - start + 1))
        self.send_header("Accept-Ranges", "bytes")
        self.end_headers()
        self._left = end - start + 1
        return fh

    def copyfile(self, source: Any, outputfile: Any) -> None:
        left = getattr(self, "_left", None)
        if left is None:
            super().copyfile(source, outputfile)
            return
        while left > 0:
            chunk = source.read(min(left, 1 << 20))
            if not chunk:
                break
            if getattr(self, "_flip", False):
                chunk = bytes([chunk[0] ^ 0x10]) + chunk[1:]
                self._flip = False
            outputfile.write(chunk)
            left -= len(chunk)
        self._left = None


def serve_http(root: str, port: int) -> None:
    def handler(*args: Any) -> RangeHandler:
        return RangeHandler(*args, directory=root)

    server = ThreadingHTTPServer(("127.0.0.1", port), handler)
    server.daemon_threads = True
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    server.serve_forever()


# -- the delay proxy ----------------------------------------------------------------------------
def _serve_counting(handle: Any, port: int, counts: dict[str, int], stats_path: str) -> None:
    """Serve ``handle`` on 127.0.0.1:``port`` until SIGTERM; SIGUSR1 writes ``counts``."""

    def dump() -> None:
        tmp = stats_path + ".tmp"
        Path(tmp).write_text(json.dumps(counts))
        os.replace(tmp, stats_path)

    async def main() -> None:
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGUSR1, dump)
        loop.add_signal_handler(signal.SIGTERM, loop.stop)
        server = await asyncio.start_server(handle, "127.0.0.1", port)
        async with server:
            await server.serve_forever()

    with contextlib.suppress(RuntimeError):  # the loop stopped by SIGTERM
        asyncio.run(main())


def serve_proxy(port: int, target_port: int, delay_ms: float, stats_path: str) -> None:
    counts = {"requests": 0, "bytes_to_client": 0, "connections": 0, "open": 0, "max_open": 0}
    delay = delay_ms / 1000.0

    async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, up: bool) -> None:
        try:
            while data := await reader.read(1 << 16):
                if up:
                    # a new request on this connection: it arrives ``delay`` later
                    counts["requests"] += len(
                        re.findall(rb"^[A-Z]+ \S+ HTTP/1\.[01]\r$", data, re.M)
                    )
                    if delay:
                        await asyncio.sleep(delay)
                else:
                    counts["bytes_to_client"] += len(data)
                writer.write(data)
                await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            with contextlib.suppress(Exception):
                writer.close()

    async def handle(client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        counts["connections"] += 1
        counts["open"] += 1
        counts["max_open"] = max(counts["max_open"], counts["open"])
        try:
            server_r, server_w = await asyncio.open_connection("127.0.0.1", target_port)
        except OSError:
            client_w.close()
            counts["open"] -= 1
            return
        await asyncio.gather(pipe(client_r, server_w, True), pipe(server_r, client_w, False))
        counts["open"] -= 1

    _serve_counting(handle, port, counts, stats_path)


# -- the S3 read endpoint -----------------------------------------------------------------------
def serve_s3_files(root: str, port: int, delay_ms: float, stats_path: str) -> None:
    from email.utils import formatdate
    from urllib.parse import unquote, urlsplit

    counts = {"requests": 0, "bytes_to_client": 0, "connections": 0, "open": 0, "max_open": 0}
    delay = delay_ms / 1000.0
    base = os.path.realpath(root)

    def error(status: str, code: str) -> bytes:
        body = f"<?xml version='1.0' encoding='UTF-8'?><Error><Code>{code}</Code></Error>"
        return (
            f"HTTP/1.1 {status}\r\nContent-Type: application/xml\r\n"
            f"Content-Length: {len(body)}\r\n\r\n{body}"
        ).encode()

    def answer(method: str, target: str, headers: dict[str, str]) -> bytes:
        path = os.path.realpath(os.path.join(base, unquote(urlsplit(target).path).lstrip("/")))
        if not path.startswith(base + os.sep) or not os.path.isfile(path):
            return error("404 Not Found", "NoSuchKey")
        st = os.stat(path)
        size = st.st_size
        head = {
            "ETag": f'"{st.st_ino:x}-{st.st_mtime_ns:x}-{size:x}"',
            "Last-Modified": formatdate(st.st_mtime, usegmt=True),
            "Accept-Ranges": "bytes",
            "Content-Type": "application/octet-stream",
        }
        status, start, end = "200 OK", 0, size - 1
        match = re.fullmatch(r"bytes=(\d+)-(\d*)", headers.get("range", ""))
        if match:
            start = int(match.group(1))
            end = min(int(match.group(2)) if match.group(2) else size - 1, size - 1)
            if start >= size:
                return error("416 Range Not Satisfiable", "InvalidRange")
            status = "206 Partial Content"
            head["Content-Range"] = f"bytes {start}-{end}/{size}"
        head["Content-Length"] = str(end - start + 1)
        lines = [f"HTTP/1.1 {status}", *(f"{k}: {v}" for k, v in head.items()), "", ""]
        out = "\r\n".join(lines).encode()
        if method == "GET":
            with open(path, "rb") as fh:
                out += os.pread(fh.fileno(), end - start + 1, start)
        return out

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        counts["connections"] += 1
        counts["open"] += 1
        counts["max_open"] = max(counts["max_open"], counts["open"])
        try:
            while True:
                request = await reader.readuntil(b"\r\n\r\n")
                lines = request.decode("latin-1").split("\r\n")
                method, target, _ = lines[0].split(" ", 2)
                headers = {}
                for line in lines[1:]:
                    if ":" in line:
                        key, _, value = line.partition(":")
                        headers[key.strip().lower()] = value.strip()
                if int(headers.get("content-length", "0")):
                    await reader.readexactly(int(headers["content-length"]))
                counts["requests"] += 1
                if delay:
                    await asyncio.sleep(delay)
                data = answer(method, target, headers)
                counts["bytes_to_client"] += len(data)
                writer.write(data)
                await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError, ValueError):
            pass
        finally:
            counts["open"] -= 1
            with contextlib.suppress(Exception):
                writer.close()

    _serve_counting(handle, port, counts, stats_path)


if __name__ == "__main__":
    exit_with(os.getppid())
    mode, port, rest = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
    if mode == "http":
        serve_http(rest[0], port)
    elif mode == "proxy":
        serve_proxy(port, int(rest[0]), float(rest[1]), rest[2])
    elif mode == "s3files":
        serve_s3_files(rest[0], port, float(rest[1]), rest[2])
