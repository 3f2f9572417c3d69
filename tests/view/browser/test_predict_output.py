"""The viewer over what ``wsi-loader predict`` really writes (not a hand-made table): two slides
of one name in different folders (``case.csv`` and ``case-s<id>.csv``, told apart by
``predict.json``), and an overlapping grid, whose heatmap is the mean of the tiles covering
each cell and whose clicked tile's probabilities are that tile's row."""

from __future__ import annotations

import io
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from tests.view.browser.conftest import Predicted, request
from wsi_loader.errors import InputError
from wsi_loader.predict._outputs import TilePredictions
from wsi_loader.view.browser import ViewerServer
from wsi_loader.view.browser._predictions import ramp_colours


def table_of(predicted: Predicted, slide_id: int) -> TilePredictions:
    """The slide's CSV, found through predict.json as predict named it."""
    run = json.loads((predicted.out / "predict.json").read_text())
    name = run["slides"][predicted.index.slides[slide_id].path]["name"]
    return TilePredictions.read_csv(predicted.out / "model-outputs-csv" / f"{name}.csv")


def probabilities_at(table: TilePredictions, x: int, y: int) -> dict[str, float]:
    hit = np.flatnonzero((table.boxes[:, 0] == x) & (table.boxes[:, 1] == y))
    assert len(hit) == 1
    return {
        c: round(float(p), 4)
        for c, p in zip(table.classes, table.probabilities[hit[0]], strict=True)
    }


def test_two_slides_of_one_name_each_show_their_own_predictions(predicted: Predicted) -> None:
    a, b = table_of(predicted, 0), table_of(predicted, 1)
    assert sorted(p.name for p in (predicted.out / "model-outputs-csv").iterdir()) == [
        "case-s1.csv",
        "case.csv",
    ]
    with ViewerServer(predicted.index, predictions=predicted.out) as server:
        for sid in (0, 1):
            details = request(server.port, f"/api/slides/{sid}").json()
            assert details["predictions"] == {"classes": ["normal", "tumour"]}
            assert details["predictions_error"] is None
        # a tile both slides have (the same box): each slide shows its own row
        shared = sorted(
            {tuple(v) for v in a.boxes[:, :2].tolist()}
            & {tuple(v) for v in b.boxes[:, :2].tolist()}
        )
        assert shared
        x, y = shared[len(shared) // 2]
        assert probabilities_at(a, x, y) != probabilities_at(b, x, y)  # different pixels
        for sid, table in ((0, a), (1, b)):
            found = request(server.port, f"/api/slides/{sid}/at?x={x + 128}&y={y + 128}").json()
            assert (found["tile"]["x"], found["tile"]["y"]) == (x, y)
            assert found["predictions"] == probabilities_at(table, x, y)


def test_the_clicked_tiles_probabilities_are_that_tiles_row(predicted: Predicted) -> None:
    table = table_of(predicted, 1)
    with ViewerServer(predicted.index, predictions=predicted.out) as server:
        checked = 0
        for x, y, _, _ in table.boxes[:: max(1, len(table.boxes) // 25)].tolist():
            # off the tile's centre, where up to four tiles of the grid cover the point
            for dx, dy in ((100, 90), (170, 60), (40, 200)):
                found = request(server.port, f"/api/slides/1/at?x={x + dx}&y={y + dy}").json()
                tile = found["tile"]
                assert tile is not None
                assert found["predictions"] == probabilities_at(table, tile["x"], tile["y"])
                checked += 1
        assert checked >= 60


def test_a_heatmap_cell_is_the_mean_of_the_tiles_covering_it(predicted: Predicted) -> None:
    table = table_of(predicted, 1)
    boxes, tumour = table.boxes, table.probabilities[:, 1]
    with ViewerServer(predicted.index, predictions=predicted.out) as server:
        reply = request(server.port, "/api/slides/1/predictions/1.png")
    assert reply.status == 200
    x0, y0, width, height = (float(v) for v in reply.headers["x-bounds"].split(","))
    picture = np.asarray(Image.open(io.BytesIO(reply.body)).convert("RGBA"))
    rows, cols = picture.shape[:2]
    assert (width / cols, height / rows) == (predicted.stride, predicted.stride)
    means = []
    for r in range(rows):
        for c in range(cols):
            px, py = x0 + (c + 0.5) * width / cols, y0 + (r + 0.5) * height / rows
            covering = (boxes[:, 0] <= px) & (px < boxes[:, 0] + boxes[:, 2])
            covering &= (boxes[:, 1] <= py) & (py < boxes[:, 1] + boxes[:, 3])
            if not covering.any():
                assert picture[r, c, 3] == 0
                continue
            mean = tumour[covering].astype(np.float64).mean()
            means.append(mean)
            assert picture[r, c, 3] == 255
            expected = ramp_colours(np.array([mean], dtype=np.float32))[0]
            assert np.abs(picture[r, c, :3].astype(int) - expected).max() <= 1, (r, c)
    assert len(means) > 100 and np.ptp(means) > 0.01  # cells that differ, all checked


def test_boxes_that_are_not_a_grid_are_said_not_drawn(predicted: Predicted, tmp_path: Path) -> None:
    # corners 1 px apart and 10^9 px apart: a lattice of 10^9 cells, refused before allocating
    tables = tmp_path / "model-outputs-csv"
    tables.mkdir()
    (tables / "case.csv").write_text(
        "minx,miny,width,height,prob_x\n0,0,256,256,0.5\n1,0,256,256,0.5\n"
        "1000000000,0,256,256,0.5\n"
    )
    with ViewerServer(predicted.index, predictions=tmp_path) as server:
        reply = request(server.port, "/api/slides/0/predictions/0.png")
    assert reply.status == 409
    assert b"lattice cells: not a tile grid" in reply.body and b"case.csv" in reply.body


def test_a_predict_json_that_is_not_one_is_said(predicted: Predicted, tmp_path: Path) -> None:
    shutil.copytree(predicted.out / "model-outputs-csv", tmp_path / "model-outputs-csv")
    (tmp_path / "predict.json").write_text('{"slides": {"x.svs": {"name": 3}}}')
    with pytest.raises(InputError, match=r"slide 'x\.svs' has no file name"):
        ViewerServer(predicted.index, predictions=tmp_path)


def test_predictions_of_another_index_are_said_at_start_and_in_the_banner(
    predicted: Predicted, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    other = tmp_path / "other"
    shutil.copytree(predicted.out, other)
    run = json.loads((other / "predict.json").read_text())
    run["slides"] = {f"/elsewhere/{i}.svs": entry for i, entry in enumerate(run["slides"].values())}
    (other / "predict.json").write_text(json.dumps(run))
    for csv_file in (other / "model-outputs-csv").iterdir():
        csv_file.rename(csv_file.with_name(f"other-{csv_file.name}"))
    with ViewerServer(predicted.index, predictions=other) as server:
        said = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
        assert said == [f"none of this index's slides has predictions in {other} (another index?)"]
        details = request(server.port, "/api/slides/0").json()
        assert details["predictions"] is None
        # the page is not told the server's paths
        assert details["predictions_error"] == said[0].replace(
            f" in {other} ", " in the folder given "
        )
    caplog.clear()
    with ViewerServer(predicted.index, predictions=predicted.out) as server:  # its own: quiet
        assert not [r for r in caplog.records if r.levelname == "WARNING"]
