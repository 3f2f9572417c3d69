"""The viewer in a real browser: Debian's chromium driven by Playwright (never a downloaded
browser), one browser and one server for the module. The page loads without console errors,
pan and zoom fetch only tiles that exist, the slide at full resolution is OpenSlide's pixels,
overlays change the pixels where the grid is, and clicking a tile shows its row.

Skipped when chromium is not installed, unless WSI_LOADER_REQUIRE_BROWSER=1 (CI sets it).
"""

from __future__ import annotations

import io
import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import openslide
import pytest
from PIL import Image

from tests.conftest import SlideFactory
from tests.view.browser.conftest import Archive, Predicted, needs_page
from wsi_loader.index import _qc as qc
from wsi_loader.index import build_index
from wsi_loader.predict._outputs import TilePredictions
from wsi_loader.synthetic import SlideSpec, with_qc_artefacts
from wsi_loader.view import QC_CLEAN, QC_COLOURS
from wsi_loader.view.browser import ViewerServer

CHROMIUM = "/usr/bin/chromium"
FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--disable-quic",
]
VIEWPORT = {"width": 1400, "height": 900}

if not os.path.exists(CHROMIUM) and not os.environ.get("WSI_LOADER_REQUIRE_BROWSER"):
    pytest.skip(
        "chromium is not installed (apt-get install chromium; `make test` does)",
        allow_module_level=True,
    )
sync_api = pytest.importorskip("playwright.sync_api")


@pytest.fixture(scope="module")
def browser(frontend: str | None) -> Iterator[Any]:
    needs_page(frontend)
    with sync_api.sync_playwright() as playwright:
        launched = playwright.chromium.launch(executable_path=CHROMIUM, args=FLAGS, headless=True)
        try:
            yield launched
        finally:
            launched.close()


class Page:
    """A page of the viewer with what it logged and every tile response it got."""

    def __init__(self, browser: Any, url: str) -> None:
        self.context = browser.new_context(viewport=VIEWPORT, device_scale_factor=1)
        self.page = self.context.new_page()
        self.errors: list[str] = []
        self.tiles: list[tuple[str, int]] = []
        self.page.on("console", self._console)
        self.page.on("pageerror", lambda error: self.errors.append(f"page error: {error}"))
        self.page.on("response", self._response)
        self.page.goto(url)
        self.evaluate("() => window.wsiViewer.ready")

    def _console(self, message: Any) -> None:
        if message.type in ("error", "warning") and "GroupMarkerNotSet" not in message.text:
            self.errors.append(f"console {message.type}: {message.text}")

    def _response(self, response: Any) -> None:
        if "_files/" in response.url:
            self.tiles.append((response.url, response.status))

    def evaluate(self, script: str, arg: Any = None) -> Any:
        return self.page.evaluate(script, arg)

    def wait(self, script: str, timeout: float = 120.0) -> None:
        """Until ``script`` (a function) returns true. Polled: the page's CSP forbids the
        eval that Playwright's wait_for_function needs."""
        deadline = time.monotonic() + timeout
        while not self.evaluate(script):
            if time.monotonic() > deadline:
                raise TimeoutError(f"not true after {timeout} s: {script}")
            time.sleep(0.05)

    def settled(self) -> None:
        """Every tile in view loaded and drawn, and the overlays drawn: OpenSeadragon's
        'fully loaded' is of the tiles it last wanted, so it must hold over a few frames
        after a change of view (the first frame after one may still answer for the old)."""
        self.wait("() => !!window.wsiViewer.state.grid")
        stable = 0
        deadline = time.monotonic() + 120
        while stable < 3:
            self.page.wait_for_timeout(60)
            loaded = self.evaluate(
                "() => window.wsiViewer.fullyLoaded() && !window.wsiViewer.viewer.isAnimating()"
            )
            stable = stable + 1 if loaded else 0
            if time.monotonic() > deadline:
                raise TimeoutError("the viewer did not settle in 120 s")

    def open(self, slide_id: int) -> None:
        self.evaluate("(id) => window.wsiViewer.openSlide(id)", slide_id)
        self.wait(
            f"() => window.wsiViewer.state.slide && window.wsiViewer.state.slide.id === {slide_id}"
        )
        self.settled()

    def show_at_full_resolution(self, l0_x: int, l0_y: int) -> tuple[float, float]:
        """Zoom to one screen pixel per level-0 pixel with (l0_x, l0_y) at the viewer's
        top-left quarter; returns where that point is on the screen."""
        return tuple(
            self.evaluate(
                """([x, y]) => {
                    const v = window.wsiViewer.viewer, vp = v.viewport;
                    vp.zoomTo(vp.imageToViewportZoom(1), null, true);
                    const size = vp.getContainerSize();
                    const centre = vp.imageToViewportCoordinates(
                        new OpenSeadragon.Point(x + size.x / 4, y + size.y / 4));
                    vp.panTo(centre, true);
                    vp.applyConstraints(true);
                    v.forceRedraw();
                    const p = vp.imageToViewerElementCoordinates(new OpenSeadragon.Point(x, y));
                    return [p.x, p.y];
                }""",
                [l0_x, l0_y],
            )
        )

    def overlays(self, **checked: bool) -> None:
        for name, on in checked.items():
            box = self.page.locator(f"#show-{name}")
            if box.is_checked() != on:
                box.click()
        self.evaluate("() => window.wsiViewer.draw()")
        self.page.wait_for_timeout(100)

    def viewer_pixels(self) -> np.ndarray:
        box = self.page.locator("#viewer").bounding_box()
        shot = self.page.screenshot(
            clip={"x": box["x"], "y": box["y"], "width": box["width"], "height": box["height"]}
        )
        return np.asarray(Image.open(io.BytesIO(shot)).convert("RGB"), dtype=np.int16)

    def close(self) -> None:
        self.context.close()


