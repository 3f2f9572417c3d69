from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from tests.conftest import corrupt_rows
from wsi_loader.cli import main
from wsi_loader.dataset import TileDataset
from wsi_loader.index import SlideIndex
from wsi_loader.index._lookup import resolve_slide
from wsi_loader.view import STATUS_COLOURS, IndexSummary, Mosaic, SlideOverview


def test_overview_cells_sit_where_the_index_says(index: SlideIndex) -> None:
    view = SlideOverview(index, "good", color_by="tissue", max_size=400)
    sid = view.slide_id
    rows = np.flatnonzero(index.columns["slide_id"] == sid)
    assert len(view.cells) == len(rows)
    w0 = view.l0_size[0]
    for cell, row in zip(view.cells, rows.tolist(), strict=True):
        x0, _, x1, _ = cell.box
        assert (cell.l0_x, cell.l0_y) == (
            int(index.columns["l0_x"][row]),
            int(index.columns["l0_y"][row]),
        )
        assert x0 == pytest.approx(cell.l0_x * view.scale) and x1 - x0 == pytest.approx(
            256 * view.scale
        )
        assert x0 >= 0 and x1 <= w0 * view.scale + 1e-6
    assert 200 <= view.scale * 2560 <= 400  # a pyramid level, box-shrunk to max_size
    png = view._repr_png_()
    assert png.startswith(b"\x89PNG")


def test_status_colouring_shows_quarantined_tiles(index: SlideIndex, tmp_path: Path) -> None:
    bad = corrupt_rows(index)
    TileDataset(index).__getitems__(bad.tolist())
    view = SlideOverview(index, "bad", color_by="status", max_size=512)
    failed = [c for c in view.cells if c.status == "quarantined"]
    assert sorted((c.l0_x, c.l0_y) for c in failed) == sorted(
        (int(index.columns["l0_x"][r]), int(index.columns["l0_y"][r])) for r in bad
    )
    out = tmp_path / "o.png"
    view.save(out)
    with Image.open(out) as png:
        image = np.asarray(png.convert("RGB")).astype(int)
    # the centre of a failed cell is drawn red-ish (crossed and filled)
    cell = failed[0]
    cx = int((cell.box[0] + cell.box[2]) / 2) + view.origin[0]
    cy = int((cell.box[1] + cell.box[3]) / 2) + view.origin[1]
    r, g, b = image[cy, cx]
    assert r > g + 60 and r > b + 60, (r, g, b)
    assert (STATUS_COLOURS["quarantined"], f"quarantined ({len(bad)})") in view._legend_entries()


def test_label_colouring_and_bad_options(index: SlideIndex) -> None:
    assert SlideOverview(index, 0, color_by="label", max_size=200).image.width > 200
    with pytest.raises(ValueError, match="color_by"):
        SlideOverview(index, 0, color_by="heat")
    with pytest.raises(ValueError, match="no slide 'nope'"):
        resolve_slide(index, "nope")
    with pytest.raises(ValueError, match="out of range"):
        resolve_slide(index, 7)


def test_mosaic_filters_and_marks_failures(index: SlideIndex) -> None:
    bad = corrupt_rows(index)
    TileDataset(index).__getitems__(bad.tolist())
    failed = Mosaic(index, 4, status="quarantined", tile_px=64)
    assert sorted(failed.rows.tolist()) == sorted(bad.tolist()) and not failed.ok.any()
    tumour = Mosaic(index, 9, label="tumour", tile_px=64, seed=1)
    tumour_id = index.label_names.index("tumour")
    assert (index.slide_labels()[index.columns["slide_id"][tumour.rows]] == tumour_id).all()
    assert tumour.image.size == (3 * 70 + 6, 3 * (64 + 34 + 6) + 6)
    with pytest.raises(ValueError, match="no label"):
        Mosaic(index, 4, label="zebra")


def test_summary_table(index: SlideIndex) -> None:
    summary = IndexSummary(index)
    assert [r["label"] for r in summary.rows] == [s.label for s in index.slides]
    assert summary.label_counts["tumour"]["slides"] == 1
    html = summary._repr_html_()
    assert "<table>" in html and "tumour" in html
    assert "per label" in str(summary)
    TileDataset(index).__getitems__(corrupt_rows(index).tolist())
    again = IndexSummary(index)
    assert again.quarantined == {"tiles": 4, "slides": 0}
    assert "quarantine: 4 tile and 0 slide records" in str(again)


def test_summary_shows_slide_warnings(testdata: Path, tmp_path: Path) -> None:
    from wsi_loader import build_index

    index = build_index(
        [testdata / "small_la.tiff", testdata / "small.svs"],
        tmp_path / "idx",
        level=0,
        tile_size=64,
        min_tissue=0.0,
    )
    warned = [r for r in IndexSummary(index).rows if r["warning"]]
    assert warned and "smaller than one tile" in warned[0]["warning"]
    assert "smaller than one tile" in str(IndexSummary(index))
    assert "smaller than one tile" in IndexSummary(index)._repr_html_()


