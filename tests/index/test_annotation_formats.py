"""Annotation files are untrusted input: every format parsed, every bad file a clear error
naming the file and the element, repairs and clipping reported."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import shapely

from wsi_loader.errors import AnnotationError, InputError
from wsi_loader.index.annotations import UNCLASSIFIED, read_annotations, read_regions
from wsi_loader.index.annotations._formats import MAX_CLASS_NAME, MAX_CLASSES

from .annotation_files import Region, rect, write_aperio, write_asap, write_geojson, write_halo


def feature(geometry: object, classification: object = None) -> dict[str, object]:
    properties = {} if classification is None else {"classification": classification}
    return {"type": "Feature", "geometry": geometry, "properties": properties}


def polygon(*rings: list[tuple[float, float]]) -> dict[str, object]:
    return {"type": "Polygon", "coordinates": [[list(p) for p in [*r, r[0]]] for r in rings]}


def write(path: Path, document: object) -> str:
    path.write_text(json.dumps(document))
    return str(path)


def test_qupath_variants_multipolygons_collections_and_unclassified(tmp_path: Path) -> None:
    doc = {
        "type": "FeatureCollection",
        "features": [
            feature(polygon(rect(0, 0, 10, 10)), {"name": "Tumor", "colorRGB": -1}),
            feature(
                {
                    "type": "MultiPolygon",
                    "coordinates": [polygon(rect(20, 0, 30, 10))["coordinates"]] * 2,
                },
                "Stroma",  # QuPath 0.1/0.2 scripts wrote the class as a plain string
            ),
            feature(
                {"type": "GeometryCollection", "geometries": [polygon(rect(40, 0, 50, 10))]},
                {"name": "Tumor"},
            ),
            feature(polygon(rect(60, 0, 70, 10))),  # no class
            feature({"type": "Point", "coordinates": [1, 2]}, {"name": "Tumor"}),
            feature({"type": "LineString", "coordinates": [[1, 2], [3, 4]]}),
            {"type": "Feature", "geometry": None, "properties": {}},
        ],
    }
    parsed = read_annotations(write(tmp_path / "a.geojson", doc))
    names = sorted(s.name for s in parsed.shapes)
    assert names == ["Stroma", "Stroma", "Tumor", "Tumor", UNCLASSIFIED]
    skipped = " ".join(parsed.notes)
    assert "1 Point features" in skipped and "1 LineString features" in skipped
    assert "1 features without geometry" in skipped
    # a bare Feature and a bare list parse too
    assert len(read_annotations(write(tmp_path / "b.json", doc["features"][0])).shapes) == 1
    assert len(read_annotations(write(tmp_path / "c.json", doc["features"][:2])).shapes) == 3


@pytest.mark.parametrize(
    ("document", "element", "message"),
    [
        ("{not json", None, "malformed JSON"),
        ({"type": "Topology"}, None, "not GeoJSON annotations"),
        (
            [feature(polygon(rect(0, 0, 5, 5))), {"type": "Nope"}],
            "feature 1",
            "not a GeoJSON Feature",
        ),
        (
            [feature({"type": "Polygon", "coordinates": [[["a", 1], [2, 3], [4, 5]]]})],
            "feature 0",
            "not numbers",
        ),
        (  # a number out of range (json.dumps would write 1e400 as Infinity)
            '[{"type": "Feature", "geometry": {"type": "Polygon", '
            '"coordinates": [[[0, 0], [1e400, 1], [4, 5]]]}}]',
            None,
            "malformed JSON",
        ),
        (  # written by json.dumps: a bare Infinity is read as null, which is not a number
            [feature({"type": "Polygon", "coordinates": [[[0, 0], [math.inf, 1], [4, 5]]]})],
            "feature 0",
            "not numbers",
        ),
        ([feature(polygon(rect(0, 0, 5, 5)), {"name": 7})], "feature 0", "is not a name"),
        (  # ragged points
            [feature({"type": "Polygon", "coordinates": [[[0, 0], [1], [4, 5, 6, 7], [0, 0]]]})],
            "feature 0",
            "not numbers",
        ),
        (  # one level too deep
            [feature({"type": "Polygon", "coordinates": [[[[0, 0], [1, 0], [1, 1], [0, 0]]]]})],
            "feature 0",
            "not a list of [x, y] points",
        ),
        ([feature({"type": "Polygon", "coordinates": [{"x": 1}]})], "feature 0", "not a list"),
        # numpy would read these as numbers (True as 1, "10" as 10): they are not coordinates
        *(
            (
                [feature({"type": "Polygon", "coordinates": [[[0, 0], [9, 0], bad, [0, 0]]]})],
                "feature 0",
                "not numbers",
            )
            for bad in ([True, 9], ["10", 9], [None, 9], [9, False, 1])
        ),
        (
            [feature({"type": "Polygon", "coordinates": [[[True, 0], [9, 0], [9, 9], [True, 0]]]})],
            "feature 0",
            "not numbers",
        ),
    ],
)
def test_malformed_geojson_names_the_file_and_feature(
    tmp_path: Path, document: object, element: str | None, message: str
) -> None:
    path = tmp_path / "bad slide.geojson"
    path.write_text(document if isinstance(document, str) else json.dumps(document))
    with pytest.raises(AnnotationError) as caught:
        read_annotations(str(path))
    assert caught.value.path == str(path) and caught.value.element == element
    assert message in str(caught.value) and str(path) in str(caught.value)
    assert isinstance(caught.value, InputError)


def test_qupath_derived_classes_keep_their_whole_name(tmp_path: Path) -> None:
    # QuPath names a derived class "Tumor: Positive". Since 0.4 it writes it as a "names" list
    # (GsonTools.PathClassTypeAdapter); before, Gson's default wrote the parent as "parentClass"
    # and only the last part as "name". Both read as Unclassified or "Positive" before.
    doc = [
        feature(polygon(rect(0, 0, 10, 10)), {"names": ["Tumor", "Positive"], "color": [1, 2, 3]}),
        feature(
            polygon(rect(20, 0, 30, 10)),
            {"parentClass": {"name": "Stroma", "colorRGB": -1}, "name": "Positive", "colorRGB": -2},
        ),
        feature(
            polygon(rect(40, 0, 50, 10)),
            {"names": ["Tumor", "Positive", "CD8"], "color": [1, 2, 3]},
        ),
        feature(polygon(rect(60, 0, 70, 10)), {"names": ["Tumor"], "color": [1, 2, 3]}),
    ]
    names = [s.name for s in read_annotations(write(tmp_path / "d.geojson", doc)).shapes]
    assert names == ["Tumor: Positive", "Stroma: Positive", "Tumor: Positive: CD8", "Tumor"]
    doc[3]["properties"]["classification"] = {"names": ["Tumor", 7]}
    with pytest.raises(AnnotationError, match=r"feature 3: classification .* is not a name"):
        read_annotations(write(tmp_path / "e.geojson", doc))
    nested: dict[str, object] = {"name": "A"}
    for _ in range(500):  # within simdjson's depth limit, past a sane class hierarchy
        nested = {"parentClass": nested, "name": "B"}
    doc[3]["properties"]["classification"] = nested
    with pytest.raises(AnnotationError, match=r"feature 3: classification nested too deep"):
        read_annotations(write(tmp_path / "f.geojson", doc))


def test_qupath_hierarchy_exports_keep_their_child_objects(tmp_path: Path) -> None:
    # FeatureCollection.wrap(objects, true) nests each object's children in
    # properties.childObjects (QuPathTypeAdapters); QuPath itself reads "children" too
    grandchild = feature(polygon(rect(2, 2, 4, 4)), "Necrosis")
    child = feature(polygon(rect(0, 0, 10, 10)), "Tumor")
    child["properties"]["childObjects"] = [grandchild]
    parent = feature(polygon(rect(0, 0, 100, 100)), "Tissue")
    parent["properties"]["childObjects"] = [child, feature(polygon(rect(50, 50, 60, 60)))]
    other = feature(polygon(rect(200, 0, 210, 10)), "Stroma")
    other["properties"]["children"] = [feature(polygon(rect(201, 1, 202, 2)), "Immune")]
    shapes = read_annotations(write(tmp_path / "h.geojson", [parent, other])).shapes
    assert sorted((s.name, s.geometry.area) for s in shapes) == [
        ("Immune", 1.0),
        ("Necrosis", 4.0),
        ("Stroma", 100.0),
        ("Tissue", 10000.0),
        ("Tumor", 100.0),
        (UNCLASSIFIED, 100.0),
    ]
    child["properties"]["childObjects"] = [{"type": "Nope"}]
    with pytest.raises(AnnotationError, match=r"feature 0 child 0 child 0: not a GeoJSON"):
        read_annotations(write(tmp_path / "bad.geojson", [parent]))


def test_geojson_points_with_z_and_integer_coordinates(tmp_path: Path) -> None:
    ring = [[0, 0, 5.5], [100, 0, 5.5], [100, 50.5, 5.5], [0, 50.5, 5.5], [0, 0, 5.5]]
    doc = [feature({"type": "Polygon", "coordinates": [ring]}, "Tumor")]
    doc.append(feature(polygon(rect(200, 0, 300, 10)), "Tumor"))  # integers
    shapes = read_annotations(write(tmp_path / "z.geojson", doc)).shapes
    assert [s.geometry.area for s in shapes] == [5050.0, 1000.0]


def test_malformed_xml_names_the_element(tmp_path: Path) -> None:
    path = tmp_path / "s.xml"
    path.write_text(
        '<Annotations><Annotation Id="1" Name="Tumor"><Regions><Region Id="1">'
        '<Vertices><Vertex X="1" Y="2"/></Vertices></Region><Region Id="2"><Vertices>'
        '<Vertex X="abc" Y="2"/></Vertices></Region></Regions></Annotation></Annotations>'
    )
    with pytest.raises(
        AnnotationError, match=r"Annotation 'Tumor' Region 2: <Vertex> has no numeric X"
    ):
        read_annotations(str(path))
    path.write_text(
        '<ASAP_Annotations><Annotations><Annotation PartOfGroup="Tumor">'
        '<Coordinates><Coordinate Order="0" X="1" /></Coordinates></Annotation>'
        "</Annotations></ASAP_Annotations>"
    )
    with pytest.raises(AnnotationError, match=r"Annotation 0 .*no numeric Y"):
        read_annotations(str(path))
    path.write_text("<Annotations><Annotation>")
    with pytest.raises(AnnotationError, match="malformed XML"):
        read_annotations(str(path))
    path.write_text("<svg><path d='M0 0'/></svg>")
    with pytest.raises(AnnotationError, match=r"unknown XML annotations \(root element <svg>\)"):
        read_annotations(str(path))
    path.write_bytes(b"\x89PNG\r\n")
    with pytest.raises(AnnotationError, match="neither JSON nor XML"):
        read_annotations(str(path))


def test_xml_numbers_with_decimal_commas_and_shuffled_order(tmp_path: Path) -> None:
    # ImageScope on a German or French system writes "12,5"; ASAP lists Order out of order
    path = tmp_path / "comma.xml"
    vertices = "".join(f'<Vertex X="{x},5" Y="{y},25"/>' for x, y in rect(0, 0, 10, 20))
    path.write_text(
        '<Annotations><Annotation Id="1" Name="Tumor"><Regions><Region Id="1"><Vertices>'
        f"{vertices}</Vertices></Region></Regions></Annotation></Annotations>"
    )
    (shape,) = read_annotations(str(path)).shapes
    assert shape.geometry.bounds == (0.5, 0.25, 10.5, 20.25)
    coordinates = [(2, 10, 20), (0, 0, 0), (3, 0, 20), (1, 10, 0)]
    path = tmp_path / "order.xml"
    path.write_text(
        '<ASAP_Annotations><Annotations><Annotation PartOfGroup="Tumor"><Coordinates>'
        + "".join(f'<Coordinate Order="{o}" X="{x}" Y="{y}"/>' for o, x, y in coordinates)
        + "</Coordinates></Annotation></Annotations></ASAP_Annotations>"
    )
    (shape,) = read_annotations(str(path)).shapes
    assert shape.geometry.area == 200 and shape.geometry.is_valid  # a rectangle, not a bow tie


@pytest.mark.parametrize("encoding", ["utf-8-sig", "utf-16", "utf-16-be", "utf-32"])
@pytest.mark.parametrize(
    ("writer", "suffix"),
    [(write_geojson, ".geojson"), (write_asap, ".xml"), (write_aperio, ".xml")],
)
def test_files_with_a_byte_order_mark_or_in_utf_16_are_read(
    tmp_path: Path, writer: Callable[[Path, list[Region]], Path], suffix: str, encoding: str
) -> None:
    # Notepad, PowerShell and .NET's XmlWriter start files with a byte order mark; some Windows
    # tools write UTF-16. Such files were "not an annotation file (neither JSON nor XML)".
    regions = [Region("Tumor", rect(0, 0, 100, 50)), Region("Stroma", rect(200, 0, 300, 10))]
    plain = writer(tmp_path / f"plain{suffix}", regions)
    text = plain.read_text(encoding="utf-8")
    data = text.encode(encoding)
    if encoding == "utf-16-be":  # the codec writes no mark: put one, as Windows tools do
        data = "\ufeff".encode(encoding) + data
    path = tmp_path / f"marked{suffix}"
    path.write_bytes(data)
    expected = [(s.name, s.geometry.area) for s in read_annotations(str(plain)).shapes]
    assert [(s.name, s.geometry.area) for s in read_annotations(str(path)).shapes] == expected


def test_a_utf_16_xml_declaration_and_a_broken_utf_16_file(tmp_path: Path) -> None:
    # .NET's XmlWriter with Encoding.Unicode writes both the mark and encoding="utf-16"
    plain = write_aperio(tmp_path / "plain.xml", [Region("Tumor", rect(0, 0, 10, 10))])
    declared = '<?xml version="1.0" encoding="utf-16"?>\r\n' + plain.read_text()
    path = tmp_path / "declared.xml"
    path.write_bytes(declared.encode("utf-16"))
    assert [s.geometry.area for s in read_annotations(str(path)).shapes] == [100.0]
    path.write_bytes(declared.encode("utf-16")[:-1])  # cut mid-character
    with pytest.raises(AnnotationError, match=r"declared\.xml: not UTF-16 text, although"):
        read_annotations(str(path))


def test_qupath_04_exports_with_nan_measurements_are_read(tmp_path: Path) -> None:
    # QuPath before 0.5 (qupath#1293) and Python's json.dump write non-finite measurements as
    # bare NaN / Infinity, which JSON does not allow; the geometry is what matters here
    doc = [feature(polygon(rect(0, 0, 100, 50)), "Tumor")]
    doc[0]["properties"]["measurements"] = {"Area": math.nan, "Max": math.inf, "Min": -math.inf}
    doc[0]["properties"]["name"] = 'says "NaN" and Infinity in words'
    doc.append(feature(polygon(rect(200, 0, 300, 10)), "Stroma"))
    path = tmp_path / "qupath 0.4.geojson"
    path.write_text(json.dumps(doc))  # allow_nan: writes the bare tokens
    assert "NaN" in path.read_text() and "-Infinity" in path.read_text()
    shapes = read_annotations(str(path)).shapes
    assert [(s.name, s.geometry.area) for s in shapes] == [("Tumor", 5000.0), ("Stroma", 1000.0)]
    # in coordinates they are still not numbers, and the feature is named
    doc[1]["geometry"]["coordinates"][0][2] = [math.nan, 10]
    path.write_text(json.dumps(doc))
    with pytest.raises(AnnotationError, match=r"feature 1: coordinates are not numbers"):
        read_annotations(str(path))


def test_entities_are_refused_never_expanded_or_fetched(tmp_path: Path) -> None:
    secret = tmp_path / "secret.txt"
    secret.write_text("do not read")
    # a billion laughs: each entity is ten of the one before
    bomb = "".join(f'<!ENTITY l{i} "{f"&l{i - 1};" * 10}">' for i in range(1, 9))
    for name, doctype in [
        ("xxe.xml", f'<!DOCTYPE a [<!ENTITY e SYSTEM "file://{secret}">]>'),
        ("bomb.xml", f'<!DOCTYPE a [<!ENTITY l0 "ha">{bomb}]>'),
    ]:
        path = tmp_path / name
        path.write_text(
            f'<?xml version="1.0"?>{doctype}<ASAP_Annotations><Annotations>'
            '<Annotation PartOfGroup="&e;"/></Annotations></ASAP_Annotations>'
        )
        # refused before any expansion (an expanded bomb would not end within the suite's limit)
        with pytest.raises(AnnotationError, match="refused"):
            read_annotations(str(path))


def test_self_intersecting_polygons_are_repaired_with_a_note(tmp_path: Path) -> None:
    bowtie = [(0, 0), (100, 100), (100, 0), (0, 100)]
    path = write_geojson(tmp_path / "s.geojson", [Region("Tumor", bowtie)])
    regions = read_regions([str(path)], 1000, 1000)
    assert regions.classes["Tumor"].area == pytest.approx(5000)  # two triangles
    assert any("1 self-intersecting" in note for note in regions.notes)


def test_regions_outside_the_slide_are_clipped_with_a_note(tmp_path: Path) -> None:
    path = write_aperio(
        tmp_path / "s.xml",
        [Region("Tumor", rect(-50, -50, 50, 50)), Region("Far", rect(5000, 5000, 6000, 6000))],
    )
    regions = read_regions([str(path)], 1000, 1000)
    assert regions.classes["Tumor"].area == 2500 and "Far" not in regions.classes
    notes = " ".join(regions.notes)
    assert "reach outside the 1000 x 1000 slide and were clipped" in notes
    assert "class 'Far' lies entirely outside the slide" in notes


def test_aperio_ellipses_rectangles_and_layer_names(tmp_path: Path) -> None:
    path = tmp_path / "s.xml"
    path.write_text(
        '<Annotations><Annotation Id="1" Name=""><Attributes><Attribute Name="Necrosis" '
        'Value=""/></Attributes><Regions><Region Id="1" Type="2"><Vertices><Vertex X="0" Y="0"/>'
        '<Vertex X="200" Y="100"/></Vertices></Region></Regions></Annotation>'
        '<Annotation Id="7"><Regions><Region Id="1" Type="1"><Vertices><Vertex X="0" Y="0"/>'
        '<Vertex X="10" Y="0"/><Vertex X="10" Y="10"/><Vertex X="0" Y="10"/></Vertices>'
        '</Region><Region Id="2" Type="3"><Vertices><Vertex X="0" Y="0"/><Vertex X="5" Y="5"/>'
        "</Vertices></Region></Regions></Annotation></Annotations>"
    )
    parsed = read_annotations(str(path))
    by_name = {s.name: s.geometry for s in parsed.shapes}
    assert by_name["Necrosis"].area == pytest.approx(3.14159 * 100 * 50, rel=0.01)
    assert by_name["Layer 7"].area == 100
    assert "1 Aperio regions with < 3 vertices" in " ".join(parsed.notes)


def test_halo_rectangles_ellipses_holes_and_what_has_no_area(tmp_path: Path) -> None:
    """HALO gives rectangles and ellipses by two opposite corners; rulers and pins have no
    area (skipped, said); a negative region is a hole in its layer."""
    path = tmp_path / "s.annotations"
    path.write_text(
        '<Annotations><Annotation Name="Tumor" Visible="True" LineColor="255"><Regions>'
        '<Region Type="Rectangle" HasEndcaps="0" NegativeROA="0"><Vertices><V X="100" Y="200"/>'
        '<V X="0" Y="0"/></Vertices><Comments/></Region>'
        '<Region Type="Polygon" HasEndcaps="0" NegativeROA="1"><Vertices><V X="10" Y="10"/>'
        '<V X="20" Y="10"/><V X="20" Y="20"/><V X="10" Y="10"/></Vertices></Region>'
        '<Region Type="Ruler" HasEndcaps="1" NegativeROA="0"><Vertices><V X="0" Y="0"/>'
        '<V X="50" Y="50"/></Vertices></Region></Regions></Annotation>'
        '<Annotation Name="Necrosis" Visible="False" LineColor="0"><Regions>'
        '<Region Type="Ellipse" HasEndcaps="0" NegativeROA="0"><Vertices><V X="0" Y="0"/>'
        '<V X="200" Y="100"/></Vertices></Region>'
        '<Region Type="Pin" HasEndcaps="0" NegativeROA="0"><Vertices><V X="5" Y="5"/>'
        '</Vertices></Region></Regions></Annotation><Annotation Name="Empty" /></Annotations>'
    )
    parsed = read_annotations(str(path))
    shapes = [(s.name, s.hole, s.geometry.area) for s in parsed.shapes]
    assert shapes[:2] == [("Tumor", False, 100 * 200), ("Tumor", True, 50)]
    assert shapes[2][:2] == ("Necrosis", False)
    assert shapes[2][2] == pytest.approx(3.14159 * 100 * 50, rel=0.01)
    assert len(shapes) == 3
    assert "2 HALO rulers and pins" in " ".join(parsed.notes)


def test_an_annotations_folder_matches_halo_files_by_slide_name(tmp_path: Path) -> None:
    from wsi_loader.index._inputs import SlideEntry
    from wsi_loader.index.annotations import match_annotations

    (tmp_path / "notes").mkdir()
    write_halo(tmp_path / "notes" / "case 1.annotations", [Region("Tumor", rect(0, 0, 9, 9))])
    slide = str(tmp_path / "case 1.svs")
    files, report = match_annotations([SlideEntry(path=slide)], str(tmp_path / "notes"))
    assert [Path(f).name for f in files[slide]] == ["case 1.annotations"]
    assert not report.unmatched_files


def test_digital_slide_archive_shapes_classes_and_what_has_no_area(tmp_path: Path) -> None:
    """DSA's rectangles and ellipses are a centre, a size and a rotation (radians); circles a
    centre and a radius. The class is the element's group, else its label, else the name of
    its annotation. An item's annotations come as a list of records."""

    def record(name: str, *elements: dict[str, object]) -> dict[str, object]:
        return {"_id": "a" * 24, "annotation": {"name": name, "elements": list(elements)}}

    path = tmp_path / "slide.json"
    path.write_text(
        json.dumps(
            [
                record(
                    "tumour outlines",
                    {
                        "type": "rectangle",
                        "center": [100, 50, 0],
                        "width": 40,
                        "height": 20,
                        "rotation": math.pi / 2,
                        "group": "Tumor",
                    },
                    {
                        "type": "ellipse",
                        "center": [500, 500, 0],
                        "width": 200,
                        "height": 100,
                        "label": {"value": "Necrosis"},
                    },
                    {"type": "circle", "center": [900, 900, 0], "radius": 10},
                    {"type": "point", "center": [1, 1, 0], "group": "Tumor"},
                    {"type": "arrow", "points": [[0, 0, 0], [5, 5, 0]]},
                    {"type": "polyline", "points": [[0, 0, 0], [9, 0, 0], [9, 9, 0]]},
                ),
                record(
                    "Stroma",
                    {
                        "type": "polyline",
                        "closed": True,
                        "points": [[0, 0, 0], [10, 0, 0], [10, 10, 0]],
                    },
                ),
            ]
        )
    )
    parsed = read_annotations(str(path))
    by_name = {s.name: s.geometry for s in parsed.shapes}
    assert sorted(by_name) == ["Necrosis", "Stroma", "Tumor", "tumour outlines"]
    assert by_name["Tumor"].area == pytest.approx(800)  # turned a quarter: 20 wide, 40 high
    assert by_name["Tumor"].bounds == pytest.approx((90, 30, 110, 70))
    assert by_name["Necrosis"].area == pytest.approx(math.pi * 100 * 50, rel=0.01)
    assert by_name["tumour outlines"].area == pytest.approx(math.pi * 100, rel=0.01)
    assert by_name["Stroma"].area == 50
    notes = " ".join(parsed.notes)
    assert "1 DSA point elements" in notes and "1 DSA arrow elements" in notes
    assert "1 open DSA polylines" in notes


