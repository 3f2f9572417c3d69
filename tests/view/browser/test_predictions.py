"""Prediction tables (the output of ``wsi-loader predict``) read as untrusted input, and the
heatmaps drawn from them."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from wsi_loader.errors import InputError
from wsi_loader.view.browser._predictions import CSV_FOLDER, Predictions, ramp_colours, read_table

HEADER = "minx,miny,width,height,prob_benign,prob_tumour\n"


def write(path: Path, text: str | bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_text(text)
    return path


def test_a_table_is_read_with_its_classes(tmp_path: Path) -> None:
    table = read_table(
        str(write(tmp_path / "a.csv", HEADER + "0,0,256,256,0.9,0.1\n256,0,256,256,0.2,0.8\n"))
    )
    assert table.classes == ("benign", "tumour")
    assert table.boxes.tolist() == [[0, 0, 256, 256], [256, 0, 256, 256]]
    assert table.at(300, 10) == {"benign": 0.2, "tumour": 0.8}
    assert table.at(600, 10) is None
    # columns in any order, extra columns, a BOM (Excel's "CSV UTF-8")
    other = write(
        tmp_path / "b.csv", "\ufeffslide,prob_x,height,width,miny,minx\ns,0.5,10,10,0,0\n"
    )
    assert read_table(str(other)).classes == ("x",)


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("minx,miny,width,height\n0,0,1,1\n", "missing prob_ columns"),
        ("x,y,prob_a\n0,0,1\n", "missing minx, miny, width, height"),
        (HEADER + "0,0,256,256,0.5\n", ":2: a row whose boxes"),
        (HEADER + "0,0,256,256,0.5,inf\n", ":2: column prob_tumour: inf is not a finite"),
        (HEADER + "0,0,0,256,0.5,0.5\n", ":2: column width: a box that is empty"),
        (HEADER + "0,0,256,256,nan,0.5\n", ":2: column prob_benign: nan is not a finite"),
        (HEADER + "0,0,256,256,7.5,0.5\n", ":2: column prob_benign: 7.5 is not a probability"),
        (HEADER, "no rows"),
        (b"minx,miny\xff\n", "not UTF-8"),
    ],
)
def test_a_bad_table_is_said_with_its_file_and_line(
    tmp_path: Path, text: str | bytes, says: str
) -> None:
    path = write(tmp_path / "bad.csv", text)
    with pytest.raises(InputError, match=says) as caught:
        read_table(str(path))
    assert str(path) in str(caught.value)


def test_only_regular_files_of_the_folder_are_listed(tmp_path: Path) -> None:
    folder = tmp_path / "predict"
    tables = folder / CSV_FOLDER
    write(tables / "case 1.csv", HEADER + "0,0,1,1,0.5,0.5\n")
    secret = write(tmp_path / "secret.csv", HEADER + "0,0,1,1,0.5,0.5\n")
    (tables / "linked.csv").symlink_to(secret)
    (tables / "folder.csv").mkdir()
    os.mkfifo(tables / "pipe.csv")
    found = Predictions(folder)
    assert set(found.files) == {"case 1"}
    assert found.table("/slides/case 1.svs", 0) is not None
    assert found.table("/slides/linked.svs", 1) is None
    assert found.table("/slides/pipe.svs", 2) is None
    with pytest.raises(InputError, match="not the output of wsi-loader predict"):
        Predictions(tmp_path)


def test_a_file_swapped_for_a_symlink_after_listing_is_not_followed(tmp_path: Path) -> None:
    folder = tmp_path / "predict"
    table = write(folder / CSV_FOLDER / "a.csv", HEADER + "0,0,1,1,0.5,0.5\n")
    found = Predictions(folder)
    table.unlink()
    table.symlink_to(write(tmp_path / "elsewhere.csv", HEADER + "0,0,1,1,0.5,0.5\n"))
    with pytest.raises(OSError):
        found.table("/slides/a.svs", 0)


def test_the_heatmap_has_a_pixel_per_box_of_the_lattice(tmp_path: Path) -> None:
    rows = [
        f"{x},{y},224,224,{1 - x / 1000:.3f},{x / 1000:.3f}"
        for x in (0, 224, 672)
        for y in (448, 672)
    ]
    table = read_table(str(write(tmp_path / "a.csv", HEADER + "\n".join(rows) + "\n")))
    picture, bounds = table.heatmap(1)
    assert bounds == (0.0, 448.0, 4 * 224.0, 2 * 224.0)
    assert picture.shape == (2, 4, 4)
    assert picture[..., 3].tolist() == [[255, 255, 0, 255], [255, 255, 0, 255]]  # a gap at x=448
    assert picture[0, 3, :3].tolist() == ramp_colours(np.array([0.672], np.float32))[0].tolist()
    assert ramp_colours(np.array([0.0, 1.0, np.nan], np.float32)).tolist() == [
        [68, 1, 84],
        [253, 231, 37],
        [68, 1, 84],
    ]


@pytest.mark.parametrize(("stride", "overlaps"), [(256, False), (128, True), (170, True)])
def test_no_heatmap_cell_reaches_past_the_boxes(
    tmp_path: Path, stride: int, overlaps: bool
) -> None:
    rows = [f"{x},{y},256,256,0.5,0.5" for x in range(0, 4 * stride, stride) for y in (0, stride)]
    table = read_table(str(write(tmp_path / "a.csv", HEADER + "\n".join(rows) + "\n")))
    picture, (x0, y0, width, height) = table.heatmap(1)
    cell_w, cell_h = width / picture.shape[1], height / picture.shape[0]
    boxes = table.boxes
    for r, c in zip(*np.nonzero(picture[..., 3]), strict=True):
        left, top = x0 + c * cell_w, y0 + r * cell_h
        inside = (
            (boxes[:, 0] <= left)
            & (left + cell_w <= boxes[:, 0] + boxes[:, 2])
            & (boxes[:, 1] <= top)
            & (top + cell_h <= boxes[:, 1] + boxes[:, 3])
        )
        assert inside.any(), (r, c)
    assert table.overlaps is overlaps
