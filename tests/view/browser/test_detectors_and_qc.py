"""The viewer's tissue and QC overlays over what the index recorded: the tissue overlay of each
slide is the mask of the detector its build chose (fluorescence on a dark-field slide, the
user's mask image, an annotation class, brightfield otherwise), and the QC overlay carries the
builder's QC columns and the rule that flags each tile, at the index's thresholds."""

from __future__ import annotations

import io
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from tests.conftest import SlideFactory
from tests.index.annotation_files import Region, rect, write_geojson
from tests.view.browser.conftest import request
from wsi_loader.index import SlideIndex, build_index
from wsi_loader.index import _qc as qc
from wsi_loader.index._tissue import read_mask_image, tissue_mask
from wsi_loader.slides import open_slide
from wsi_loader.synthetic import SlideSpec, tissue_of, with_qc_artefacts
from wsi_loader.view.browser import ViewerServer

pytestmark = pytest.mark.filterwarnings("ignore::ResourceWarning")

DARK = {"width": 6000, "height": 4500, "seed": 21, "dark_field": True}
PAINTED = with_qc_artefacts(SlideSpec(width=10_000, height=7_500, seed=4), scale=0.8)
PLAIN = {"width": 4096, "height": 3072}
TISSUE_BOX = (0, 0, 1024, 1024)  # the annotated slide's "Tissue" region (level-0)
PEN = 0.05  # the index's pen threshold (the default is 0.1)


@pytest.fixture(scope="module")
def index(make_slide: SlideFactory, tmp_path_factory: pytest.TempPathFactory) -> SlideIndex:
    root = tmp_path_factory.mktemp("detectors")
    slides, masks, notes = root / "slides", root / "masks", root / "notes"
    for folder in (slides, masks, notes):
        folder.mkdir()
    shutil.copy(make_slide(**DARK), slides / "dark.svs")
    painted = make_slide(width=10_000, height=7_500, seed=4, artefacts=PAINTED.artefacts)
    shutil.copy(painted, slides / "painted.svs")
    shutil.copy(make_slide(**PLAIN, seed=1), slides / "masked.svs")
    shutil.copy(make_slide(**PLAIN, seed=2), slides / "annotated.svs")
    left_half = np.zeros((300, 400), dtype=np.uint8)
    left_half[:, :200] = 255
    Image.fromarray(left_half).save(masks / "masked.png")
    write_geojson(notes / "annotated.geojson", [Region("Tissue", rect(*TISSUE_BOX))])
    return build_index(
        [slides],
        root / "idx",
        tile_size=256,
        mpp=0.5,
        tissue_masks=str(masks),
        annotations=str(notes),
        tissue_class="Tissue",
        qc_thresholds={"pen": PEN},
    )


@pytest.fixture(scope="module")
def server(index: SlideIndex) -> Iterator[ViewerServer]:
    with ViewerServer(index) as running:
        yield running


def slide_id(index: SlideIndex, name: str) -> int:
    return [os.path.basename(s.path) for s in index.slides].index(name)


def overlay(server: ViewerServer, sid: int) -> np.ndarray:
    """Where the tissue overlay is coloured."""
    reply = request(server.port, f"/api/slides/{sid}/tissue.png")
    assert reply.status == 200, reply.body
    return np.asarray(Image.open(io.BytesIO(reply.body)))[..., 3] > 0


def truth(spec: SlideSpec, shape: tuple[int, ...]) -> np.ndarray:
    """The synthetic slide's true tissue at an overlay's pixels."""
    h, w = shape
    step = spec.width / w
    return np.asarray(tissue_of(spec)(0, 0, step, w, h), dtype=bool)


def test_every_slide_records_the_detector_the_overlay_follows(index: SlideIndex) -> None:
    found = {os.path.basename(s.path): s.tissue_detector for s in index.slides}
    assert found == {
        "dark.svs": "fluorescence",
        "painted.svs": "brightfield",
        "masked.svs": "mask",
        "annotated.svs": "annotation",
    }


def test_a_fluorescence_slides_overlay_is_its_glowing_tissue(
    server: ViewerServer, index: SlideIndex
) -> None:
    sid = slide_id(index, "dark.svs")
    shown = overlay(server, sid)
    true = truth(SlideSpec(**DARK), shown.shape)  # type: ignore[arg-type]
    assert (shown == true).mean() > 0.95
    assert shown[~true].mean() < 0.05  # black glass is not coloured
    assert shown[true].mean() > 0.9
    with open_slide(index.slide_path(sid)) as reader:  # the colour rule, which it replaced,
        image, _ = read_mask_image(reader, int(index.params.get("mask_max_size", 2048)))
    colour_rule = tissue_mask(image)  # the overlay before: it colours black glass
    assert colour_rule.shape == shown.shape and colour_rule[~true].mean() > 0.1


def test_a_brightfield_slides_overlay_is_its_stained_tissue(
    server: ViewerServer, index: SlideIndex
) -> None:
    shown = overlay(server, slide_id(index, "painted.svs"))
    assert (shown == truth(PAINTED, shown.shape)).mean() > 0.9


