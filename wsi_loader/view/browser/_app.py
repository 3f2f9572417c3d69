"""The viewer's ASGI application (Starlette): Deep Zoom tiles, overlay data and the page.

Routes (GET and HEAD only; anything else is 405, anything unknown 404)::

    /                                      the page (OpenSeadragon + viewer.js)
    /static/<name>                         its scripts, styles and images (an allow-list)
    /slides/<id>.dzi                       Deep Zoom descriptor of slide <id> of the index
    /slides/<id>_files/<z>/<col>_<row>.jpeg  one tile
    /api/slides                            the slide list
    /api/slides/<id>                       one slide: size, MPP, problems, grid layout, legend
    /api/slides/<id>/grid.bin              the grid's packed columns (see overlays.Grid)
    /api/slides/<id>/annotations.json      annotation outlines (level-0)
    /api/slides/<id>/tissue.png            the tissue mask by the slide's detector (RGBA)
    /api/slides/<id>/predictions/<k>.png   heatmap of class k of the predictions (X-Bounds: the
                                           level-0 box it covers; X-Overlap: 1 when smoothed)
    /api/slides/<id>/at?x=&y=              the tile under a level-0 point: its row and more
    /api/slides/<id>/rows/<row>.png        a tile as the dataset reads it, full resolution
    /api/slides/<id>/status                reads that failed on the slide so far

Slides are named by their index id only: no request names a file, and every number in a
path is checked against what exists (404, never a traceback). Reads run on the tile maker's
bounded thread pool; a tile several clients ask for at once is made once.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import mimetypes
import os
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from wsi_loader.errors import InputError, SlideError
from wsi_loader.index._table import SlideIndex
from wsi_loader.view.browser._catalog import Catalog, display_name
from wsi_loader.view.browser._overlays import (
    STATUSES,
    TISSUE_RGBA,
    Grid,
    TissueMasks,
    annotation_rings,
    grid_of,
    qc_columns,
    qc_rules,
    row_details,
)
from wsi_loader.view.browser._predictions import Predictions, PredictionTable
from wsi_loader.view.browser._public import scrub, told
from wsi_loader.view.browser._security import Guard
from wsi_loader.view.browser._tiles import SlideRef, Tile, TileMaker, TileOptions, encode_png

log = logging.getLogger(__name__)

Result = TypeVar("Result")
HERE = Path(__file__).parent
WEB = HERE / "web"  # our own page, script and styles
STATIC = HERE / "static"  # third-party code, built by `make frontend` (never committed)
OSD_SCRIPT = "openseadragon/openseadragon.min.js"
MAX_ID_DIGITS = 9  # ids, levels, columns and rows in paths: more digits is not a number we have
IMMUTABLE = "private, max-age=31536000, immutable"
CSP = (
    "default-src 'self'; img-src 'self' data: blob:; style-src 'self' 'unsafe-inline'; "
    "script-src 'self'; connect-src 'self'; object-src 'none'; base-uri 'none'"
)


def frontend_missing() -> str | None:
    """Why the page cannot work (OpenSeadragon not built into the static folder), or None."""
    if (STATIC / OSD_SCRIPT).is_file():
        return None
    return (
        f"the viewer's front end is not built ({STATIC / OSD_SCRIPT} is missing): run "
        "`make frontend` in the repository (it installs OpenSeadragon from the npm registry)"
    )


def _assets() -> dict[str, tuple[bytes, str]]:
    """Every file the page may load, read once: name -> (bytes, media type). Nothing else is
    ever served from disk, so no request can name a file."""
    found: dict[str, tuple[bytes, str]] = {}
    for root in (WEB, STATIC):
        if not root.is_dir():
            continue
        for folder, _, files in os.walk(root):  # symlinked folders are not followed
            for name in files:
                path = Path(folder) / name
                if path.is_symlink() or not path.is_file() or name.endswith(".map"):
                    continue
                kind = mimetypes.guess_type(name)[0] or "application/octet-stream"
                found[path.relative_to(root).as_posix()] = (path.read_bytes(), kind)
    return found


def _number(text: str) -> int | None:
    """A path's non-negative integer, None when it is anything else (signs, spaces, huge)."""
    if not (0 < len(text) <= MAX_ID_DIGITS and text.isascii() and text.isdigit()):
        return None
    return int(text)


def _not_found(what: str = "not found") -> Response:
    return PlainTextResponse(what, 404)


@dataclass
class _GridEntry:
    grid: Grid
    layout: list[dict[str, Any]]
    body: bytes
    quarantine: tuple[int, int] | None  # the quarantine file's (size, mtime) it was made from


