"""``bench_serve.py --only browser``: the viewer page's overlay cost in Debian's chromium."""

from __future__ import annotations

from pathlib import Path

BROWSER_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
FRAME_TIMES = """async ([frames, zoom]) => {
    const w = window.wsiViewer, vp = w.viewer.viewport;
    while (!(w.viewer.world.getItemCount() && w.state.grid)) {
        await new Promise((done) => setTimeout(done, 50));
    }
    vp.goHome(true);
    if (zoom > 1) vp.zoomBy(zoom, null, true);
    await new Promise((done) => setTimeout(done, 300));
    const overlay = document.querySelector("canvas.wsi-overlay").getContext("2d");
    const start = performance.now();
    for (let i = 0; i < frames; i++) {
        w.draw();
        overlay.getImageData(0, 0, 1, 1);  // rasterise now: canvas drawing is deferred
    }
    const draw = (performance.now() - start) / frames;
    const colour = document.getElementById("color-by");
    const before = performance.now();
    colour.value = "tissue";
    colour.dispatchEvent(new Event("change"));
    return [draw, performance.now() - before, w.state.grid.count];
}"""


def browser_frames(slide: Path, scratch: Path) -> dict[str, float]:
    """The page's overlay cost with a grid of ~100,000 tiles (32 px tiles on the slide's level
    0), in Debian's chromium: ms per redraw of the overlays (what every frame of a pan or zoom
    pays), zoomed out and zoomed in (cell outlines drawn), and ms to repaint the grid in
    another colouring."""
    from playwright.sync_api import sync_playwright

    from wsi_loader.index import build_index
    from wsi_loader.view.browser import ViewerServer

    index = build_index([slide], scratch / f"idx-{slide.stem}-32px", tile_size=32, level=0)
    found: dict[str, float] = {"tiles": float(len(index))}
    with ViewerServer(index) as server, sync_playwright() as playwright:
        chromium = playwright.chromium.launch(
            executable_path="/usr/bin/chromium", args=BROWSER_FLAGS, headless=True
        )
        page = chromium.new_page(viewport={"width": 1400, "height": 900})
        page.goto(server.slide_url(0))
        page.evaluate("() => window.wsiViewer.ready")
        draw_out, repaint, count = page.evaluate(FRAME_TIMES, [50, 1])
        draw_in, _, _ = page.evaluate(FRAME_TIMES, [50, 16])
        cells = page.evaluate(
            "() => { const g = window.wsiViewer.state.grid, vp = window.wsiViewer.viewer.viewport;"
            " const b = vp.getBounds(true), s = vp.viewportToImageRectangle(b);"
            " return Math.round(s.width / g.stride) * Math.round(s.height / g.stride); }"
        )
        chromium.close()
    found.update(draw_zoomed_out_ms=draw_out, draw_zoomed_in_ms=draw_in, repaint_ms=repaint)
    print(
        f"\nthe page with {count:.0f} tiles in the grid (chromium, 1400 x 900): "
        f"{draw_out:.2f} ms per overlay redraw zoomed out, {draw_in:.2f} ms zoomed in "
        f"(~{cells} cells in view, outlined), {repaint:.1f} ms to colour the grid anew"
    )
    return found