@pytest.mark.parametrize(
    ("document", "message"),
    [
        ({"elements": [{"type": "polyline", "closed": True, "points": "no"}]}, "element 0"),
        (
            {
                "elements": [
                    {"type": "rectangle", "center": [1, 2, 0], "width": "wide", "height": 1}
                ]
            },
            "'width' is not a number",
        ),
        ({"elements": [7]}, "not an object"),
    ],
)
def test_malformed_dsa_json_names_the_element(
    tmp_path: Path, document: object, message: str
) -> None:
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(document))
    with pytest.raises(AnnotationError, match=message) as info:
        read_annotations(str(path))
    assert str(path) in str(info.value)


def test_annotations_leave_no_thread_pool_spinning(tmp_path: Path) -> None:
    """Reading and measuring annotations must not call into multi-threaded BLAS: OpenBLAS's
    threads spin for ~0.1 s after a large call, on the core that the tissue detection (or
    another worker) needs. Measured as the CPU time the process's other threads use while
    its main thread sleeps after the work."""
    ring = [(math.cos(a / 100) * 3000 + 5000, math.sin(a / 100) * 3000 + 5000) for a in range(628)]
    path = write_geojson(tmp_path / "s.geojson", [Region("Tumor", ring), Region("Stroma", ring)])
    script = (
        "import time, sys\n"
        "import numpy as np\n"
        "from wsi_loader.config import IndexConfig\n"
        "from wsi_loader.index.annotations._tiles import annotate_slide\n"
        "x, y = np.meshgrid(np.arange(0, 10000 - 99, 50), np.arange(0, 10000 - 99, 50))\n"
        "def run():\n"
        "    annotate_slide([sys.argv[1]], IndexConfig(tile_size=100), (10000, 10000),\n"
        "                   x.ravel(), y.ravel(), 100)\n"
        "run()\n"  # warm: imports, lazy initialisation
        "time.sleep(0.3)\n"
        "run()\n"
        "cpu, own = time.process_time(), time.thread_time()\n"
        "time.sleep(0.3)\n"
        "print((time.process_time() - cpu) - (time.thread_time() - own))\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.endswith("_NUM_THREADS")}
    out = subprocess.run(
        [sys.executable, "-c", script, str(path)],
        capture_output=True,
        text=True,
        env=env,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    assert float(out.stdout) < 0.02, f"other threads used {float(out.stdout):.3f} s of CPU"


def test_a_small_file_of_tangled_outlines_is_measured_in_bounded_time(tmp_path: Path) -> None:
    """A 50 KB file: 20 copies of a 126-vertex outline that crosses itself ~4,000 times. It
    took GEOS's default make_valid 2.2 s per copy, and the crossing search between identical
    outlines grew with the square of the pieces in a cell (minutes). Run in a child process
    with a timeout, so that a regression fails instead of hanging the suite."""
    ring = [(math.cos(a) * 100 + 200, math.sin(a) * 100 + 200) for a in range(0, 628, 5)]
    path = write_geojson(tmp_path / "tangled.geojson", [Region("Tumor", ring)] * 20)
    script = (
        "import sys\n"
        "import numpy as np\n"
        "from wsi_loader.config import IndexConfig\n"
        "from wsi_loader.index.annotations._tiles import annotate_slide\n"
        "x, y = np.meshgrid(np.arange(0, 745, 256), np.arange(0, 745, 256))\n"
        "done = annotate_slide([sys.argv[1]], IndexConfig(tile_size=256), (1000, 1000),\n"
        "                      x.ravel(), y.ravel(), 256)\n"
        "print(done.areas['Tumor'])\n"
    )
    try:
        out = subprocess.run(
            [sys.executable, "-c", script, str(path)],
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
    except subprocess.TimeoutExpired:
        pytest.fail("measuring 20 tangled outlines took over 60 s")
    assert out.returncode == 0, out.stderr
    # everything the outline encloses: its repaired area equals that of one copy
    assert float(out.stdout) == pytest.approx(
        shapely.make_valid(shapely.Polygon(ring), method="structure").area
    )


def qupath_object(kind: str, ring: list[tuple[float, float]], name: str) -> dict[str, object]:
    """A feature as QuPath 0.3+ exports it, with its object type."""
    made = feature(polygon(ring), {"name": name})
    made["properties"]["objectType"] = kind  # type: ignore[index]
    return made


def test_qupath_object_types_are_said_and_can_be_chosen(tmp_path: Path) -> None:
    # "Export objects as GeoJSON" with "All objects" writes the cell detections beside the
    # pathologist's annotations: they are read as regions of their classes, and the notes say so
    region = qupath_object("annotation", rect(0, 0, 100, 100), "Tumor")
    region["properties"]["childObjects"] = [qupath_object("cell", rect(1, 1, 3, 3), "Tumor")]
    doc = [
        region,
        qupath_object("cell", rect(200, 0, 203, 3), "Lymphocyte"),
        qupath_object("detection", rect(210, 0, 213, 3), "Lymphocyte"),
        qupath_object("tile", rect(300, 0, 350, 50), "Stroma"),
        qupath_object("tma_core", rect(400, 0, 500, 100), UNCLASSIFIED),
        # QuPath 0.2 named the type in the feature's id
        {**feature(polygon(rect(600, 0, 610, 10)), "Necrosis"), "id": "PathAnnotationObject"},
        {**feature(polygon(rect(620, 0, 622, 2)), "Necrosis"), "id": "PathCellObject"},
    ]
    path = write(tmp_path / "all objects.geojson", doc)

    def read(*objects: str) -> tuple[list[tuple[str, float]], str]:
        parsed = read_annotations(path, objects)
        return sorted((s.name, s.geometry.area) for s in parsed.shapes), " ".join(parsed.notes)

    shapes, notes = read()
    assert len(shapes) == 8
    assert "3 cell, 1 detection, 1 tile, 1 tma_core QuPath objects were read as regions" in notes
    shapes, notes = read("annotation")
    assert shapes == [("Necrosis", 100.0), ("Tumor", 10000.0)]
    assert "3 cell, 1 detection, 1 tile, 1 tma_core QuPath objects were left out" in notes
    assert "were read as regions" not in notes
    shapes, _ = read("detection")  # cells and tiles are detections, as in QuPath
    assert shapes == [
        ("Lymphocyte", 9.0),
        ("Lymphocyte", 9.0),
        ("Necrosis", 4.0),
        ("Stroma", 2500.0),
        ("Tumor", 4.0),
    ]
    shapes, notes = read("cell", "tma_core")
    assert [n for n, _ in shapes] == ["Lymphocyte", "Necrosis", "Tumor", UNCLASSIFIED]
    assert notes == (
        "2 annotation, 1 detection, 1 tile QuPath objects were left out (annotation_objects)"
    )
    # files without object types (other tools' GeoJSON, the XML formats) are read whole
    plain = write(tmp_path / "plain.geojson", [feature(polygon(rect(0, 0, 5, 5)), "Tumor")])
    assert len(read_annotations(plain, ["annotation"]).shapes) == 1
    assert not read_annotations(plain, ["annotation"]).notes
    with pytest.raises(ValueError, match=r"unknown QuPath object type\(s\) \['nucleus'\]"):
        read_annotations(path, ["nucleus"])


def test_a_class_name_past_the_limit_is_refused_in_a_short_message(tmp_path: Path) -> None:
    """A 48 MB class name filled stderr with 50 MB (the notes and warnings that name
    classes) and meta.json with 150 MB. Names are bounded; the error shows its start."""
    name = "Tumor " + "x" * 2_000_000
    path = write_geojson(tmp_path / "s.geojson", [Region(name, rect(0, 0, 10, 10))])
    with pytest.raises(AnnotationError) as caught:
        read_annotations(str(path))
    message = str(caught.value)
    assert f"a class name of {len(name):,} characters" in message and str(path) in message
    assert f"at most {MAX_CLASS_NAME}" in message and "'Tumor xxx" in message
    assert len(message) < 500
    ok = write_geojson(tmp_path / "ok.geojson", [Region("T" * MAX_CLASS_NAME, rect(0, 0, 9, 9))])
    assert read_annotations(str(ok)).shapes[0].name == "T" * MAX_CLASS_NAME


def test_a_classification_that_is_not_a_name_is_shown_short(tmp_path: Path) -> None:
    document = {
        "type": "Feature",
        "geometry": {"type": "Polygon", "coordinates": [[[0, 0], [9, 0], [9, 9], [0, 0]]]},
        "properties": {"classification": {"name": ["x" * 1_000_000]}},
    }
    path = tmp_path / "s.geojson"
    path.write_text(json.dumps(document))
    with pytest.raises(AnnotationError, match="is not a name") as caught:
        read_annotations(str(path))
    assert len(str(caught.value)) < 500


def test_more_classes_than_an_index_holds_are_refused(tmp_path: Path) -> None:
    """100,000 classes (one square each) took 24 s and 1.96 GB to index: every class is a
    coverage column of every tile. A file with more than MAX_CLASSES is an error saying so."""
    regions = [Region(f"class {i}", rect(i, 0, i + 1, 1)) for i in range(MAX_CLASSES + 1)]
    path = write_geojson(tmp_path / "s.geojson", regions)
    with pytest.raises(AnnotationError) as caught:
        read_annotations(str(path))
    assert f"{MAX_CLASSES + 1:,} classes, more than the {MAX_CLASSES:,}" in str(caught.value)
    assert read_annotations(str(write_geojson(tmp_path / "ok.geojson", regions[1:])))


def test_the_files_of_one_slide_together_stay_within_the_classes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from wsi_loader.index.annotations import _formats as formats
    from wsi_loader.index.annotations import read_shapes

    monkeypatch.setattr(formats, "MAX_CLASSES", 3)
    a = write_geojson(tmp_path / "a.geojson", [Region(n, rect(0, 0, 9, 9)) for n in "AB"])
    b = write_geojson(tmp_path / "b.geojson", [Region(n, rect(0, 0, 9, 9)) for n in "CD"])
    assert len(read_shapes([str(a)])[0]) == 2
    with pytest.raises(AnnotationError, match="4 classes, more than the 3") as caught:
        read_shapes([str(a), str(b)])
    assert str(a) in str(caught.value) and str(b) in str(caught.value)