class Viewer:
    """The state behind the routes: the index, its slides, the tile maker and overlays."""

    def __init__(
        self,
        index: SlideIndex,
        options: TileOptions | None = None,
        predictions: str | os.PathLike[str] | None = None,
    ) -> None:
        self.index = index
        self.catalog = Catalog(index)
        self.maker = TileMaker(options)
        self.predictions = Predictions(predictions) if predictions is not None else None
        # a folder of another index's run would show nothing, silently: said at start and
        # in each slide's banner (as inspect --predictions says it)
        self.predictions_notice: str | None = None
        if self.predictions is not None and not any(
            self.predictions.file_for(s.path, i) for i, s in enumerate(index.slides)
        ):
            self.predictions_notice = (
                "none of this index's slides has predictions in the folder given (another index?)"
            )
            log.warning(
                "none of this index's slides has predictions in %s (another index?)", predictions
            )
        self.masks = TissueMasks(index)
        self.assets = _assets()
        self._grids: dict[int, _GridEntry] = {}
        self._grid_lock = threading.Lock()
        self._pending: dict[tuple[Any, ...], asyncio.Future[Tile | None]] = {}

    def close(self) -> None:
        self.maker.close()

    async def run(self, call: Callable[..., Result], *args: Any) -> Result:
        """``call(*args)`` on the bounded pool of reading threads."""
        return await asyncio.wrap_future(self.maker.executor.submit(call, *args))

    # -- grids -------------------------------------------------------------------------------
    def _quarantine_stamp(self) -> tuple[int, int] | None:
        try:
            st = os.stat(self.index.quarantine.path)
        except OSError:
            return None
        return st.st_size, st.st_mtime_ns

    def grid(self, slide_id: int) -> _GridEntry:
        """The slide's grid, made again when the quarantine has changed (a run recording
        failures while the viewer is open)."""
        stamp = self._quarantine_stamp()
        with self._grid_lock:
            entry = self._grids.get(slide_id)
        if entry is not None and entry.quarantine == stamp:
            return entry
        grid = grid_of(self.index, slide_id)
        layout, body = grid.packed()
        entry = _GridEntry(grid, layout, body, stamp)
        with self._grid_lock:
            if len(self._grids) >= 16:
                self._grids.pop(next(iter(self._grids)))
            self._grids[slide_id] = entry
        return entry

    def prediction_table(self, slide_id: int) -> tuple[PredictionTable | None, str | None]:
        """The slide's predictions, or why they cannot be shown."""
        if self.predictions is None or self.predictions_notice is not None:
            return None, self.predictions_notice
        try:
            # by the path as stored, as predict.json names the slides
            return self.predictions.table(self.index.slides[slide_id].path, slide_id), None
        except (InputError, OSError) as exc:
            return None, told(exc, slide_id, "predictions")

    def details(self, slide_id: int) -> dict[str, Any]:
        """Everything the page needs to open a slide (checks the file)."""
        record = self.catalog.record(slide_id)
        state = self.catalog.state(slide_id, fresh=True)
        ref = self.catalog.ref(slide_id)
        layout, open_error = self.maker.layout(ref)
        entry = self.grid(slide_id)
        predictions, prediction_error = self.prediction_table(slide_id)
        mpp = record.mpp if record.mpp_source != "missing" else None
        return {
            "id": slide_id,
            "name": display_name(record.path),
            "label": record.label,
            "split": record.split,
            "status": record.status,
            "error": scrub(record.error),
            "warning": scrub(record.warning),
            "problem": state.problem
            or (f"the slide cannot be read: {open_error}" if open_error else None),
            "mpp": mpp,
            "width": layout.width,
            "height": layout.height,
            "tile_size": layout.tile_size,
            "version": state.version,
            "tile_footprint": entry.grid.footprint,
            "grid_stride": entry.grid.stride,
            "grid": {"count": len(entry.grid.columns["x"]), "columns": entry.layout},
            "statuses": list(STATUSES),
            "labels": list(self.index.label_names),
            "classes": list(self.index.classes),
            "qc": qc_columns(self.index),
            "qc_rules": qc_rules(self.index),
            "tissue_colour": list(TISSUE_RGBA[:3]),
            "predictions": (
                {"classes": list(predictions.classes)} if predictions is not None else None
            ),
            "predictions_error": prediction_error,
            "faults": self.maker.faults(slide_id).count,
        }

    # -- tiles -------------------------------------------------------------------------------
    def tile_job(self, ref: SlideRef, z: int, col: int, row: int) -> Tile | None:
        layout, _ = self.maker.layout(ref)
        if not layout.has_tile(z, col, row):
            return None
        return self.maker.tile(ref, z, col, row)

    async def tile(self, ref: SlideRef, z: int, col: int, row: int) -> Tile | None:
        """The tile (None when it does not exist); one job per tile however many ask."""
        key = (ref.slide_id, ref.version, z, col, row)
        cached = self.maker.tiles.get(key)
        if cached is not None:
            return Tile(cached)
        pending = self._pending.get(key)
        if pending is not None:
            return await asyncio.shield(pending)
        future = asyncio.ensure_future(self.run(self.tile_job, ref, z, col, row))
        self._pending[key] = future
        try:
            return await asyncio.shield(future)
        finally:
            self._pending.pop(key, None)


