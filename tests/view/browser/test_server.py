"""The viewer's HTTP side on a real uvicorn server on 127.0.0.1: routes, caching headers,
pass-through bytes, overlay data, and everything a hostile or careless request can try."""

from __future__ import annotations

import contextlib
import dataclasses
import http.client
import io
import json
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import openslide
import pytest
import simplejpeg
from PIL import Image

from tests.conftest import REPO, SlideFactory
from tests.view.browser.conftest import TUMOUR_BOX, Archive, needs_page, request
from wsi_loader.errors import ConfigError
from wsi_loader.index import build_index
from wsi_loader.index._qc import QC_COLUMNS
from wsi_loader.view.browser import ConnectionLimits, ViewerServer, show, stop_shown
from wsi_loader.view.browser._security import check_token, is_loopback
from wsi_loader.view.browser._server import bind
from wsi_loader.view.browser._tiles import ERROR_GREY

pytestmark = pytest.mark.filterwarnings("ignore::ResourceWarning")
COMMAND = (sys.executable, "-m", "wsi_loader.cli", "serve")


def test_deep_zoom_descriptor_and_tiles(server: ViewerServer, archive: Archive) -> None:
    good = archive.ids["good.svs"]
    dzi = request(server.port, f"/slides/{good}.dzi")
    assert dzi.status == 200 and dzi.headers["content-type"].startswith("application/xml")
    assert re.search(rb'TileSize="256".*Width="5000" Height="4000"', dzi.body)
    # 14 levels (5000 px halves 13 times to 1 px); 20 x 16 tiles at the top
    tile = request(server.port, f"/slides/{good}_files/13/19_15.jpeg")
    assert tile.status == 200 and tile.headers["content-type"] == "image/jpeg"
    assert simplejpeg.decode_jpeg_header(tile.body)[:2] == (160, 136)  # the corner: cut
    assert request(server.port, f"/slides/{good}_files/13/20_0.jpeg").status == 404
    assert request(server.port, f"/slides/{good}_files/14/0_0.jpeg").status == 404
    head = request(server.port, f"/slides/{good}_files/0/0_0.jpeg", method="HEAD")
    assert head.status == 200 and head.body == b""
    assert request(server.port, f"/slides/{good}_files/0/0_0.jpeg", method="POST").status == 405


def test_tiles_are_cached_by_the_browser(server: ViewerServer, archive: Archive) -> None:
    good = archive.ids["good.svs"]
    version = request(server.port, f"/api/slides/{good}").json()["version"]
    path = f"/slides/{good}_files/12/1_1.jpeg"
    plain = request(server.port, path)
    assert plain.headers["cache-control"] == "no-cache" and plain.headers["etag"]
    pinned = request(server.port, f"{path}?v={version}")  # the page's URLs name the version
    assert "immutable" in pinned.headers["cache-control"]
    assert pinned.headers["etag"] == plain.headers["etag"] and pinned.body == plain.body
    again = request(server.port, path, headers={"If-None-Match": plain.headers["etag"]})
    assert again.status == 304 and again.body == b""
    other = request(server.port, f"/slides/{good}_files/12/2_1.jpeg")
    assert other.headers["etag"] != plain.headers["etag"]


