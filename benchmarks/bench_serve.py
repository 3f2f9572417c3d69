"""The viewer's tile server against openslide-python's DeepZoomGenerator, served alike.

    .venv/bin/python benchmarks/bench_serve.py [--width 20000] [--clients 8] [--duration 10]
        [--requests 20000] [--rounds 3] [--patterns zoom,pan] [--threads 4] [--quality 75]
        [--scratch DIR] [--no-flask] [--memory-requests N] [--memory-cache-mb 16]
        [--only speed|memory] [--json FILE]

Every server runs in a process of its own on 127.0.0.1 and serves one synthetic Aperio slide
(``--width`` x 3/4, 256 px JPEG tiles, levels at 1, 4, 16 and 64) as Deep Zoom, 256 px tiles
without overlap, JPEG quality ``--quality``, reads on ``--threads`` threads:

* ours: ``wsi-loader serve`` (Starlette on uvicorn + httptools): stored tiles passed through,
  DCT-scaled reads, an LRU of encoded tiles (``--cache-mb``, 256 MiB by default);
* ours, cache off: the same with ``cache_mb=0``: every request makes its tile (the work the
  peers do: they keep no encoded tiles, only OpenSlide's own cache of decoded storage tiles);
* DeepZoomGenerator: the same ASGI stack (Starlette, uvicorn, the same bounded thread pool),
  ``get_tile`` and PIL's JPEG encoder, as a tile server built on openslide-python would be;
* Flask: the deepzoom example's app (Flask + DeepZoomGenerator on werkzeug's threaded
  server), when Flask is installed (--no-flask skips it).

Clients (``--clients`` threads in one other process, keep-alive connections) ask for random
tiles for ``--duration`` seconds each, or ``--requests``, whichever comes first. Two request
patterns (``--patterns``): ``zoom``, a zoom level uniformly from every level of the pyramid,
then a tile of it uniformly (the coarse levels have few tiles, so a tile cache serves most of
these); ``pan``, tiles of the full-resolution level only, uniformly (a pathologist panning at
40x: nearly every tile new, and stored JPEGs that ours passes through). The same seed gives
every server the same sequence. Every round (``--rounds``) starts every server afresh for
each pattern: the first pass over the sequence is **cold** (empty tile caches: only the .dzi
was fetched), the second asks for the same tiles again, **warm** (what the first pass left in
the caches). Reported per row: best and median tiles/s over the rounds, latency p50/p99 (ms,
of the median round), non-200 answers, and the ratios to DeepZoomGenerator on the same
pattern and cache state. Then ``--memory-requests`` (``--requests``) requests against ours,
its tile cache ``--memory-cache-mb`` (16 MiB, full after a few thousand requests), the
server's resident memory sampled every tenth of them: flat once its caches are full.
``--only speed|memory`` runs one part; ``--only browser`` measures the page instead (ms per
overlay redraw with a grid of ~100,000 tiles, in Debian's chromium). The client and the
servers share the machine's cores (a busy client slows every server alike).
"""

from __future__ import annotations

import argparse
import http.client
import io
import json
import math
import os
import random
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from common import scratch_folder, synthetic_slide

HERE = Path(__file__).resolve()
READY_TIMEOUT_S = 120


# -- the servers (each runs in a process of its own: `--serve KIND`) -----------------------------
def serve_ours(slide: str, index_dir: str, port_file: str, args: argparse.Namespace) -> None:
    from wsi_loader.index import build_index
    from wsi_loader.view.browser import TileOptions, ViewerServer

    index = build_index([slide], index_dir, tile_size=256, level=0, min_tissue=0.0)
    tiles = TileOptions(
        tile_size=256, quality=args.quality, cache_mb=args.cache_mb, threads=args.threads
    )
    server = ViewerServer(index, tiles=tiles)
    _announce(port_file, server.port)
    threading.Event().wait()  # until the parent ends the process