def _etag(ref: SlideRef, options: TileOptions, *parts: object) -> str:
    text = "-".join(str(p) for p in (ref.version, options.tile_size, options.quality, *parts))
    return f'"{text}"'


def _cached_response(request: Request, body: bytes, media: str, etag: str, fresh: bool) -> Response:
    headers = {"ETag": etag, "Cache-Control": IMMUTABLE if fresh else "no-cache"}
    if request.headers.get("if-none-match") == etag:
        return Response(status_code=304, headers=headers)
    return Response(body, media_type=media, headers=headers)


def create_app(
    index: SlideIndex,
    *,
    options: TileOptions | None = None,
    predictions: str | os.PathLike[str] | None = None,
    token: str | None = None,
    loopback_only: bool = True,
    cookie: str = "wsi_loader_token",
) -> Starlette:
    """The viewer's ASGI app for ``index`` (``app.state.viewer`` holds its state; the app
    closes it at shutdown). ``token``: required of every data request when given;
    ``loopback_only``: answer only requests addressed to a loopback name."""
    viewer = Viewer(index, options, predictions)

    def slide_of(request: Request) -> int | None:
        sid = _number(request.path_params["slide"])
        return sid if sid is not None and viewer.catalog.has(sid) else None

    async def page(request: Request) -> Response:
        missing = frontend_missing()
        if missing is not None:
            return PlainTextResponse(f"wsi-loader serve: {missing}", 503)
        body, _ = viewer.assets["index.html"]
        return Response(body, media_type="text/html", headers={"Content-Security-Policy": CSP})

    async def asset(request: Request) -> Response:
        found = viewer.assets.get(request.path_params["name"])
        if found is None:
            return _not_found()
        body, kind = found
        return Response(body, media_type=kind, headers={"Cache-Control": "no-cache"})

    async def slide_list(request: Request) -> Response:
        return JSONResponse(
            {
                "index": index.path.name,  # the folder's name: never a path of the server
                "labels": list(index.label_names),
                "slides": viewer.catalog.summary(),
            }
        )

    async def slide_details(request: Request) -> Response:
        sid = slide_of(request)
        if sid is None:
            return _not_found("no such slide")
        return JSONResponse(await viewer.run(viewer.details, sid))

    async def dzi(request: Request) -> Response:
        sid = slide_of(request)
        if sid is None:
            return _not_found("no such slide")

        def describe() -> str:
            viewer.catalog.state(sid, fresh=True)
            layout, _ = viewer.maker.layout(viewer.catalog.ref(sid))
            return layout.dzi()

        return Response(await viewer.run(describe), media_type="application/xml")

    async def tile(request: Request) -> Response:
        sid = slide_of(request)
        z, col, row = (_number(request.path_params[k]) for k in ("z", "col", "row"))
        if sid is None or z is None or col is None or row is None:
            return _not_found()
        ref = viewer.catalog.known_ref(sid)  # on the event loop: no thread for a cached tile
        if ref is None:
            ref = await viewer.run(viewer.catalog.ref, sid)
        etag = _etag(ref, viewer.maker.options, z, col, row)
        fresh = request.query_params.get("v") == ref.version
        if request.headers.get("if-none-match") == etag:
            cache = IMMUTABLE if fresh else "no-cache"
            return Response(status_code=304, headers={"ETag": etag, "Cache-Control": cache})
        made = await viewer.tile(ref, z, col, row)
        if made is None:
            return _not_found("no such tile")
        if made.error is not None:  # grey: never kept, so it is asked for again once fixed
            return Response(
                made.body,
                media_type="image/jpeg",
                headers={"Cache-Control": "no-store", "X-Tile-Error": _header_text(made.error)},
            )
        return _cached_response(request, made.body, "image/jpeg", etag, fresh)

    async def grid(request: Request) -> Response:
        sid = slide_of(request)
        if sid is None:
            return _not_found("no such slide")
        entry = await viewer.run(viewer.grid, sid)
        return Response(entry.body, media_type="application/octet-stream")

    async def annotations(request: Request) -> Response:
        sid = slide_of(request)
        if sid is None:
            return _not_found("no such slide")
        rings = await viewer.run(annotation_rings, index, sid)
        if isinstance(rings.get("error"), BaseException):
            rings["error"] = told(rings["error"], sid, "annotations")
        return JSONResponse(rings)

    async def tissue(request: Request) -> Response:
        sid = slide_of(request)
        if sid is None:
            return _not_found("no such slide")

        def draw() -> bytes | str:
            ref = viewer.catalog.ref(sid)
            try:
                return encode_png(viewer.masks.rgba(sid, ref.version, viewer.maker.reader(ref)))
            except (SlideError, InputError, OSError) as exc:  # the slide, a mask image, notes
                return told(exc, sid, "tissue mask")

        made = await viewer.run(draw)
        if isinstance(made, str):
            return PlainTextResponse(made, 409)
        return Response(made, media_type="image/png", headers={"Cache-Control": "no-cache"})

    async def heatmap(request: Request) -> Response:
        sid = slide_of(request)
        k = _number(request.path_params["k"])
        if sid is None or k is None:
            return _not_found()

        def draw() -> tuple[bytes, tuple[float, ...], bool] | str | None:
            table, _ = viewer.prediction_table(sid)
            if table is None or not k < len(table.classes):
                return None
            try:
                picture, bounds = table.heatmap(k)
            except InputError as exc:
                return told(exc, sid, "predictions")
            return encode_png(picture), bounds, table.overlaps

        made = await viewer.run(draw)
        if made is None:
            return _not_found("no such prediction class")
        if isinstance(made, str):
            return PlainTextResponse(made, 409)
        body, bounds, overlaps = made
        headers = {
            "X-Bounds": ",".join(f"{v:g}" for v in bounds),
            "X-Overlap": "1" if overlaps else "0",  # smoothed between cells, or crisp cells
            "Cache-Control": "no-cache",
        }
        return Response(body, media_type="image/png", headers=headers)

    async def at_point(request: Request) -> Response:
        sid = slide_of(request)
        try:
            x, y = float(request.query_params["x"]), float(request.query_params["y"])
        except (KeyError, ValueError):
            return PlainTextResponse("x and y (level-0 pixels) are needed", 400)
        if sid is None:
            return _not_found("no such slide")
        if not (np.isfinite(x) and np.isfinite(y)):
            return PlainTextResponse("x and y must be finite numbers", 400)

        def look() -> dict[str, Any]:
            entry = viewer.grid(sid)
            position = entry.grid.at(x, y)
            found: dict[str, Any] = {"x": x, "y": y, "tile": None}
            if position is not None:
                found["tile"] = row_details(index, entry.grid, position)
            table, _ = viewer.prediction_table(sid)
            if table is not None:
                found["predictions"] = table.at(x, y)
            return found

        return JSONResponse(await viewer.run(look))

    async def row_picture(request: Request) -> Response:
        sid = slide_of(request)
        row = _number(request.path_params["row"])
        if sid is None or row is None or row >= len(index):
            return _not_found("no such row")
        if int(index.columns["slide_id"][row]) != sid:
            return _not_found("the row is not a tile of this slide")

        def read() -> bytes | str:
            cols = index.columns
            ref = viewer.catalog.ref(sid)
            try:
                pixels = viewer.maker.region(
                    ref,
                    int(cols["l0_x"][row]),
                    int(cols["l0_y"][row]),
                    int(cols["level"][row]),
                    int(cols["read_size"][row]),
                    int(index.params.get("tile_size", cols["read_size"][row])),
                )
            except SlideError as exc:
                return told(exc, sid, f"row {row}")
            return encode_png(np.ascontiguousarray(pixels))

        made = await viewer.run(read)
        if isinstance(made, str):
            return PlainTextResponse(made, 409)
        return Response(made, media_type="image/png", headers={"Cache-Control": "no-cache"})

    async def status(request: Request) -> Response:
        sid = slide_of(request)
        if sid is None:
            return _not_found("no such slide")
        faults = viewer.maker.faults(sid)
        return JSONResponse({"faults": faults.count, "last": faults.last})

    routes = [
        Route("/", page),
        Route("/static/{name:path}", asset),
        Route("/slides/{slide}.dzi", dzi),
        Route("/slides/{slide}_files/{z}/{col}_{row}.jpeg", tile),
        Route("/api/slides", slide_list),
        Route("/api/slides/{slide}", slide_details),
        Route("/api/slides/{slide}/grid.bin", grid),
        Route("/api/slides/{slide}/annotations.json", annotations),
        Route("/api/slides/{slide}/tissue.png", tissue),
        Route("/api/slides/{slide}/predictions/{k}.png", heatmap),
        Route("/api/slides/{slide}/at", at_point),
        Route("/api/slides/{slide}/rows/{row}.png", row_picture),
        Route("/api/slides/{slide}/status", status),
    ]
    middleware = [Middleware(Guard, token=token, loopback_only=loopback_only, cookie=cookie)]

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        try:
            yield
        finally:
            viewer.close()

    app = Starlette(routes=routes, middleware=middleware, lifespan=lifespan)
    app.state.viewer = viewer
    return app


def _header_text(text: str) -> str:
    """``text`` fit for an HTTP header (one line of printable ASCII)."""
    return json.dumps(text)[1:-1][:300]