def test_overview_of_a_slide_with_an_unreadable_thumbnail_marks_it(
    testdata: Path, tmp_path: Path
) -> None:
    from wsi_loader import build_index
    from wsi_loader.view import UNREADABLE

    index = build_index(
        [testdata / "unreadable.svs"], tmp_path / "idx", level=0, tile_size=8, min_tissue=0.0
    )
    view = SlideOverview(index, 0, color_by="status", max_size=64)
    assert view.unreadable == [(0, 0, 16, 16)]
    assert (UNREADABLE, "unreadable thumbnail") in view._legend_entries()
    pixels = np.asarray(view.image.convert("RGB")).astype(int)
    purple = (np.abs(pixels - np.array(UNREADABLE)).sum(axis=-1) < 60).sum()
    assert purple > 10
    out = tmp_path / "u.png"
    assert main(["inspect", str(index.path), "--out", str(out), "--slide", "0"]) == 0


def test_cli_inspect_and_mosaic(index: SlideIndex, tmp_path: Path) -> None:
    out = tmp_path / "grid.png"
    assert (
        main(
            [
                "inspect",
                str(index.path),
                "--out",
                str(out),
                "--slide",
                "bad",
                "--color-by",
                "status",
            ]
        )
        == 0
    )
    with Image.open(out) as image:
        assert image.size[0] > 100
    assert main(["mosaic", str(index.path), "--out", str(tmp_path / "m.png"), "--n", "4"]) == 0
    assert main(["mosaic", str(index.path), "--out", str(tmp_path / "m.png"), "--label", "x"]) == 2


def test_mosaic_from_a_dataset_uses_its_reader(index: SlideIndex) -> None:
    ds = TileDataset(index, fill_value=0)
    bad = corrupt_rows(index)
    mosaic = Mosaic(ds, 2, slide="bad", status=None, seed=0, tile_px=32)
    assert len(mosaic.rows) == 2
    failed = Mosaic(ds, len(index), tile_px=16)
    assert sorted(failed.rows[~failed.ok].tolist()) == sorted(bad.tolist())
    assert len(ds.failures) >= len(bad)  # read through the dataset's own reader
    with pytest.raises(TypeError):
        Mosaic("not an index", 2)


def test_views_say_what_they_show_in_their_repr(index: SlideIndex) -> None:
    # a console, a log line or a notebook's text/plain output: not '<... at 0x7f...>', which
    # also changed the committed notebooks on every run
    overview = SlideOverview(index, 0, color_by="label", max_size=256)
    name = index.slides[0].path
    width, height = overview.image.size
    assert repr(overview) == (
        f"SlideOverview({name!r}, color_by='label', {width}x{height} px, "
        f"{len(overview.cells)} tiles)"
    )
    bad = corrupt_rows(index)
    TileDataset(index).__getitems__(bad.tolist())
    mosaic = Mosaic(index, 4, status="quarantined", tile_px=32)
    assert repr(mosaic) == f"Mosaic(4 tiles, 4 failed, {mosaic.columns} columns)"
    summary = IndexSummary(index)
    ok = sum(s.status == "ok" for s in index.slides)
    assert repr(summary) == (
        f"IndexSummary({len(index.slides)} slides, {ok} ok, {len(index.slides) - ok} failed, "
        f"{len(index)} tiles)"
    )


@pytest.mark.parametrize("tile_px", [48, 96, 160])
def test_mosaic_captions_stay_under_their_tile(index: SlideIndex, tile_px: int) -> None:
    # a caption wider than its tile ran into the next one ('(2560,512) 0.5um/px' at 96 px)
    mosaic = Mosaic(index, 4, tile_px=tile_px, columns=2)
    pixels = np.asarray(mosaic.image)
    pad, caption = 6, 34
    gap = pixels[:, pad + tile_px : 2 * pad + tile_px]  # between the two columns
    assert (gap == 255).all()
    band = pixels[pad + tile_px : pad + tile_px + caption, pad : pad + tile_px]
    assert (band < 128).any()  # a caption is there


def test_status_colouring_reads_only_tile_records_of_the_slide_s_level(index: SlideIndex) -> None:
    """A slide record (the slide went missing once) has no position: the overview failed
    with KeyError 'x'. A tile record of another level is another tile."""
    sid = resolve_slide(index, "good")
    record = index.slides[sid]
    x, y = (
        int(index.columns["l0_x"][record.first_row]),
        int(index.columns["l0_y"][record.first_row]),
    )
    index.quarantine.append_slide({"path": record.path, "fingerprint": record.fingerprint})
    index.quarantine.append({"path": record.path, "x": x, "y": y, "level": 1, "error": "e"})
    view = SlideOverview(index, sid, color_by="status", max_size=256)
    assert not [c for c in view.cells if c.status == "quarantined"]
    index.quarantine.append({"path": record.path, "x": x, "y": y, "level": 0, "error": "e"})
    view = SlideOverview(index, sid, color_by="status", max_size=256)
    assert [(c.l0_x, c.l0_y) for c in view.cells if c.status == "quarantined"] == [(x, y)]