def test_stored_tiles_are_sent_byte_for_byte(server: ViewerServer, archive: Archive) -> None:
    import tifffile

    good = archive.ids["good.svs"]
    with tifffile.TiffFile(archive.slide("good.svs")) as tif:
        page = tif.pages[0]
        across = -(-page.imagewidth // 256)
        for col, row in [(0, 0), (5, 7), (18, 14)]:
            index = row * across + col
            tif.filehandle.seek(page.dataoffsets[index])
            stored = tif.filehandle.read(page.databytecounts[index])
            tile = request(server.port, f"/slides/{good}_files/13/{col}_{row}.jpeg")
            assert tile.body == page.jpegtables[:-2] + stored[2:]


TRAVERSALS = [
    "/slides/../../../../etc/passwd",
    "/slides/..%2F..%2F..%2Fetc%2Fpasswd.dzi",
    "/slides/%2e%2e/%2e%2e/etc/passwd.dzi",
    "/slides//etc/passwd.dzi",
    "/slides/%2Fetc%2Fpasswd.dzi",
    "/slides/0_files/13/0_0.jpeg/../../../etc/passwd",
    "/static/../_app.py",
    "/static/%2e%2e/_app.py",
    "/static/..%2F_app.py",
    "/static//etc/passwd",
    "/static/%2Fetc%2Fpasswd",
    "/static/",
    "/static/openseadragon/",
    "/static/openseadragon/images/",
    "//etc/passwd",
    "/etc/passwd",
    "/web/viewer.js",
    "/slides/99.dzi",
    "/slides/-1.dzi",
    "/slides/1e0.dzi",
    "/slides/+1.dzi",
    "/slides/%31.dzi%00",
    "/slides/0x1.dzi",
    "/slides/99999999999999999999999999999999999999.dzi",
    "/slides/{good}_files/99999999999999999999/0_0.jpeg",
    "/slides/{good}_files/13/999999999_0.jpeg",
    "/slides/{good}_files/13/-1_0.jpeg",
    "/slides/{good}_files/-13/0_0.jpeg",
    "/slides/{good}_files/13/0_0_0.jpeg",
    "/slides/{good}_files/13/0_0.png",
    "/slides/{good}_files/1" + "0" * 5000 + "/0_0.jpeg",
    "/api/slides/99",
    "/api/slides/{good}/rows/99999999.png",
    "/api/slides/{good}/rows/{other_row}.png",
    "/api/slides/{good}/predictions/7.png",
    "/api/slides/{good}/predictions/-1.png",
    "/api/slides/{good}/at?x=nan&y=1",
    "/api/slides/{good}/at?x=1",
]


def test_traversal_and_out_of_range_requests_get_4xx(
    server: ViewerServer, archive: Archive
) -> None:
    good = archive.ids["good.svs"]
    other_row = int(archive.index.slide_starts()[archive.ids["bad.svs"]])
    for template in TRAVERSALS:
        path = template.format(good=good, other_row=other_row)
        reply = request(server.port, path)
        assert 400 <= reply.status < 500, (path, reply.status)
        assert b"root:" not in reply.body and b"import" not in reply.body, path


def test_a_page_elsewhere_cannot_reach_a_loopback_server(server: ViewerServer) -> None:
    # DNS rebinding: a name the attacker controls, resolved to 127.0.0.1
    for host in (
        "attacker.example:8000",
        "127.0.0.1.attacker.example",
        "",
        "localhost.:1",
        "127.0.0.1:80@attacker.example",
        "[::1]attacker.example",
        "[::1",
    ):
        assert request(server.port, "/api/slides", headers={"Host": host}).status == 400
    for host in (f"localhost:{server.port}", f"[::1]:{server.port}", "127.0.0.1"):
        assert request(server.port, "/api/slides", headers={"Host": host}).status == 200


def test_a_token_guards_every_data_request(
    archive: Archive, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from wsi_loader.view.browser import _app as app

    # whether the front end is built or not (the page then says how to build it): the
    # guard is the same; here it is not
    monkeypatch.setattr(app, "STATIC", tmp_path / "static")
    with ViewerServer(archive.index, token="s3cret-token") as guarded:
        port = guarded.port
        assert guarded.url.endswith("/?token=s3cret-token")
        assert request(port, "/api/slides").status == 403
        assert request(port, "/slides/0.dzi").status == 403
        assert request(port, "/slides/0_files/0/0_0.jpeg").status == 403
        assert request(port, "/api/slides?token=wrong").status == 403
        assert request(port, "/").status == 503  # the page holds no data: no token asked
        assert request(port, "/static/viewer.js").status == 200  # nor its scripts
        opened = request(port, "/api/slides?token=s3cret-token")
        assert opened.status == 200
        cookie = opened.headers["set-cookie"]
        assert "HttpOnly" in cookie and "SameSite=Strict" in cookie
        value = cookie.split(";")[0]
        assert request(port, "/api/slides", headers={"Cookie": value}).status == 200
        auth = {"Authorization": "token s3cret-token"}
        assert request(port, "/api/slides", headers=auth).status == 200
        assert opened.headers["referrer-policy"] == "no-referrer"


def test_the_listening_socket_says_it_is_tcp() -> None:
    # asyncio sets TCP_NODELAY only on sockets whose proto is IPPROTO_TCP; without it every
    # response's body waited ~40 ms for the client's delayed ACK (tiles/s fell 20x)
    sock = bind("127.0.0.1", 0)
    try:
        assert sock.proto == socket.IPPROTO_TCP
    finally:
        sock.close()


def test_a_non_loopback_bind_needs_a_token() -> None:
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("192.0.2.7")
    with pytest.raises(ConfigError, match="without a token"):
        check_token("0.0.0.0", "")
    generated = check_token("0.0.0.0", None)
    assert generated is not None and len(generated) >= 24
    assert check_token("0.0.0.0", None) != generated
    assert check_token("127.0.0.1", None) is None
    assert check_token("0.0.0.0", "mine") == "mine"


def test_the_command_refuses_a_non_loopback_bind_without_a_token(archive: Archive) -> None:
    done = subprocess.run(
        [*COMMAND, str(archive.index.path), "--host", "0.0.0.0", "--token", ""],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 2 and "without a token" in done.stderr, done.stderr


def test_slide_details_and_overlays(server: ViewerServer, archive: Archive) -> None:
    good = archive.ids["good.svs"]
    index = archive.index
    details = request(server.port, f"/api/slides/{good}").json()
    assert details["name"] == "good.svs" and details["label"] == "normal"
    assert details["mpp"] == pytest.approx(0.5) and details["problem"] is None
    assert details["labels"] == ["normal", "tumour"] and details["classes"] == ["Tumor"]
    assert details["qc"] == sorted(QC_COLUMNS)  # every QC column the build measured
    assert details["predictions"] == {"classes": ["normal", "tumour"]}
    grid = request(server.port, f"/api/slides/{good}/grid.bin").body
    columns = {
        c["name"]: np.frombuffer(
            grid, dtype=_dtype(c["type"]), count=details["grid"]["count"], offset=c["offset"]
        )
        for c in details["grid"]["columns"]
    }
    starts = index.slide_starts()
    rows = np.arange(starts[good], starts[good + 1])
    assert np.array_equal(columns["row"], rows)
    assert np.array_equal(columns["x"], index.columns["l0_x"][rows])
    assert np.array_equal(columns["label"], index.tile_labels(rows))
    for name in QC_COLUMNS:
        assert np.allclose(columns[name], index.columns[name][rows], equal_nan=True)
    tumour = (columns["annotation"] == 0) & (columns["coverage"] == 1)
    inside = (columns["x"] >= 1024) & (columns["x"] < 2048) & (columns["y"] >= 1024)
    assert tumour.any() and np.array_equal(tumour, inside & (columns["y"] < 2048))
    outlines = request(server.port, f"/api/slides/{good}/annotations.json").json()
    assert outlines["classes"] == ["Tumor"]
    x0, y0, x1, y1 = TUMOUR_BOX
    ring = outlines["rings"][0]["points"]
    assert {(ring[i], ring[i + 1]) for i in range(0, len(ring), 2)} == {
        (x0, y0),
        (x1, y0),
        (x1, y1),
        (x0, y1),
    }
    tissue = request(server.port, f"/api/slides/{good}/tissue.png")
    mask = np.asarray(Image.open(io.BytesIO(tissue.body)))
    assert mask.shape[2] == 4 and 0.1 < (mask[..., 3] > 0).mean() < 0.9


def _dtype(kind: str) -> np.dtype:
    return np.dtype({"Int32": "<i4", "Float32": "<f4", "Int16": "<i2", "Uint8": "u1"}[kind])


def test_clicking_a_point_gives_the_tile_under_it(server: ViewerServer, archive: Archive) -> None:
    index = archive.index
    good, bad = archive.ids["good.svs"], archive.ids["bad.svs"]
    row = int(index.slide_starts()[good]) + 10
    x, y = int(index.columns["l0_x"][row]), int(index.columns["l0_y"][row])
    found = request(server.port, f"/api/slides/{good}/at?x={x + 100}&y={y + 200.5}").json()
    tile = found["tile"]
    assert (tile["row"], tile["x"], tile["y"], tile["label"]) == (row, x, y, "normal")
    assert tile["status"] == "ok" and tile["qc_focus"] is not None
    assert found["predictions"]["tumour"] == pytest.approx(x / 5000, abs=1e-4)
    assert request(server.port, f"/api/slides/{good}/at?x=-5&y=-5").json()["tile"] is None
    failed = request(server.port, f"/api/slides/{bad}/at?x=800&y=800").json()["tile"]
    assert failed["status"] == "quarantined" and "Bogus marker" in failed["failure"]
    picture = request(server.port, f"/api/slides/{good}/rows/{row}.png")
    pixels = np.asarray(Image.open(io.BytesIO(picture.body)).convert("RGB"))
    with openslide.OpenSlide(archive.slide("good.svs")) as slide:
        expected = np.asarray(slide.read_region((x, y), 0, (256, 256)).convert("RGB"))
    assert np.array_equal(pixels, expected)  # lossless, and the raw path is OpenSlide's pixels


def test_prediction_heatmaps(server: ViewerServer, archive: Archive) -> None:
    good, bad = archive.ids["good.svs"], archive.ids["bad.svs"]
    reply = request(server.port, f"/api/slides/{good}/predictions/1.png")
    assert reply.status == 200
    _, _, width, height = (float(v) for v in reply.headers["x-bounds"].split(","))
    heatmap = np.asarray(Image.open(io.BytesIO(reply.body)))
    assert heatmap.shape[:2] == (round(height / 256), round(width / 256))
    seen = heatmap[..., 3] > 0
    assert seen.sum() == archive.index.slides[good].tiles  # one pixel per predicted tile
    # P(tumour) rises left to right: so do the colours' brightness (viridis)
    brightness = heatmap[..., :3].astype(float).sum(axis=2)
    cols = [
        brightness[:, c][seen[:, c]].mean() for c in range(heatmap.shape[1]) if seen[:, c].any()
    ]
    assert cols == sorted(cols)
    details = request(server.port, f"/api/slides/{bad}").json()
    assert details["predictions"] is None
    assert (
        "bad.csv:2:" in details["predictions_error"]
        and "not numbers" in details["predictions_error"]
    )


def test_a_symlinked_prediction_file_is_never_read(server: ViewerServer, archive: Archive) -> None:
    replaced = archive.ids["replaced.svs"]
    details = request(server.port, f"/api/slides/{replaced}").json()
    assert details["predictions"] is None and details["predictions_error"] is None
    assert request(server.port, f"/api/slides/{replaced}/predictions/0.png").status == 404


def test_missing_and_replaced_slides_are_said(server: ViewerServer, archive: Archive) -> None:
    gone, replaced = archive.ids["gone.svs"], archive.ids["replaced.svs"]
    details = request(server.port, f"/api/slides/{gone}").json()
    assert "does not exist" in details["problem"]
    assert (details["width"], details["height"]) == (2048, 1536)  # from the index
    assert re.search(
        rb'Width="2048" Height="1536"', request(server.port, f"/slides/{gone}.dzi").body
    )
    tile = request(server.port, f"/slides/{gone}_files/11/1_1.jpeg")
    assert tile.status == 200 and tile.headers["cache-control"] == "no-store"
    assert "does not exist" in tile.headers["x-tile-error"]
    assert abs(simplejpeg.decode_jpeg(tile.body).astype(int) - ERROR_GREY).mean() < 30
    problem = request(server.port, f"/api/slides/{replaced}").json()["problem"]
    assert "replaced since indexing" in problem
    broken = archive.ids["broken.svs"]  # never indexed: no size known
    details = request(server.port, f"/api/slides/{broken}").json()
    assert details["status"] == "failed" and details["error"] and details["grid"]["count"] == 0
    assert request(server.port, f"/slides/{broken}_files/0/0_0.jpeg").headers["x-tile-error"]


def test_a_touched_slide_is_not_a_replaced_one(archive: Archive, tmp_path: Path) -> None:
    good = archive.ids["good.svs"]
    copy = tmp_path / "good.svs"
    copy.write_bytes(archive.slide("good.svs").read_bytes())  # a copy: another mtime
    record = dataclasses.replace(archive.index.slides[good], path=str(copy))
    slides = list(archive.index.slides)
    slides[good] = record
    moved = dataclasses.replace(archive.index, slides=tuple(slides))
    with ViewerServer(moved) as viewer:
        assert request(viewer.port, f"/api/slides/{good}").json()["problem"] is None
        os.utime(copy, (1, 1))
        assert request(viewer.port, f"/api/slides/{good}").json()["problem"] is None


def test_a_symlinked_quarantine_is_not_read(archive: Archive, tmp_path: Path) -> None:
    index_dir = tmp_path / "idx"
    shutil.copytree(archive.index.path, index_dir)
    real = index_dir / "quarantine.jsonl"
    outside = tmp_path / "elsewhere.jsonl"
    outside.write_bytes(real.read_bytes())
    real.unlink()
    real.symlink_to(outside)
    moved = dataclasses.replace(archive.index, path=index_dir)
    bad = archive.ids["bad.svs"]
    with ViewerServer(moved) as viewer:
        tile = request(viewer.port, f"/api/slides/{bad}/at?x=800&y=800").json()["tile"]
        assert tile["status"] == "ok" and tile["failure"] is None


def test_an_unreadable_tile_is_grey_and_counted(server: ViewerServer, archive: Archive) -> None:
    bad = archive.ids["bad.svs"]
    top = 11  # 2048 px: 12 levels
    tile = request(server.port, f"/slides/{bad}_files/{top}/3_3.jpeg")
    assert tile.status == 200 and "cannot be decoded" in tile.headers["x-tile-error"]
    assert (
        request(server.port, f"/slides/{bad}_files/{top}/2_3.jpeg").headers.get("x-tile-error")
        is None
    )
    status = request(server.port, f"/api/slides/{bad}/status").json()
    assert status["faults"] >= 1 and "cannot be decoded" in status["last"]


def test_the_page_and_its_assets(server: ViewerServer, frontend: str | None) -> None:
    needs_page(frontend)
    page = request(server.port, "/")
    assert page.status == 200 and b"openseadragon.min.js" in page.body
    assert "script-src 'self'" in page.headers["content-security-policy"]
    script = request(server.port, "/static/openseadragon/openseadragon.min.js")
    assert script.status == 200 and len(script.body) > 100_000
    assert request(server.port, "/static/viewer.js").status == 200
    assert request(server.port, "/static/openseadragon/images/zoomin_rest.png").status == 200
    assert request(server.port, "/static/openseadragon/openseadragon.min.js.map").status == 404


def test_without_the_built_front_end_the_page_says_how_to_build_it(
    archive: Archive, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from wsi_loader.view.browser import _app as app

    monkeypatch.setattr(app, "STATIC", tmp_path / "static")
    with ViewerServer(archive.index) as viewer:
        page = request(viewer.port, "/")
        assert page.status == 503 and b"make frontend" in page.body
        assert request(viewer.port, "/api/slides").status == 200  # the data is still served


def test_show_embeds_the_viewer_in_a_notebook(archive: Archive) -> None:
    try:
        frame = show(archive.index, slide="good")
        html = frame._repr_html_()
        src = re.search(r'src="([^"]+)"', html).group(1)  # type: ignore[union-attr]
        assert f"slide={archive.ids['good.svs']}" in src and src.startswith("http://127.0.0.1:")
        port = int(src.split(":")[2].split("/")[0])
        assert request(port, "/api/slides").status == 200
        assert show(archive.index, slide="bad").server is frame.server  # one server, reused
    finally:
        stop_shown()
    assert not frame.server.running


def test_the_command_prints_its_url_and_stops_on_ctrl_c(archive: Archive) -> None:
    process = subprocess.Popen(
        [*COMMAND, str(archive.index.path), "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO,
    )
    try:
        line = process.stdout.readline()  # type: ignore[union-attr]
        url = re.search(r"http://127\.0\.0\.1:(\d+)/", line)
        assert url, line
        port = int(url.group(1))
        assert request(port, "/api/slides").json()["slides"][0]["name"]
        process.send_signal(signal.SIGINT)
        _, errors = process.communicate(timeout=120)
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
    # uvicorn stops, then the interrupt ends the command as it ends every other one
    assert process.returncode == 130, errors
    assert errors.strip().endswith("interrupted") and "Traceback" not in errors


@pytest.mark.slow
def test_slides_in_a_bucket_are_served(s3_endpoint: str, archive: Archive, tmp_path: Path) -> None:
    from tests.conftest import upload
    from wsi_loader.index import build_index

    upload(archive.slide("good.svs"), "s3://slides/viewer/good.svs")
    remote = build_index(
        ["s3://slides/viewer/good.svs"], tmp_path / "idx", tile_size=256, level=0, min_tissue=0.05
    )
    with ViewerServer(remote) as viewer:
        details = request(viewer.port, "/api/slides/0").json()
        assert details["problem"] is None and details["width"] == 5000
        for path in ("/slides/0_files/13/5_7.jpeg", "/slides/0_files/12/2_2.jpeg"):
            ours = request(viewer.port, path)
            local = request(viewer.port, path)  # the second from the cache
            assert ours.status == 200 and ours.body == local.body
        stored = request(viewer.port, "/slides/0_files/13/5_7.jpeg").body
        assert viewer.app.state.viewer.maker.passed_through >= 1
        with ViewerServer(archive.index) as here:
            good = archive.ids["good.svs"]
            assert request(here.port, f"/slides/{good}_files/13/5_7.jpeg").body == stored


@pytest.mark.parametrize("port", [99999, -1, 65536])
def test_a_port_out_of_range_is_a_clear_error(
    port: int, archive: Archive, capsys: pytest.CaptureFixture[str]
) -> None:
    # it used to end in a traceback: OverflowError: bind(): port must be 0-65535
    from wsi_loader.cli.main import main
    from wsi_loader.view.browser import serve

    with pytest.raises(SystemExit) as info:
        main(["serve", str(archive.index.path), "--port", str(port)])
    assert info.value.code == 2
    assert f"--port: {port} is not a port (0-65535" in capsys.readouterr().err
    with pytest.raises(ConfigError, match=f"{port} is not a port \\(0-65535") as error:
        serve(archive.index, port=port)
    assert (error.value.key, error.value.value) == ("port", port)
    with pytest.raises(ConfigError, match="is not a port"):
        bind("127.0.0.1", port)


def test_a_quarantine_record_marks_only_the_tile_of_its_level(
    archive: Archive, tmp_path: Path
) -> None:
    # the dataset matches records by (x, y, level): a level-1 record is not this level-0 tile
    index_dir = tmp_path / "idx"
    shutil.copytree(archive.index.path, index_dir)
    moved = dataclasses.replace(archive.index, path=index_dir)
    good = archive.ids["good.svs"]
    record = moved.slides[good]
    row = int(moved.slide_starts()[good])
    starts = [
        (int(moved.columns["l0_x"][row + k]), int(moved.columns["l0_y"][row + k])) for k in range(3)
    ]
    levels: list[int | None] = [1, None, 0]  # another level, any level, this level
    for (x, y), level in zip(starts, levels, strict=True):
        entry = {
            "path": record.path,
            "x": x,
            "y": y,
            "error": "read failed",
            "fingerprint": record.fingerprint,
        }
        moved.quarantine.append(entry if level is None else {**entry, "level": level})
    moved.quarantine.append(  # a level-1 record where no level-0 tile is: not a cell either
        {"path": record.path, "x": 4096, "y": 64, "level": 1, "error": "read failed"}
    )
    assert (
        int(moved.quarantined_mask()[row]) == 0
        and moved.quarantined_mask()[row + 1 : row + 3].all()
    )
    with ViewerServer(moved) as viewer:
        shown = [
            request(viewer.port, f"/api/slides/{good}/at?x={x + 10}&y={y + 10}").json()["tile"]
            for x, y in starts
        ]
        assert [t["status"] for t in shown] == ["ok", "quarantined", "quarantined"]
        assert shown[0]["failure"] is None
        details = request(viewer.port, f"/api/slides/{good}").json()
        assert details["grid"]["count"] == record.tiles


def test_ids_that_are_not_ascii_digits_or_past_the_last_slide_are_404(
    server: ViewerServer, archive: Archive
) -> None:
    count = len(archive.index.slides)
    # the id equal to the slide count is one past the last (an off-by-one answered 500);
    # "²" is a digit to str.isdigit but not to int(); U+0660 (Arabic-Indic zero) is 0 to int()
    for sid in (str(count), "%C2%B2", "%D9%A0", "%D9%A1", "%EF%BC%90"):
        for path in (
            f"/api/slides/{sid}",
            f"/slides/{sid}.dzi",
            f"/slides/{sid}_files/0/0_0.jpeg",
            f"/api/slides/{sid}/grid.bin",
        ):
            assert request(server.port, path).status == 404, path
    assert request(server.port, f"/api/slides/{count - 1}").status == 200
    good = archive.ids["good.svs"]
    assert request(server.port, f"/slides/{good}_files/%D9%A0/0_0.jpeg").status == 404
    assert request(server.port, f"/api/slides/{good}/predictions/%C2%B9.png").status == 404


def test_error_texts_sent_to_the_browser_carry_no_paths_and_no_file_bytes(
    make_slide: SlideFactory,
    server: ViewerServer,
    archive: Archive,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    # a slide replaced by a link to another file: its errors quote that file's first bytes
    slides = tmp_path / "slides"
    slides.mkdir()
    shutil.copy(make_slide(width=2048, height=1536, seed=36), slides / "victim.svs")
    index = build_index([slides], tmp_path / "idx", tile_size=256, level=0, min_tissue=0.05)
    secret = tmp_path / "secret.txt"
    secret.write_text("SECRET-root:x:0:0:root:/root:/bin/bash\n" * 40)
    (slides / "victim.svs").unlink()
    (slides / "victim.svs").symlink_to(secret)
    row = int(index.slide_starts()[0])
    x, y = int(index.columns["l0_x"][row]), int(index.columns["l0_y"][row])
    sent: list[bytes] = []
    with caplog.at_level(logging.WARNING), ViewerServer(index) as viewer:
        for path in (
            "/api/slides",
            "/api/slides/0",
            "/slides/0.dzi",
            "/slides/0_files/11/0_0.jpeg",
            "/api/slides/0/tissue.png",
            f"/api/slides/0/rows/{row}.png",
            f"/api/slides/0/at?x={x + 1}&y={y + 1}",
            "/api/slides/0/status",
        ):
            reply = request(viewer.port, path)
            sent.append(repr(reply.headers).encode() + reply.body)
        tile = request(viewer.port, "/slides/0_files/11/0_0.jpeg").headers["x-tile-error"]
    assert tile.startswith("no reader can open the slide file") and "server's log" in tile
    for server_path in (str(tmp_path), str(secret)):
        assert not any(server_path.encode() in s for s in sent), server_path
    assert not any(b"SECR" in s for s in sent)
    assert "SECR" in caplog.text  # the full text goes to the server's log
    # the shared archive: its index path, a slide that failed to index (its error quoted the
    # file's first bytes) and a predictions table that is not one (its path)
    listing = request(server.port, "/api/slides")
    assert str(archive.root).encode() not in listing.body and b"header=b'not" not in listing.body
    assert listing.json()["index"] == archive.index.path.name
    for name in ("bad.svs", "broken.svs"):
        details = request(server.port, f"/api/slides/{archive.ids[name]}").json()
        assert str(archive.root) not in json.dumps(details), name
    bad = request(server.port, f"/api/slides/{archive.ids['bad.svs']}").json()
    assert "bad.csv:2:" in bad["predictions_error"]


HALF_SENT = b"GET /api/slides HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: "  # never finished


def half_open(port: int, count: int) -> list[socket.socket]:
    """A bounded slowloris: ``count`` connections, each with a request head never finished."""
    held = []
    for _ in range(count):
        sock = socket.create_connection(("127.0.0.1", port), timeout=120)
        sock.sendall(HALF_SENT)
        held.append(sock)
    return held


def closed_by_server(sock: socket.socket) -> bool:
    sock.setblocking(False)
    try:
        return sock.recv(1) == b""
    except BlockingIOError:
        return False
    except ConnectionResetError:
        return True
    finally:
        sock.setblocking(True)


def wait_for(condition: Callable[[], bool], timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "not true in time"
        time.sleep(0.05)


def test_half_sent_requests_cannot_take_every_file_descriptor(archive: Archive) -> None:
    # the command with 256 file descriptors: 600 half-sent requests took them all, and a
    # real request then waited in the listen queue for ever
    import resource

    def few_descriptors() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256))

    process = subprocess.Popen(
        [*COMMAND, str(archive.index.path), "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,  # never read: a full pipe would stop the server
        text=True,
        cwd=REPO,
        preexec_fn=few_descriptors,  # noqa: PLW1509 (no threads in this test process's child yet)
    )
    held: list[socket.socket] = []
    try:
        line = process.stdout.readline()  # type: ignore[union-attr]
        port = int(re.search(r"http://127\.0\.0\.1:(\d+)/", line).group(1))  # type: ignore[union-attr]
        held = half_open(port, 600)
        reply = request(port, "/api/slides")
        assert reply.status == 200 and reply.json()["slides"]
    finally:
        for sock in held:
            sock.close()
        process.send_signal(signal.SIGINT)
        process.communicate(timeout=60)


def test_a_request_head_not_sent_in_time_is_closed_and_the_oldest_make_room(
    archive: Archive,
) -> None:
    limits = ConnectionLimits(max_connections=16, header_timeout_s=1.0)
    with ViewerServer(archive.index, limits=limits) as viewer:
        held = half_open(viewer.port, 100)
        try:
            assert request(viewer.port, "/api/slides").status == 200  # answered amid them
            # at most 16 held: the ones that waited longest were closed to make room
            wait_for(lambda: sum(closed_by_server(s) for s in held) >= 100 - 16)
            # a kept-alive connection that trickles its next request gets no more time
            kept = socket.create_connection(("127.0.0.1", viewer.port), timeout=120)
            held.append(kept)
            kept.sendall(b"GET /api/slides HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            assert kept.recv(65536).startswith(b"HTTP/1.1 200")
            kept.sendall(HALF_SENT)
            for sock in held:  # every one closed after its second (blocks until it is)
                sock.settimeout(120)
                with contextlib.suppress(ConnectionResetError):
                    while sock.recv(65536):
                        pass
        finally:
            for sock in held:
                sock.close()


def test_a_wildcard_bind_prints_the_addresses_it_answers_on(archive: Archive) -> None:
    process = subprocess.Popen(
        [*COMMAND, str(archive.index.path), "--host", "0.0.0.0", "--port", "0", "--token", "t0k"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        cwd=REPO,
    )
    try:
        line = process.stdout.readline()  # type: ignore[union-attr]
        urls = re.findall(r"http://([^/\s,]+):(\d+)/\?token=t0k", line)
        assert urls and "0.0.0.0" not in line, line
        assert urls[0][0] == "127.0.0.1"
        # this machine's IPv4 addresses, as the system lists them (Debian's `hostname -I`)
        listed = subprocess.run(["hostname", "-I"], capture_output=True, text=True, check=False)
        ours = {a for a in listed.stdout.split() if "." in a}
        assert ours <= {host for host, _ in urls}, (ours, line)
        for host, port in urls:  # each one answers, with the token
            connection = http.client.HTTPConnection(host.strip("[]"), int(port), timeout=60)
            try:
                connection.request("GET", "/api/slides?token=t0k")
                assert connection.getresponse().status == 200, host
            finally:
                connection.close()
    finally:
        process.send_signal(signal.SIGINT)
        process.communicate(timeout=60)