@pytest.fixture(scope="module")
def page(browser: Any, server: ViewerServer, archive: Archive) -> Iterator[Page]:
    opened = Page(browser, server.slide_url("good"))
    opened.settled()
    yield opened
    opened.close()


def test_the_page_loads_without_console_errors(page: Page, archive: Archive) -> None:
    assert page.errors == []
    names = page.page.locator("#slides li").all_inner_texts()
    assert len(names) == len(archive.index.slides)
    assert page.page.locator("#slides li.selected").inner_text().startswith("good.svs")
    page.page.locator("#search").fill("tumour")  # by label
    assert sorted(t.split("\n")[0] for t in page.page.locator("#slides li").all_inner_texts()) == [
        "bad.svs",
        "replaced.svs",
    ]
    page.page.locator("#search").fill("")
    assert "µm" in page.page.locator("#scalebar-text").inner_text()
    # no element per tile anywhere: the grid is one canvas
    assert page.evaluate("() => document.querySelectorAll('#viewer *').length") < 80


def test_every_tile_request_of_a_pan_and_zoom_returns_200(page: Page) -> None:
    page.tiles.clear()
    mouse = page.page.mouse
    box = page.page.locator("#viewer").bounding_box()
    cx, cy = box["x"] + box["width"] / 2, box["y"] + box["height"] / 2
    for _ in range(3):  # zoom in with the wheel, drag, zoom out
        mouse.move(cx, cy)
        mouse.wheel(0, -600)
        page.settled()
        mouse.move(cx, cy)
        mouse.down()
        mouse.move(cx - 300, cy - 150, steps=8)
        mouse.up()
        page.settled()
    page.evaluate("() => window.wsiViewer.viewer.viewport.zoomBy(6, null, true)")
    page.settled()
    page.evaluate("() => window.wsiViewer.viewer.viewport.goHome(true)")
    page.settled()
    assert len(page.tiles) > 20
    assert {status for _, status in page.tiles} == {200}, [t for t in page.tiles if t[1] != 200]
    assert page.errors == []


