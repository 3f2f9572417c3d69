"""Write the same region shapes as QuPath GeoJSON, ASAP XML, Aperio ImageScope XML, HALO
``.annotations`` and Digital Slide Archive JSON, the way those programs lay their files out
(level-0 pixel coordinates)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

Point = tuple[float, float]


class Region:
    """A class-named polygon with optional holes."""

    def __init__(self, name: str, shell: Sequence[Point], holes: Sequence[Sequence[Point]] = ()):
        self.name, self.shell, self.holes = name, list(shell), [list(h) for h in holes]


def rect(x0: float, y0: float, x1: float, y1: float) -> list[Point]:
    return [(x0, y0), (x1, y0), (x1, y1), (x0, y1)]


def _closed(ring: list[Point]) -> list[list[float]]:
    return [list(p) for p in [*ring, ring[0]]]


def write_geojson(path: Path, regions: Sequence[Region], old_style: bool = False) -> Path:
    """A QuPath 0.4+ export (FeatureCollection; ``old_style``: a bare list with the class as a
    plain string, like QuPath 0.2 scripts wrote)."""
    features = []
    for i, r in enumerate(regions):
        classification: object = r.name if old_style else {"name": r.name, "color": [200, 0, 0]}
        features.append(
            {
                "type": "Feature",
                "id": f"feature-{i}",
                "geometry": {
                    "type": "Polygon",
                    "coordinates": [_closed(r.shell), *(_closed(h) for h in r.holes)],
                },
                "properties": {"objectType": "annotation", "classification": classification},
            }
        )
    document: object = (
        features if old_style else {"type": "FeatureCollection", "features": features}
    )
    path.write_text(json.dumps(document))
    return path


def write_asap(path: Path, regions: Sequence[Region], group_names: dict[str, str] | None = None):
    """ASAP XML; holes go to the Camelyon16 exclusion group ``_2`` (so they cut every class of
    the file: keep them away from other classes' regions). ``group_names`` renames groups
    (e.g. Tumor -> _0, as Camelyon16 files name them)."""
    groups = group_names or {}
    parts, n = [], 0

    def annotation(group: str, ring: list[Point]) -> str:
        nonlocal n
        coords = "".join(
            f'<Coordinate Order="{k}" X="{x}" Y="{y}" />' for k, (x, y) in enumerate(ring)
        )
        n += 1
        return (
            f'<Annotation Name="Annotation {n}" Type="Polygon" PartOfGroup="{group}" '
            f'Color="#F4FA58"><Coordinates>{coords}</Coordinates></Annotation>'
        )

    for r in regions:
        parts.append(annotation(groups.get(r.name, r.name), r.shell))
        parts.extend(annotation("_2", h) for h in r.holes)
    names = sorted({groups.get(r.name, r.name) for r in regions} | {"_2"})
    group_xml = "".join(
        f'<Group Name="{g}" PartOfGroup="None" Color="#64FE2E"><Attributes /></Group>'
        for g in names
    )
    path.write_text(
        '<?xml version="1.0"?><ASAP_Annotations><Annotations>'
        + "".join(parts)
        + f"</Annotations><AnnotationGroups>{group_xml}</AnnotationGroups></ASAP_Annotations>"
    )
    return path


def write_aperio(path: Path, regions: Sequence[Region]) -> Path:
    """Aperio ImageScope XML: one layer per class, holes as NegativeROA regions of the layer."""
    layers: dict[str, list[str]] = {}
    for r in regions:
        for ring, negative in [(r.shell, 0), *((h, 1) for h in r.holes)]:
            vertices = "".join(f'<Vertex X="{x}" Y="{y}" Z="0" />' for x, y in ring)
            region_id = sum(len(v) for v in layers.values()) + 1
            layers.setdefault(r.name, []).append(
                f'<Region Id="{region_id}" Type="0" Zoom="0.5" NegativeROA="{negative}" '
                f'Analyze="1" DisplayId="{region_id}"><Attributes />'
                f"<Vertices>{vertices}</Vertices></Region>"
            )
    body = "".join(
        f'<Annotation Id="{i + 1}" Name="{name}" ReadOnly="0" LineColor="65280" Visible="1">'
        '<Attributes><Attribute Name="Description" Id="0" Value="" /></Attributes>'
        f"<Regions><RegionAttributeHeaders /> {''.join(rs)}</Regions><Plots /></Annotation>"
        for i, (name, rs) in enumerate(layers.items())
    )
    path.write_text(f'<Annotations MicronsPerPixel="0.499000">{body}</Annotations>')
    return path


def write_halo(path: Path, regions: Sequence[Region]) -> Path:
    """Indica Labs HALO ``.annotations`` (the layout pyhaloxml reads and writes): one layer per
    class, ``<V X Y>`` vertices with the first repeated last, holes as NegativeROA regions."""
    layers: dict[str, list[str]] = {}
    for r in regions:
        for ring, negative in [(r.shell, 0), *((h, 1) for h in r.holes)]:
            vertices = "".join(f'<V X="{x:g}" Y="{y:g}" />' for x, y in [*ring, ring[0]])
            layers.setdefault(r.name, []).append(
                f'<Region Type="Polygon" HasEndcaps="0" NegativeROA="{negative}">'
                f"<Vertices>{vertices}</Vertices><Comments /></Region>"
            )
    body = "".join(
        f'<Annotation Name="{name}" Visible="True" LineColor="65280"><Regions>{"".join(rs)}'
        "</Regions></Annotation>"
        for name, rs in layers.items()
    )
    path.write_text(f"<Annotations>{body}</Annotations>")
    return path


def write_dsa(path: Path, regions: Sequence[Region], record: bool = True) -> Path:
    """Digital Slide Archive (HistomicsUI, large_image) annotation JSON: closed polylines of
    [x, y, z] points, not repeated at the end, with holes; the class is the element's
    ``group``. ``record``: as the API returns an annotation ({"annotation": {...}, ...}),
    else the bare annotation body."""
    elements = [
        {
            "type": "polyline",
            "closed": True,
            "group": r.name,
            "lineColor": "rgb(0,0,0)",
            "points": [[x, y, 0] for x, y in r.shell],
            **({"holes": [[[x, y, 0] for x, y in h] for h in r.holes]} if r.holes else {}),
        }
        for r in regions
    ]
    body = {"name": "regions", "elements": elements}
    document = {"_id": "0" * 24, "itemId": "1" * 24, "annotation": body} if record else body
    path.write_text(json.dumps(document))
    return path


# each format's writer and the file suffix its program gives it
WRITERS = {
    "geojson": (write_geojson, ".geojson"),
    "asap": (write_asap, ".xml"),
    "aperio": (write_aperio, ".xml"),
    "halo": (write_halo, ".annotations"),
    "dsa": (write_dsa, ".json"),
}

SHAPES = [
    Region("Tumor", rect(0, 0, 512, 512), [rect(128, 128, 384, 384)]),  # 0.75 of 4 tiles
    Region("Stroma", [(1024, 0), (1536, 0), (1024, 512)]),  # 1, 0.5, 0.5
    Region("Pen", rect(1800, 1200, 1900, 1300)),  # 0.122 and 0.031 of two tiles
]


def annotated_archive(root: Path, slide: Path) -> Path:
    """Three copies of ``slide`` under ``root/archive``, names with dots and spaces, each
    annotated with `SHAPES` in another format under ``root/annotations`` (QuPath GeoJSON,
    ASAP XML, Aperio XML named the QuPath way, with the slide's extension)."""
    import shutil

    folder = root / "archive"
    folder.mkdir()
    for name in ("case 1.a", "case 2.b", "case 3.c"):
        shutil.copy(slide, folder / f"{name}.svs")
    notes = root / "annotations"
    notes.mkdir()
    write_geojson(notes / "case 1.a.geojson", SHAPES)
    write_asap(notes / "case 2.b.xml", SHAPES)
    write_aperio(notes / "case 3.c.svs.xml", SHAPES)
    return root
