"""An index with everything the viewer shows: labels, a quarantined tile, annotations, the QC
columns the builder measures, predictions (in the layout of ``wsi-loader predict``), a slide
that could not be indexed, one that went missing and one replaced since indexing; and a small
HTTP client for servers on 127.0.0.1."""

from __future__ import annotations

import dataclasses
import http.client
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import REPO, SlideFactory
from tests.index.annotation_files import Region, rect, write_geojson
from wsi_loader.index import SlideIndex, build_index
from wsi_loader.view.browser import ViewerServer
from wsi_loader.view.browser._app import frontend_missing

GOOD = {"width": 5000, "height": 4000, "seed": 5}
BAD_TILES = [(3, 3), (4, 3)]  # level-0 storage tiles broken in bad.svs
TUMOUR_BOX = (1024, 1024, 2048, 2048)  # the annotated region of good.svs (level-0)


@dataclasses.dataclass
class Archive:
    root: Path
    index: SlideIndex
    predictions: Path
    ids: dict[str, int]  # slide file name -> id

    def slide(self, name: str) -> Path:
        return self.root / "slides" / name


def prediction_csv(index: SlideIndex, slide_id: int) -> str:
    """A prediction table over the slide's tiles, as predict writes it: P(tumour) rises from
    left to right, so each column of tiles has its own value."""
    starts = index.slide_starts()
    rows = slice(int(starts[slide_id]), int(starts[slide_id + 1]))
    xs, ys = index.columns["l0_x"][rows], index.columns["l0_y"][rows]
    width = index.slides[slide_id].width or 1
    lines = ["minx,miny,width,height,prob_normal,prob_tumour"]
    for x, y in zip(xs.tolist(), ys.tolist(), strict=True):
        p = round(x / width, 4)
        lines.append(f"{x},{y},256,256,{1 - p:.4f},{p:.4f}")
    return "\n".join(lines) + "\n"


@pytest.fixture(scope="package")
def archive(make_slide: SlideFactory, tmp_path_factory: pytest.TempPathFactory) -> Archive:
    root = tmp_path_factory.mktemp("viewer")
    slides = root / "slides"
    slides.mkdir()
    shutil.copy(make_slide(**GOOD), slides / "good.svs")
    shutil.copy(make_slide(width=2048, height=2048, seed=32, corrupt=BAD_TILES), slides / "bad.svs")
    shutil.copy(make_slide(width=2048, height=1536, seed=33), slides / "gone.svs")
    shutil.copy(make_slide(width=2048, height=1536, seed=34), slides / "replaced.svs")
    (slides / "broken.svs").write_bytes(b"not a slide at all\n" * 50)  # indexed as failed
    (slides / "labels.csv").write_text(
        "slide,label\ngood,normal\nbad,tumour\ngone,normal\nreplaced,tumour\n"
    )
    notes = root / "annotations"
    notes.mkdir()
    write_geojson(notes / "good.geojson", [Region("Tumor", rect(*TUMOUR_BOX))])
    index = build_index(
        [slides],
        root / "idx",
        tile_size=256,
        level=0,
        min_tissue=0.05,
        labels=str(slides / "labels.csv"),
        annotations=str(notes),
    )
    ids = {os.path.basename(s.path): i for i, s in enumerate(index.slides)}
    # a training run met the broken tile of bad.svs: quarantined
    bad = index.slides[ids["bad.svs"]]
    index.quarantine.append(
        {
            "slide_id": ids["bad.svs"],
            "path": bad.path,
            "x": 768,
            "y": 768,
            "level": 0,
            "error": "read failed: Bogus marker length",
            "fingerprint": bad.fingerprint,
        }
    )
    (slides / "gone.svs").unlink()  # moved away since indexing
    shutil.copy(make_slide(width=2048, height=1536, seed=35), slides / "replaced.svs")
    predictions = root / "predictions"
    tables = predictions / "model-outputs-csv"
    tables.mkdir(parents=True)
    (tables / "good.csv").write_text(prediction_csv(index, ids["good.svs"]))
    (tables / "bad.csv").write_text("minx,miny,width,height,prob_tumour\n0,0,256,256,high\n")
    secret = root / "secret.csv"
    secret.write_text("minx,miny,width,height,prob_x\n0,0,1,1,0.5\n")
    (tables / "replaced.csv").symlink_to(secret)  # must never be read through
    return Archive(root, index, predictions, ids)


@pytest.fixture(scope="package")
def frontend() -> str | None:
    """Why the page cannot work (None: it can). The front end (OpenSeadragon, from the npm
    registry: never committed) is built with ``make frontend`` when it is not, before any
    server of these tests reads its files; tests of the page skip with this reason when it
    cannot be built (no npm, no registry), and every test of the data runs either way."""
    missing = frontend_missing()
    if missing is None or not (shutil.which("npm") and shutil.which("make")):
        return missing
    done = subprocess.run(
        ["make", "frontend"], cwd=REPO, capture_output=True, text=True, timeout=600, check=False
    )
    if done.returncode != 0:
        return f"{missing}; `make frontend` failed: {done.stderr.strip()[-300:]}"
    return frontend_missing()


def needs_page(frontend: str | None) -> None:
    """Skip a test of the page when its front end could not be built (`frontend`)."""
    if frontend is not None:
        pytest.skip(frontend)


@pytest.fixture(scope="package")
def server(archive: Archive, frontend: str | None) -> Iterator[ViewerServer]:
    with ViewerServer(archive.index, predictions=archive.predictions) as running:
        yield running


class Reply:
    def __init__(self, status: int, headers: dict[str, str], body: bytes) -> None:
        self.status, self.headers, self.body = status, headers, body

    def json(self) -> Any:
        import json

        return json.loads(self.body)


def request(
    port: int, path: str, method: str = "GET", headers: dict[str, str] | None = None
) -> Reply:
    """One request sent as written (no normalisation of the path) to 127.0.0.1:``port``."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    try:
        connection.putrequest(method, path, skip_host=True, skip_accept_encoding=True)
        sent = {"Host": f"127.0.0.1:{port}", **(headers or {})}
        for name, value in sent.items():
            connection.putheader(name, value)
        connection.endheaders()
        response = connection.getresponse()
        body = response.read()
        return Reply(response.status, {k.lower(): v for k, v in response.getheaders()}, body)
    finally:
        connection.close()


@dataclasses.dataclass
class Predicted:
    """Two slides named ``case.svs`` in different folders, an overlapping grid (256 px tiles
    every 128 px), and the folder ``wsi-loader predict`` wrote for them."""

    index: SlideIndex
    out: Path
    stride: int = 128
    tile: int = 256


@pytest.fixture(scope="package")
def predicted(make_slide: SlideFactory, tmp_path_factory: pytest.TempPathFactory) -> Predicted:
    from wsi_loader.cli import main

    root = tmp_path_factory.mktemp("predicted")
    for folder, size, seed in (("a", (3072, 2048), 41), ("b", (2048, 3072), 42)):
        (root / folder).mkdir()
        shutil.copy(
            make_slide(width=size[0], height=size[1], seed=seed), root / folder / "case.svs"
        )
    index = build_index(
        [root / "a", root / "b"], root / "idx", tile_size=256, stride=128, level=0, min_tissue=0.1
    )
    code = main(["predict", str(index.path), "--model", "tests.feature_models:classifier",
                 "--out", str(root / "out"), "--workers", "0", "--heatmap-size", "256",
                 "--no-progress"])  # fmt: skip
    assert code == 0
    return Predicted(index, root / "out")