def test_full_resolution_is_openslides_pixels(page: Page, archive: Archive) -> None:
    page.overlays(grid=False, failures=False, annotations=False, tissue=False)
    x0, y0 = 1500, 1100  # level-0; a region across several stored tiles
    sx, sy = page.show_at_full_resolution(x0, y0)
    page.settled()
    assert abs(sx - round(sx)) < 1e-6 and abs(sy - round(sy)) < 1e-6  # no resampling
    sx, sy = round(sx), round(sy)
    pixels = page.viewer_pixels()
    width, height = 600, 400
    shown = pixels[sy : sy + height, sx : sx + width]
    with openslide.OpenSlide(archive.slide("good.svs")) as slide:
        region = slide.read_region((x0, y0), 0, (width, height)).convert("RGB")
    expected = np.asarray(region, dtype=np.int16)
    difference = np.abs(shown - expected)
    # the browser's JPEG decoder against OpenSlide's (libjpeg-turbo both: the same here)
    assert difference.mean() < 1.0 and np.percentile(difference, 99) < 8, difference.mean()
    page.overlays(grid=True, failures=True, annotations=True)


def grid_cell_mask(page: Page, archive: Archive, shape: tuple[int, ...]) -> np.ndarray:
    """Screen pixels inside a tile of the index (from the index's columns)."""
    index = archive.index
    good = archive.ids["good.svs"]
    starts = index.slide_starts()
    rows = slice(int(starts[good]), int(starts[good + 1]))
    corners = page.evaluate(
        """(boxes) => boxes.map(([x, y]) => {
            const vp = window.wsiViewer.viewer.viewport;
            const a = vp.imageToViewerElementCoordinates(new OpenSeadragon.Point(x, y));
            const b = vp.imageToViewerElementCoordinates(new OpenSeadragon.Point(x + 256, y + 256));
            return [a.x, a.y, b.x, b.y];
        })""",
        [
            [int(x), int(y)]
            for x, y in zip(index.columns["l0_x"][rows], index.columns["l0_y"][rows], strict=True)
        ],
    )
    mask = np.zeros(shape[:2], dtype=bool)
    for x0, y0, x1, y1 in corners:
        mask[max(0, round(y0)) : max(0, round(y1)), max(0, round(x0)) : max(0, round(x1))] = True
    return mask


def test_overlay_toggles_change_the_pixels_where_the_grid_is(page: Page, archive: Archive) -> None:
    page.evaluate("() => window.wsiViewer.viewer.viewport.goHome(true)")
    page.settled()
    page.overlays(grid=True, failures=False, annotations=False, tissue=False, predictions=False)
    with_grid = page.viewer_pixels()
    page.overlays(grid=False)
    without = page.viewer_pixels()
    cells = grid_cell_mask(page, archive, with_grid.shape)
    changed = np.abs(with_grid - without).max(axis=2) > 8
    inner = cells & ~np.roll(cells, 3, axis=0) | cells  # the cells themselves
    assert changed[inner].mean() > 0.8  # the grid colours its tiles...
    far = ~(np.roll(cells, 4, axis=0) | np.roll(cells, -4, axis=0) | cells)
    far &= ~(np.roll(cells, 4, axis=1) | np.roll(cells, -4, axis=1))
    far[:, -260:] = False  # the navigator
    assert changed[far].mean() < 0.01  # ...and nothing else
    page.overlays(predictions=True)
    page.wait("() => !!window.wsiViewer.state.heatmap")
    page.evaluate("() => window.wsiViewer.draw()")
    heat = page.viewer_pixels()
    assert (np.abs(heat - without).max(axis=2) > 8)[cells].mean() > 0.8
    page.overlays(predictions=False, tissue=True)
    page.wait("() => !!window.wsiViewer.state.tissue")
    page.evaluate("() => window.wsiViewer.draw()")
    tissue = page.viewer_pixels()
    assert (np.abs(tissue - without).max(axis=2) > 8)[cells].mean() > 0.3
    page.overlays(tissue=False, grid=True, failures=True, annotations=True)
    assert page.errors == []