def test_a_user_masks_overlay_is_the_mask_image(server: ViewerServer, index: SlideIndex) -> None:
    shown = overlay(server, slide_id(index, "masked.svs"))
    assert shown.shape == (300, 400)  # the mask's own size, under mask_max_size
    assert shown[:, :200].all() and not shown[:, 200:].any()


def test_an_annotation_class_overlay_is_its_region(server: ViewerServer, index: SlideIndex) -> None:
    sid = slide_id(index, "annotated.svs")
    shown = overlay(server, sid)
    w = shown.shape[1]
    x0, y0, x1, y1 = (round(v * w / PLAIN["width"]) for v in TISSUE_BOX)
    inside = np.zeros_like(shown)
    inside[y0:y1, x0:x1] = True
    assert (shown == inside).mean() > 0.99  # the box, to a pixel along its edges
    assert shown[y0 + 1 : y1 - 1, x0 + 1 : x1 - 1].all()


def test_a_mask_image_gone_since_indexing_is_said(make_slide: SlideFactory, tmp_path: Path) -> None:
    slide = make_slide(**PLAIN, seed=1)
    mask = tmp_path / "mask.png"
    Image.fromarray(np.full((300, 400), 255, dtype=np.uint8)).save(mask)
    built = build_index([slide], tmp_path / "idx", tile_size=256, tissue_masks=str(mask))
    mask.unlink()
    with ViewerServer(built) as running:
        reply = request(running.port, "/api/slides/0/tissue.png")
    assert reply.status == 409
    said = reply.body.decode()
    assert "cannot read the tissue mask" in said and "mask.png" in said


def test_the_qc_overlay_has_the_builders_columns_and_flags(
    server: ViewerServer, index: SlideIndex
) -> None:
    sid = slide_id(index, "painted.svs")
    details = request(server.port, f"/api/slides/{sid}").json()
    assert details["qc"] == sorted(qc.QC_COLUMNS)
    rules = {r["name"]: r for r in details["qc_rules"]}
    assert [r["name"] for r in details["qc_rules"]] == ["pen", "fold", "bubble", "blur"]
    assert rules["pen"]["threshold"] == PEN and rules["pen"]["column"] == "qc_pen"
    assert rules["blur"]["below"] and rules["blur"]["threshold"] == qc.RULES["blur"].threshold
    grid = request(server.port, f"/api/slides/{sid}/grid.bin").body
    columns = {
        c["name"]: np.frombuffer(
            grid,
            dtype={"Int32": "<i4", "Float32": "<f4", "Int16": "<i2", "Uint8": "u1"}[c["type"]],
            count=details["grid"]["count"],
            offset=c["offset"],
        )
        for c in details["grid"]["columns"]
    }
    starts = index.slide_starts()
    rows = np.arange(starts[sid], starts[sid + 1])
    for name in qc.QC_COLUMNS:
        assert np.allclose(columns[name], index.columns[name][rows], equal_nan=True)
    flagged = qc.flags(index.columns, None, {"pen": PEN})
    first = columns["qc"]
    for position, name in enumerate(["pen", "fold", "bubble", "blur"], start=1):
        assert (first == position).any(), name  # the painted slide has each artefact
        assert flagged[name][rows][first == position].all()
    assert np.array_equal(first == 0, ~np.any([f[rows] for f in flagged.values()], axis=0))
    # between the index's pen threshold and the default: flagged here, not by default
    between = (index.columns["qc_pen"][rows] >= PEN) & (index.columns["qc_pen"][rows] < 0.1)
    assert (first[between] == 1).all()
    # a fluorescence slide measures no ink: its pen column is NaN and flags nothing
    dark = slide_id(index, "dark.svs")
    tile = request(server.port, f"/api/slides/{dark}").json()
    dark_grid = request(server.port, f"/api/slides/{dark}/grid.bin").body
    layout = {c["name"]: c for c in tile["grid"]["columns"]}
    pen = np.frombuffer(
        dark_grid, dtype="<f4", count=tile["grid"]["count"], offset=layout["qc_pen"]["offset"]
    )
    assert np.isnan(pen).all()


def test_clicking_a_tile_gives_its_qc_values(server: ViewerServer, index: SlideIndex) -> None:
    sid = slide_id(index, "painted.svs")
    starts = index.slide_starts()
    rows = np.arange(starts[sid], starts[sid + 1])
    row = int(rows[np.nanargmax(index.columns["qc_pen"][rows])])
    x, y = int(index.columns["l0_x"][row]) + 128, int(index.columns["l0_y"][row]) + 128
    tile = request(server.port, f"/api/slides/{sid}/at?x={x}&y={y}").json()["tile"]
    assert tile["row"] == row
    for name in qc.QC_COLUMNS:
        value = float(index.columns[name][row])
        assert tile[name] == (None if np.isnan(value) else pytest.approx(value, abs=1e-4))
