"""Predict's per-tile CSV has one reader (`TilePredictions.read_csv`), used by predict's own
summary, ``inspect --predictions``, notebooks and the viewer: the same table reads the same
everywhere, and a table that is not one is refused everywhere with its file and line."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from wsi_loader.errors import InputError
from wsi_loader.predict._outputs import TilePredictions, read_run, slide_stems
from wsi_loader.view.browser._predictions import read_table

HEADER = "minx,miny,width,height,prob_benign,prob_tumour\n"


def write(path: Path, text: str | bytes) -> str:
    if isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_text(text, encoding="utf-8")
    return str(path)


def test_ours_and_wsinfers_layouts_read_the_same_in_predict_and_the_viewer(tmp_path: Path) -> None:
    ours = write(tmp_path / "a.csv", HEADER + "0,0,256,256,0.9,0.1\n256,0,256,256,0.2,0.8\n")
    # WSInfer's column order, a BOM (Excel's "CSV UTF-8"), an extra column, a blank line
    theirs = write(
        tmp_path / "b.csv",
        "\ufeffslide,prob_benign,prob_tumour,minx,miny,width,height\n"
        "s,0.9,0.1,0,0,256,256\n\ns,0.2,0.8,256,0,256,256\n",
    )
    for path in (ours, theirs):
        tiles = TilePredictions.read_csv(path)
        assert tiles.classes == ("benign", "tumour")
        assert tiles.boxes.tolist() == [[0, 0, 256, 256], [256, 0, 256, 256]]
        assert np.allclose(tiles.probabilities, [[0.9, 0.1], [0.2, 0.8]])
        table = read_table(path)
        assert table.classes == tiles.classes
        assert np.array_equal(table.boxes, tiles.boxes) and np.array_equal(
            table.probs, tiles.probabilities
        )


@pytest.mark.parametrize(
    ("text", "says"),
    [
        # inspect and notebooks read a NaN probability as a number and drew it; the viewer
        # refused the same file
        (HEADER + "0,0,256,256,nan,0.5\n", ":2: column prob_benign: nan is not a finite"),
        (HEADER + "0,0,256,256,0.5,inf\n", ":2: column prob_tumour: inf is not a finite"),
        (HEADER + "0,0,256,-inf,0.5,0.5\n", ":2: column height: -inf is not a finite"),
        # probabilities outside [0, 1] were drawn (clipped) as if they were ones
        (HEADER + "0,0,256,256,0.5,0.5\n0,0,256,256,7.5,0.5\n", ":3: column prob_benign: 7.5 is"),
        (HEADER + "0,0,256,256,0.5,-3\n", ":2: column prob_tumour: -3 is not a probability"),
        (HEADER + "0,0,0,256,0.5,0.5\n", ":2: column width: a box that is empty"),
        (HEADER + "0,0,256,256,0.5\n", ":2: a row whose boxes"),
        ("minx,miny,width,height\n0,0,1,1\n", "missing prob_ columns"),
        ("x,y,prob_a\n0,0,1\n", "missing minx, miny, width, height"),
        (b"minx,miny\xff\n", "not UTF-8"),
    ],
)
def test_a_bad_table_is_refused_by_every_reader(
    tmp_path: Path, text: str | bytes, says: str
) -> None:
    path = write(tmp_path / "bad table.csv", text)
    for read in (TilePredictions.read_csv, read_table):
        with pytest.raises(InputError, match=says) as caught:
            read(path)
        assert path in str(caught.value)


def test_a_header_alone_is_no_tiles_to_predict_and_nothing_to_draw(tmp_path: Path) -> None:
    path = write(tmp_path / "empty.csv", HEADER)
    tiles = TilePredictions.read_csv(path)
    assert tiles.boxes.shape == (0, 4) and tiles.probabilities.shape == (0, 2)
    with pytest.raises(InputError, match="no rows"):
        read_table(path)


def test_a_fifo_is_refused_not_waited_on(tmp_path: Path) -> None:
    fifo = tmp_path / "pipe.csv"
    os.mkfifo(fifo)
    with pytest.raises(InputError, match="not a regular file"):
        TilePredictions.read_csv(fifo)


def test_predict_json_names_are_file_names(tmp_path: Path) -> None:
    write(
        tmp_path / "predict.json", '{"slides": {"a.svs": {"name": "a"}, "b.svs": {"name": "../b"}}}'
    )
    with pytest.raises(InputError, match=r"slide 'b\.svs': not a file name: '\.\./b'"):
        slide_stems(read_run(tmp_path), tmp_path)
    write(tmp_path / "predict.json", '{"slides": {"a.svs": {"name": "a"}}}')
    assert slide_stems(read_run(tmp_path), tmp_path) == {"a.svs": "a"}
    with pytest.raises(InputError, match="not a predictions folder"):
        read_run(tmp_path / "elsewhere")


def test_a_value_that_is_not_finite_spoils_no_other_pixel_of_a_heatmap() -> None:
    """The heatmap's cell means are cumulative sums: one NaN (a table our reader refuses, but
    values handed to `SlideHeatmap` directly) used to blank every pixel right of and below
    its tile."""
    from wsi_loader.predict._heatmaps import tile_means

    boxes = np.array([[x, y, 10, 10] for y in range(0, 40, 10) for x in range(0, 40, 10)])
    values = np.linspace(0, 1, 2 * len(boxes)).reshape(-1, 2)
    clean = tile_means(boxes, values, (40, 40), 1.0)
    spoilt = values.copy()
    spoilt[5, 0] = np.nan  # the tile at (10, 10), class 0
    means = tile_means(boxes, spoilt, (40, 40), 1.0)
    assert np.isnan(means[10:20, 10:20, 0]).all()  # its own cell: nothing left to average
    outside = np.ones((40, 40), bool)
    outside[10:20, 10:20] = False
    np.testing.assert_array_equal(means[..., 0][outside], clean[..., 0][outside])
    np.testing.assert_array_equal(means[..., 1], clean[..., 1])  # the other class, whole