def test_clicking_a_known_tile_shows_its_row(page: Page, archive: Archive) -> None:
    page.evaluate("() => window.wsiViewer.viewer.viewport.goHome(true)")
    page.settled()
    index = archive.index
    row = int(index.slide_starts()[archive.ids["good.svs"]]) + 20
    x, y = int(index.columns["l0_x"][row]) + 128, int(index.columns["l0_y"][row]) + 128
    sx, sy = page.evaluate(
        """([x, y]) => {
            const p = window.wsiViewer.viewer.viewport.imageToViewerElementCoordinates(
                new OpenSeadragon.Point(x, y));
            return [p.x, p.y];
        }""",
        [x, y],
    )
    box = page.page.locator("#viewer").bounding_box()
    page.page.mouse.click(box["x"] + sx, box["y"] + sy)
    page.wait("() => !document.getElementById('details').hidden")
    table = page.page.locator("#details-table").inner_text()
    assert f"row\t{row}" in table and "normal" in table and "qc_focus" in table
    page.wait("() => document.getElementById('details-image').naturalWidth === 256")
    assert page.errors == []


def test_an_unreadable_tile_is_grey_and_said(page: Page, archive: Archive) -> None:
    page.open(archive.ids["bad.svs"])
    page.overlays(grid=False, failures=False, annotations=False)
    sx, sy = page.show_at_full_resolution(768, 768)  # the broken storage tile
    page.settled()
    pixels = page.viewer_pixels()
    sx, sy = round(sx), round(sy)
    tile = pixels[sy + 20 : sy + 236, sx + 20 : sx + 236]
    assert (np.abs(tile - 160).max(axis=2) < 12).mean() > 0.7  # grey...
    assert (np.abs(tile - np.array([200, 30, 30])).max(axis=2) < 60).any()  # ...with a cross
    page.wait("() => document.getElementById('banner').textContent.includes('reads failed')", 120)
    page.overlays(grid=True, failures=True, annotations=True)
    assert [e for e in page.errors if "_files/" not in e] == []


def test_a_missing_slide_is_said_in_the_page(page: Page, archive: Archive) -> None:
    page.open(archive.ids["gone.svs"])
    banner = page.page.locator("#banner").inner_text()
    assert "does not exist" in banner
    page.open(archive.ids["replaced.svs"])
    assert "replaced since indexing" in page.page.locator("#banner").inner_text()
    broken = archive.ids["broken.svs"]
    page.evaluate("(id) => window.wsiViewer.openSlide(id)", broken)
    page.wait(f"() => window.wsiViewer.state.slide && window.wsiViewer.state.slide.id === {broken}")
    assert "was not indexed" in page.page.locator("#banner").inner_text()
    assert "failed" in page.page.locator("#slides li.selected").inner_text()
    page.open(archive.ids["good.svs"])
    assert page.page.locator("#banner").is_hidden()
    assert page.errors == []


def test_a_grid_of_100000_tiles_is_one_raster(
    browser: Any, archive: Archive, tmp_path: Path
) -> None:
    big = build_index(
        [archive.slide("good.svs")], tmp_path / "idx", tile_size=14, level=0, min_tissue=0.0
    )
    assert len(big) > 100_000
    with ViewerServer(big) as viewer:
        opened = Page(browser, viewer.slide_url(0))
        try:
            opened.settled()
            raster = opened.evaluate(
                "() => [window.wsiViewer.state.grid.gw, window.wsiViewer.state.grid.gh]"
            )
            columns = big.columns  # one raster pixel per grid cell
            assert raster == [len(np.unique(columns["l0_x"])), len(np.unique(columns["l0_y"]))]
            assert opened.evaluate("() => document.querySelectorAll('#viewer *').length") < 80
            opened.evaluate("() => window.wsiViewer.viewer.viewport.zoomBy(3, null, true)")
            opened.settled()
            assert opened.errors == []
        finally:
            opened.close()