def deep_zoom_app(slide: str, args: argparse.Namespace) -> Any:
    """DeepZoomGenerator behind Starlette, reads on a thread pool of the same size as ours."""
    import asyncio
    from concurrent.futures import ThreadPoolExecutor

    import openslide
    from openslide.deepzoom import DeepZoomGenerator
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import PlainTextResponse, Response
    from starlette.routing import Route

    generator = DeepZoomGenerator(
        openslide.OpenSlide(slide), tile_size=256, overlap=0, limit_bounds=False
    )
    pool = ThreadPoolExecutor(args.threads)

    def make(level: int, col: int, row: int) -> bytes:
        tile = generator.get_tile(level, (col, row))
        buffer = io.BytesIO()
        tile.save(buffer, "jpeg", quality=args.quality)
        return buffer.getvalue()

    async def dzi(request: Request) -> Response:
        return Response(generator.get_dzi("jpeg"), media_type="application/xml")

    async def tile(request: Request) -> Response:
        p = request.path_params
        try:
            level, col, row = int(p["level"]), int(p["col"]), int(p["row"])
            body = await asyncio.wrap_future(pool.submit(make, level, col, row))
        except ValueError:
            return PlainTextResponse("no such tile", 404)
        return Response(body, media_type="image/jpeg")

    return Starlette(
        routes=[
            Route("/slides/0.dzi", dzi),
            Route("/slides/0_files/{level}/{col}_{row}.jpeg", tile),
        ]
    )


