"""Per-tile class coverage is exact: shapes with known areas against a 256 px grid."""

from __future__ import annotations

import numpy as np
import pytest
import shapely

from wsi_loader.index.annotations import TileBoxes, assign_labels
from wsi_loader.index.annotations.regions import read_regions

from .annotation_files import Region, rect, write_aperio, write_asap, write_geojson

GRID_X, GRID_Y = np.meshgrid(np.arange(0, 1024, 256), np.arange(0, 768, 256))
TILES = TileBoxes(GRID_X.ravel(), GRID_Y.ravel(), 256)


def at(coverage: np.ndarray, x: int, y: int) -> float:
    """The coverage of the tile whose top-left is (x, y)."""
    i = np.flatnonzero((GRID_X.ravel() == x) & (GRID_Y.ravel() == y))[0]
    return float(coverage[i])


def test_a_rectangle_straddling_tile_borders() -> None:
    cover = TILES.coverage(shapely.box(128, 64, 640, 192))
    assert at(cover, 0, 0) == 0.25 and at(cover, 256, 0) == 0.5 and at(cover, 512, 0) == 0.25
    assert cover.sum() == pytest.approx(512 * 128 / 256**2)


def test_a_triangle() -> None:
    cover = TILES.coverage(shapely.Polygon([(0, 0), (512, 0), (0, 512)]))
    assert at(cover, 0, 0) == 1.0  # the hypotenuse only touches its corner
    assert at(cover, 256, 0) == 0.5 and at(cover, 0, 256) == 0.5
    assert at(cover, 256, 256) == 0.0  # touches at one point: no area


def test_a_polygon_with_a_hole() -> None:
    square = shapely.Polygon(rect(0, 0, 512, 512), [rect(128, 128, 384, 384)])
    cover = TILES.coverage(square)
    for x, y in [(0, 0), (256, 0), (0, 256), (256, 256)]:
        assert at(cover, x, y) == 0.75
    assert at(cover, 512, 0) == 0.0


def test_an_aperio_negative_region_is_a_hole(tmp_path) -> None:
    path = write_aperio(
        tmp_path / "s.xml", [Region("Tumor", rect(0, 0, 512, 512), [rect(128, 128, 384, 384)])]
    )
    regions = read_regions([str(path)], 1024, 768)
    assert at(TILES.coverage(regions.classes["Tumor"]), 0, 0) == 0.75


def test_overlapping_shapes_of_one_class_count_once(tmp_path) -> None:
    path = write_geojson(
        tmp_path / "s.geojson",
        [Region("Tumor", rect(0, 0, 256, 128)), Region("Tumor", rect(0, 64, 256, 192))],
    )
    regions = read_regions([str(path)], 1024, 768)
    assert at(TILES.coverage(regions.classes["Tumor"]), 0, 0) == 0.75


def test_exact_at_any_offset_and_vertex_count() -> None:
    """A 1,000-vertex circle: the tiles' shares add up to its area (an exact computation,
    not a raster), on a grid that does not start at 0."""
    circle = shapely.Point(700.3, 400.7).buffer(300, quad_segs=250)
    x, y = np.meshgrid(np.arange(-37, 1200, 100), np.arange(-11, 900, 100))
    boxes = TileBoxes(x.ravel(), y.ravel(), 100)
    assert boxes.coverage(circle).sum() * 100**2 == pytest.approx(circle.area, rel=1e-6)


def test_labels_of_overlapping_classes_go_to_the_most_specific_region() -> None:
    names = ["Tissue", "Tumor"]
    coverage = np.array([[1.0, 1.0], [1.0, 0.5], [1.0, 0.2], [0.3, 0.0]], dtype=np.float32)
    areas = {"Tissue": 10_000.0, "Tumor": 500.0}
    labels = assign_labels(coverage, names, areas, 0.5, [])
    assert labels.tolist() == [1, 1, 0, -1]
    assert assign_labels(coverage, names, areas, 0.6, []).tolist() == [1, 0, 0, -1]
    # an explicit priority beats the area rule; excluded classes label nothing
    assert assign_labels(coverage, names, areas, 0.5, ["Tissue"]).tolist() == [0, 0, 0, -1]
    never = frozenset({"Tumor"})
    assert assign_labels(coverage, names, areas, 0.5, [], never).tolist() == [0, 0, 0, -1]


def test_the_three_formats_describing_the_same_shapes_give_the_same_coverage(tmp_path) -> None:
    shapes = [
        Region("Tumor", rect(0, 0, 512, 512), [rect(128, 128, 384, 384)]),
        Region("Stroma", [(600, 0), (1000, 0), (600, 700)]),
    ]
    files = {
        "geojson": write_geojson(tmp_path / "a.geojson", shapes),
        "qupath-0.2": write_geojson(tmp_path / "b.geojson", shapes, old_style=True),
        "asap": write_asap(tmp_path / "c.xml", shapes),
        "aperio": write_aperio(tmp_path / "d.xml", shapes),
    }
    results = {}
    for kind, path in files.items():
        regions = read_regions([str(path)], 1024, 768)
        assert sorted(regions.classes) == ["Stroma", "Tumor"], kind
        results[kind] = np.stack([TILES.coverage(g) for g in regions.classes.values()], axis=1)
    for kind, cover in results.items():
        np.testing.assert_array_equal(cover, results["geojson"], err_msg=kind)
    assert at(results["asap"][:, 1], 0, 0) == 0.75


def test_camelyon16_groups(tmp_path) -> None:
    """_0 and _1 are Tumor, _2 is cut out of them (Camelyon16's convention)."""
    path = write_asap(
        tmp_path / "tumor_001.xml",
        [
            Region("T0", rect(0, 0, 256, 256), [rect(0, 0, 128, 256)]),
            Region("T1", rect(256, 0, 512, 256)),
        ],
        group_names={"T0": "_0", "T1": "_1"},
    )
    regions = read_regions([str(path)], 1024, 768)
    assert list(regions.classes) == ["Tumor"]
    cover = TILES.coverage(regions.classes["Tumor"])
    assert at(cover, 0, 0) == 0.5 and at(cover, 256, 0) == 1.0