@pytest.mark.testdata
def test_a_real_scans_rgb_tiles_pass_through_to_the_browser(
    browser: Any, testdata: Path, tmp_path: Path
) -> None:
    # Aperio's RGB JPEG tiles go out with an Adobe marker: the browser must decode them as RGB
    slide = tmp_path / "CMU-1-Small-Region.svs"
    shutil.copy(testdata / "CMU-1-Small-Region.svs", slide)
    index = build_index([slide], tmp_path / "idx", tile_size=240, level=0, min_tissue=0.0)
    with ViewerServer(index) as viewer:
        opened = Page(browser, viewer.slide_url(0))
        try:
            opened.settled()
            opened.overlays(grid=False, failures=False, annotations=False)
            x0, y0 = 720, 960  # on stored tile corners
            sx, sy = opened.show_at_full_resolution(x0, y0)
            opened.settled()
            sx, sy = round(sx), round(sy)
            shown = opened.viewer_pixels()[sy : sy + 480, sx : sx + 480]
            with openslide.OpenSlide(slide) as reference:
                expected = reference.read_region((x0, y0), 0, (480, 480)).convert("RGB")
            difference = np.abs(shown - np.asarray(expected, dtype=np.int16))
            assert difference.mean() < 2.0, difference.mean()
            assert viewer.app.state.viewer.maker.passed_through >= 4
            assert opened.errors == []
        finally:
            opened.close()