def serve_deep_zoom(slide: str, port_file: str, args: argparse.Namespace) -> None:
    import uvicorn

    from wsi_loader.view.browser._server import bind

    sock = bind("127.0.0.1", 0)  # as ours binds
    config = uvicorn.Config(
        deep_zoom_app(slide, args), log_level="error", access_log=False, lifespan="off"
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    _announce(port_file, sock.getsockname()[1])
    thread.join()


def serve_flask(slide: str, port_file: str, args: argparse.Namespace) -> None:
    """The deepzoom example's tile route: Flask, one DeepZoomGenerator, werkzeug threaded."""
    import logging

    import openslide
    from flask import Flask, abort, make_response
    from openslide.deepzoom import DeepZoomGenerator
    from werkzeug.serving import make_server

    app = Flask(__name__)
    generator = DeepZoomGenerator(
        openslide.OpenSlide(slide), tile_size=256, overlap=0, limit_bounds=False
    )

    @app.route("/slides/0.dzi")
    def dzi() -> Any:
        response = make_response(generator.get_dzi("jpeg"))
        response.mimetype = "application/xml"
        return response

    @app.route("/slides/0_files/<int:level>/<int:col>_<int:row>.jpeg")
    def tile(level: int, col: int, row: int) -> Any:
        try:
            picture = generator.get_tile(level, (col, row))
        except ValueError:
            abort(404)
        buffer = io.BytesIO()
        picture.save(buffer, "jpeg", quality=args.quality)
        response = make_response(buffer.getvalue())
        response.mimetype = "image/jpeg"
        return response

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # no line per request
    server = make_server("127.0.0.1", 0, app, threaded=True)
    _announce(port_file, server.server_port)
    server.serve_forever()


def _announce(port_file: str, port: int) -> None:
    Path(port_file + ".tmp").write_text(str(port))
    os.replace(port_file + ".tmp", port_file)


# -- the clients -------------------------------------------------------------------------------
def pyramid(width: int, height: int, tile: int = 256) -> list[tuple[int, int]]:
    """(columns, rows) of every Deep Zoom level, 1 x 1 px first."""
    sizes = [(width, height)]
    while sizes[-1] != (1, 1):
        w, h = sizes[-1]
        sizes.append((max(1, math.ceil(w / 2)), max(1, math.ceil(h / 2))))
    return [(math.ceil(w / tile), math.ceil(h / tile)) for w, h in reversed(sizes)]


def requests_for(
    levels: list[tuple[int, int]], count: int, seed: int, pattern: str = "zoom"
) -> list[str]:
    """``zoom``: a level uniformly, then a tile of it; ``pan``: full-resolution tiles only."""
    rng = random.Random(seed)
    paths = []
    for _ in range(count):
        z = len(levels) - 1 if pattern == "pan" else rng.randrange(len(levels))
        cols, rows = levels[z]
        paths.append(f"/slides/0_files/{z}/{rng.randrange(cols)}_{rng.randrange(rows)}.jpeg")
    return paths


def load(
    port: int,
    paths: list[str],
    clients: int,
    duration: float,
    on_progress: Callable[[int], None] | None = None,
) -> dict[str, Any]:
    """``clients`` keep-alive connections asking for ``paths`` in turn until they are done or
    ``duration`` has passed: tiles/s, latency percentiles, failures."""
    latencies: list[float] = []
    failures = [0]
    cursor = [0]
    lock = threading.Lock()
    deadline = time.monotonic() + duration

    def client() -> None:
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        mine: list[float] = []
        while time.monotonic() < deadline:
            with lock:
                i = cursor[0]
                cursor[0] += 1
            if i >= len(paths):
                break
            start = time.perf_counter()
            connection.request("GET", paths[i])
            response = connection.getresponse()
            response.read()
            mine.append(time.perf_counter() - start)
            if response.status != 200:
                with lock:
                    failures[0] += 1
            if on_progress is not None and (i + 1) % 1000 == 0:
                on_progress(i + 1)
        connection.close()
        with lock:
            latencies.extend(mine)

    started = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    elapsed = time.perf_counter() - started
    ms = np.array(latencies) * 1000
    return {
        "requests": len(latencies),
        "tiles_per_s": len(latencies) / elapsed,
        "p50_ms": float(np.percentile(ms, 50)) if len(ms) else math.nan,
        "p99_ms": float(np.percentile(ms, 99)) if len(ms) else math.nan,
        "failures": failures[0],
    }


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return math.nan


class Running:
    """A server process of this script (``--serve KIND``), ended on exit."""

    def __init__(
        self, kind: str, slide: Path, scratch: Path, args: argparse.Namespace, **extra: Any
    ):
        self.port_file = scratch / f"port-{kind}-{os.getpid()}"
        self.port_file.unlink(missing_ok=True)
        options = {**vars(args), **extra}
        command = [sys.executable, str(HERE), "--serve", kind, "--slide", str(slide)]
        command += [
            "--port-file",
            str(self.port_file),
            "--index-dir",
            str(scratch / f"idx-{slide.stem}"),
        ]
        for name in ("quality", "threads", "cache_mb"):
            command += [f"--{name.replace('_', '-')}", str(options[name])]
        self.process = subprocess.Popen(command)
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not self.port_file.exists():
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the {kind} server did not start")
            time.sleep(0.05)
        self.port = int(self.port_file.read_text())

    def __enter__(self) -> Running:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.port_file.unlink(missing_ok=True)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--width", type=int, default=20_000)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--duration", type=float, default=10.0, help="seconds per server")
    parser.add_argument("--requests", type=int, default=20_000)
    parser.add_argument(
        "--rounds", type=int, default=3, help="every server restarted per round and pattern"
    )
    parser.add_argument("--patterns", default="zoom,pan", help="zoom, pan or both")
    parser.add_argument("--threads", type=int, default=4)
    parser.add_argument("--quality", type=int, default=75)
    parser.add_argument("--cache-mb", type=int, default=256)
    parser.add_argument("--memory-cache-mb", type=int, default=16)
    parser.add_argument(
        "--memory-requests", type=int, help="requests of the memory run (default --requests)"
    )
    parser.add_argument("--only", choices=["speed", "memory", "browser"], help="run one part")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--scratch")
    parser.add_argument("--no-flask", action="store_true")
    parser.add_argument("--json", help="also write the results here")
    # a server process of this script
    parser.add_argument("--serve", choices=["ours", "deepzoom", "flask"], help=argparse.SUPPRESS)
    parser.add_argument("--slide", help=argparse.SUPPRESS)
    parser.add_argument("--port-file", help=argparse.SUPPRESS)
    parser.add_argument("--index-dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve == "ours":
        serve_ours(args.slide, args.index_dir, args.port_file, args)
        return
    if args.serve == "deepzoom":
        serve_deep_zoom(args.slide, args.port_file, args)
        return
    if args.serve == "flask":
        serve_flask(args.slide, args.port_file, args)
        return

    scratch = scratch_folder(args.scratch, "wsi-bench-serve-")
    slide = synthetic_slide(scratch / f"serve-{args.width}.svs", width=args.width, seed=7)
    height = args.width * 3 // 4
    levels = pyramid(args.width, height)
    patterns = {
        pattern: requests_for(levels, args.requests, args.seed, pattern)
        for pattern in args.patterns.split(",")
    }
    print(
        f"slide {args.width} x {height} px ({levels[-1][0] * levels[-1][1]} tiles at level 0, "
        f"{len(levels)} Deep Zoom levels); {args.clients} clients, {args.threads} reading "
        f"threads per server, JPEG quality {args.quality}, up to {args.duration:g} s or "
        f"{args.requests} requests a pass, {args.rounds} rounds"
    )
    servers = [("ours", "ours", {}), ("ours, cache off", "ours", {"cache_mb": 0})]
    servers.append(("DeepZoomGenerator", "deepzoom", {}))
    if not args.no_flask:
        try:
            import flask  # noqa: F401

            servers.append(("Flask deepzoom example", "flask", {}))
        except ImportError:
            print("Flask is not installed: the deepzoom example's app is left out")
    results: dict[str, Any] = {}
    if args.only == "browser":
        from serve_browser import browser_frames

        results["browser"] = browser_frames(slide, scratch)
        servers = []
    runs: dict[tuple[str, str, str], list[dict[str, Any]]] = {}
    for r in range(args.rounds if args.only in (None, "speed") else 0):
        for pattern, paths in patterns.items():
            for name, kind, extra in servers[r % len(servers) :] + servers[: r % len(servers)]:
                with Running(kind, slide, scratch, args, **extra) as server:
                    load(server.port, ["/slides/0.dzi"], 1, args.duration)  # no tile cached
                    for state in ("cold", "warm"):
                        run = load(server.port, paths, args.clients, args.duration)
                        runs.setdefault((name, pattern, state), []).append(run)
    if runs:
        results["speed"] = table(runs)
    if args.only in (None, "memory"):
        count = args.memory_requests or args.requests
        rss = memory(slide, scratch, args, requests_for(levels, count, args.seed + 1))
        results["memory"] = {"rss_mb": rss}
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


def table(runs: dict[tuple[str, str, str], list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """One row per server, pattern and cache state: best and median tiles/s over the rounds,
    the median round's latencies, ratios to DeepZoomGenerator on the same pattern and state."""
    rows = []
    for (name, pattern, state), found in runs.items():
        ranked = sorted(found, key=lambda run: run["tiles_per_s"])
        middle = ranked[len(ranked) // 2]
        rows.append(
            {
                "server": name,
                "pattern": pattern,
                "cache": state,
                "best": ranked[-1]["tiles_per_s"],
                "median": float(np.median([run["tiles_per_s"] for run in found])),
                "p50_ms": middle["p50_ms"],
                "p99_ms": middle["p99_ms"],
                "failures": sum(run["failures"] for run in found),
            }
        )
    base = {
        (row["pattern"], row["cache"]): row for row in rows if row["server"] == "DeepZoomGenerator"
    }
    print(
        f"\n{'server':<24} {'pattern':<5} {'cache':<5} {'best':>6} {'median':>6} {'p50 ms':>7} "
        f"{'p99 ms':>7} {'non-200':>7}  vs DZG best / median"
    )
    for row in sorted(rows, key=lambda row: (row["pattern"], row["cache"])):
        peer = base.get((row["pattern"], row["cache"]))
        ratio = (
            f"{row['best'] / peer['best']:.2f}x / {row['median'] / peer['median']:.2f}x"
            if peer
            else ""
        )
        print(
            f"{row['server']:<24} {row['pattern']:<5} {row['cache']:<5} {row['best']:>6.0f} "
            f"{row['median']:>6.0f} {row['p50_ms']:>7.2f} {row['p99_ms']:>7.2f} "
            f"{row['failures']:>7}  {ratio}"
        )
    return rows


def memory(
    slide: Path, scratch: Path, args: argparse.Namespace, paths: list[str]
) -> list[tuple[int, float]]:
    """Resident memory of ours over ``paths``, its cache small enough to fill up."""
    samples: list[tuple[int, float]] = []
    with Running("ours", slide, scratch, args, cache_mb=args.memory_cache_mb) as server:
        samples.append((0, rss_mb(server.process.pid)))
        step = max(1000, len(paths) // 10 // 1000 * 1000)

        def sample(done: int) -> None:
            if done % step == 0:
                samples.append((done, rss_mb(server.process.pid)))

        done = load(server.port, paths, args.clients, 3600, on_progress=sample)
        if samples[-1][0] != done["requests"]:
            samples.append((done["requests"], rss_mb(server.process.pid)))
    print(
        f"\nresident memory of ours (tile cache {args.memory_cache_mb} MiB) over "
        f"{done['requests']} requests ({done['failures']} non-200, "
        f"{done['tiles_per_s']:.0f} tiles/s):"
    )
    print("  " + ", ".join(f"{n}: {mb:.0f} MB" for n, mb in samples))
    return samples


if __name__ == "__main__":
    main()