def test_predict_output_class_chooser_opacity_and_a_clicked_tiles_probabilities(
    browser: Any, predicted: Predicted
) -> None:
    """Over what ``wsi-loader predict`` wrote: the chooser lists the run's classes, the chosen
    class's heatmap is drawn over its cells at the chosen opacity, and a click shows the
    probabilities of the clicked tile's row of the slide's own CSV (``case-s1.csv``: a second
    slide named ``case``)."""
    table = TilePredictions.read_csv(predicted.out / "model-outputs-csv" / "case-s1.csv")
    with ViewerServer(predicted.index, predictions=predicted.out) as viewer:
        opened = Page(browser, viewer.slide_url(1))
        try:
            opened.settled()
            chooser = opened.page.locator("#prediction-class option")
            assert chooser.all_inner_texts() == ["normal", "tumour"]
            opened.overlays(grid=False, failures=False, annotations=False, predictions=False)
            base = opened.viewer_pixels()
            picture, bounds = request_png(viewer.port, "/api/slides/1/predictions/1.png")
            opened.page.locator("#prediction-class").select_option("1")
            opened.page.locator("#prediction-opacity").fill("60")
            opened.overlays(predictions=True)
            opened.wait("() => window.wsiViewer.state.heatmapKey === '1/1'")
            opened.evaluate("() => window.wsiViewer.draw()")
            at_60 = opened.viewer_pixels()
            opened.page.locator("#prediction-opacity").fill("100")
            opened.evaluate("() => window.wsiViewer.draw()")
            at_100 = opened.viewer_pixels()
            normal, _ = request_png(viewer.port, "/api/slides/1/predictions/0.png")
            opened.page.locator("#prediction-class").select_option("0")
            opened.wait("() => window.wsiViewer.state.heatmapKey === '1/0'")
            opened.evaluate("() => window.wsiViewer.draw()")
            at_100_normal = opened.viewer_pixels()
            # cell centres inside the map (the drawing is smoothed between cells; at a
            # cell's centre it is the cell's colour)
            rows, cols = picture.shape[:2]
            cells = [(r, c) for r in range(1, rows - 1) for c in range(1, cols - 1)
                     if (picture[r - 1 : r + 2, c - 1 : c + 2, 3] == 255).all()]  # fmt: skip
            points = [
                (bounds[0] + (c + 0.5) * bounds[2] / cols, bounds[1] + (r + 0.5) * bounds[3] / rows)
                for r, c in cells
            ]
            screen = opened.evaluate(
                """(points) => points.map(([x, y]) => {
                    const p = window.wsiViewer.viewer.viewport.imageToViewerElementCoordinates(
                        new OpenSeadragon.Point(x, y));
                    return [Math.round(p.x), Math.round(p.y)];
                })""",
                points,
            )
            height, width = base.shape[:2]
            checked = 0
            for (r, c), (sx, sy) in zip(cells, screen, strict=True):
                if not (0 <= sy < height and 0 <= sx < width - 260):  # not under the navigator
                    continue
                heat = picture[r, c, :3].astype(np.int16)
                assert np.abs(at_100[sy, sx] - heat).max() <= 3, (r, c)
                other = normal[r, c, :3].astype(np.int16)
                assert np.abs(at_100_normal[sy, sx] - other).max() <= 3, (r, c)
                blended = base[sy, sx] * 0.4 + heat * 0.6
                assert np.abs(at_60[sy, sx] - blended).max() <= 4, (r, c)
                checked += 1
            assert checked >= 20
            # a click off the tile's centre: the tile the grid picks, and its own probabilities
            x, y = (int(v) for v in table.boxes[len(table.boxes) // 2, :2])
            sx, sy = opened.evaluate(
                """([x, y]) => {
                    const p = window.wsiViewer.viewer.viewport.imageToViewerElementCoordinates(
                        new OpenSeadragon.Point(x, y));
                    return [p.x, p.y];
                }""",
                [x + 100, y + 90],
            )
            box = opened.page.locator("#viewer").bounding_box()
            opened.page.mouse.click(box["x"] + sx, box["y"] + sy)
            opened.wait("() => !document.getElementById('details').hidden")
            shown = dict(
                line.split("\t", 1)
                for line in opened.page.locator("#details-table").inner_text().splitlines()
            )
            tx, ty = (int(v) for v in shown["level-0 x, y"].split(", "))
            hit = np.flatnonzero((table.boxes[:, 0] == tx) & (table.boxes[:, 1] == ty))[0]
            for k, name in enumerate(table.classes):
                expected = round(float(table.probabilities[hit, k]), 4)
                assert float(shown[f"P({name})"]) == expected
            assert opened.errors == []
        finally:
            opened.close()


def request_png(port: int, path: str) -> tuple[np.ndarray, list[float]]:
    """A heatmap of the viewer's API: its RGBA pixels and the level-0 rectangle they cover."""
    from tests.view.browser.conftest import request

    reply = request(port, path)
    assert reply.status == 200
    picture = np.asarray(Image.open(io.BytesIO(reply.body)).convert("RGBA"))
    return picture, [float(v) for v in reply.headers["x-bounds"].split(",")]


def test_the_qc_mode_colours_each_tile_by_the_rule_that_flags_it(
    browser: Any, make_slide: SlideFactory, tmp_path: Path
) -> None:
    spec = with_qc_artefacts(SlideSpec(width=10_000, height=7_500, seed=4), scale=0.8)
    slide = make_slide(width=10_000, height=7_500, seed=4, artefacts=spec.artefacts)
    index = build_index([slide], tmp_path / "idx", tile_size=256, mpp=0.5)
    flagged = qc.flags(index.columns)
    with ViewerServer(index) as viewer:
        opened = Page(browser, viewer.slide_url(0))
        try:
            opened.settled()
            modes = opened.page.locator("#color-by option").all_inner_texts()
            assert "QC: flagged by rule" in modes
            assert {f"QC: {name[3:]}" for name in qc.QC_COLUMNS} <= set(modes)
            opened.page.select_option("#color-by", "qc")
            painted = opened.evaluate(
                """() => {
                    const g = window.wsiViewer.state.grid, canvas = window.wsiViewer.gridCanvas;
                    const data = canvas.getContext("2d").getImageData(0, 0, g.gw, g.gh).data;
                    const out = [];
                    for (let k = 0; k < g.cells.length; k++) {
                        const i = g.cells[k];
                        if (i < 0 || g.columns.row[i] < 0) continue;
                        out.push([g.columns.row[i], ...data.slice(4 * k, 4 * k + 3)]);
                    }
                    return out;
                }"""
            )
            legend = opened.page.locator("#legend").inner_text()
            assert opened.errors == []
        finally:
            opened.close()
    colour_of = {tuple(rgb): name for name, rgb in QC_COLOURS.items()}
    shown = {row: colour_of.get((r, g, b), "clean" if (r, g, b) == QC_CLEAN else "?")
             for row, r, g, b in painted}  # fmt: skip
    assert len(shown) == len(index)
    for row, name in shown.items():
        first = next((rule for rule in QC_COLOURS if flagged[rule][row]), "clean")
        assert name == first, row
    assert {"pen", "fold", "blur", "clean"} <= set(shown.values())
    assert "pen (qc_pen ≥ 0.1)" in legend and "blur (qc_focus < 0.5)" in legend


def boxes_on_screen(
    page: Page, boxes: list[list[int]], shape: tuple[int, ...], grow: int = 2
) -> np.ndarray:
    """Screen pixels inside any of the level-0 ``boxes`` (x, y, width, height), each grown by
    ``grow`` px (the edges of a box fall between screen pixels; < 0: shrunk)."""
    corners = page.evaluate(
        """(boxes) => boxes.map(([x, y, w, h]) => {
            const vp = window.wsiViewer.viewer.viewport;
            const a = vp.imageToViewerElementCoordinates(new OpenSeadragon.Point(x, y));
            const b = vp.imageToViewerElementCoordinates(new OpenSeadragon.Point(x + w, y + h));
            return [a.x, a.y, b.x, b.y];
        })""",
        boxes,
    )
    mask = np.zeros(shape[:2], dtype=bool)
    for x0, y0, x1, y1 in corners:
        top, left = max(0, int(np.floor(y0)) - grow), max(0, int(np.floor(x0)) - grow)
        mask[top : max(0, int(np.ceil(y1)) + grow), left : max(0, int(np.ceil(x1)) + grow)] = True
    return mask


def predictions_paint_only_tiles(opened: Page, boxes: list[list[int]]) -> np.ndarray:
    """The predictions at full opacity over the slide alone: no screen pixel outside every
    predicted tile changes; returns the screen with them."""
    opened.overlays(grid=False, failures=False, annotations=False, tissue=False, predictions=False)
    opened.settled()
    without = opened.viewer_pixels()
    opened.page.locator("#prediction-opacity").fill("100")
    opened.overlays(predictions=True)
    opened.wait("() => !!window.wsiViewer.state.heatmap")
    opened.evaluate("() => window.wsiViewer.draw()")
    heat = opened.viewer_pixels()
    tiles = boxes_on_screen(opened, boxes, heat.shape)
    changed = np.abs(heat - without).max(axis=2) > 8
    outside = ~tiles
    outside[:, -260:] = False  # the navigator
    outside[:45, :150] = False  # OpenSeadragon's buttons (they fade)
    assert changed[tiles].mean() > 0.5  # drawn...
    assert changed[outside].sum() == 0, changed[outside].sum()  # ...over the tiles only
    return heat


def test_predictions_are_drawn_over_their_tiles_only_and_above_the_grid(
    page: Page, archive: Archive
) -> None:
    page.open(archive.ids["good.svs"])
    page.evaluate("() => window.wsiViewer.viewer.viewport.goHome(true)")
    table = TilePredictions.read_csv(archive.predictions / "model-outputs-csv" / "good.csv")
    heat = predictions_paint_only_tiles(page, table.boxes.astype(int).tolist())
    # the grid under them: at full opacity the predictions are what shows on the tiles
    page.overlays(grid=True)
    both = page.viewer_pixels()
    inner = boxes_on_screen(page, table.boxes.astype(int).tolist(), both.shape, grow=-4)
    inner[:, -260:] = False  # not the cells' outlines, not the navigator
    assert np.abs(both - heat).max(axis=2)[inner].mean() < 2
    page.overlays(tissue=True)
    page.wait("() => !!window.wsiViewer.state.tissue")
    assert "tissue" in page.page.locator("#legend").inner_text()  # the tissue colour's legend
    page.page.locator("#prediction-opacity").fill("60")
    page.overlays(predictions=False, tissue=False, failures=True, annotations=True)
    assert page.errors == []


def test_a_smoothed_map_of_an_overlapping_grid_stays_on_its_tiles(
    browser: Any, predicted: Predicted
) -> None:
    table = TilePredictions.read_csv(predicted.out / "model-outputs-csv" / "case-s1.csv")
    with ViewerServer(predicted.index, predictions=predicted.out) as viewer:
        opened = Page(browser, viewer.slide_url(1))
        try:
            opened.settled()
            predictions_paint_only_tiles(opened, table.boxes.astype(int).tolist())
            assert opened.evaluate("() => !!window.wsiViewer.state.heatmap.filled")  # smoothed
            assert opened.errors == []
        finally:
            opened.close()
