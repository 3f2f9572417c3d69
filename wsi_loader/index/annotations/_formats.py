"""Parse region annotation files into class-named level-0 polygons.

`read_annotations` tells a file's format by its contents (JSON, or which XML root element)
and hands it to the module of that format. Five formats, all untrusted input (XML goes
through ``defusedxml``: no entity expansion, no external references):

- `_geojson`: QuPath GeoJSON;
- `_dsa`: Digital Slide Archive JSON (HistomicsUI, large_image);
- `_asap`: ASAP XML (Camelyon16/17);
- `_aperio`: Aperio ImageScope XML, and HALO ``.annotations`` (the same layout).

What they share (`Shape`, `Parsed`, coordinates checked, polygons built and repaired, what
has no area counted) is in `_shapes`; the limits on a file's classes are checked here.
"""

from __future__ import annotations

import codecs
import os
import re
from collections.abc import Collection
from xml.etree.ElementTree import ParseError

from defusedxml import DefusedXmlException
from defusedxml.ElementTree import fromstring as xml_from_bytes

from wsi_loader.errors import AnnotationError
from wsi_loader.index.annotations._aperio import aperio
from wsi_loader.index.annotations._asap import asap
from wsi_loader.index.annotations._geojson import geojson, object_types
from wsi_loader.index.annotations._shapes import Parsed, shorten

ANNOTATION_SUFFIXES = (".geojson", ".json", ".xml", ".annotations")  # the last: HALO's
MAX_FILE_BYTES = 512 * 2**20  # a bigger "annotation" file is a mistake, not annotations
# Class names end up in notes, warnings, meta.json and the label ids of every output, and every
# class is a coverage column of every tile of the index: a 48 MB name filled stderr with 50 MB,
# 100,000 classes took 24 s and 1.96 GB. Real projects have tens of classes.
MAX_CLASS_NAME = 256  # characters
MAX_CLASSES = 1_000  # of one file, one slide, and of an index


def read_annotations(path: str, objects: Collection[str] = ()) -> Parsed:
    """The shapes of one annotation file, its format told by its contents (JSON or which XML
    root element). Raises `AnnotationError` naming the file and the element at fault.

    ``objects``: the QuPath object types whose features count (`QUPATH_OBJECT_TYPES`; none
    named: all). Features without a type (other tools' GeoJSON) and the regions of the other
    formats always count."""
    wanted = object_types(objects) if objects else None
    try:
        size = os.stat(path).st_size
        if size > MAX_FILE_BYTES:
            raise AnnotationError(
                f"{size / 2**20:.0f} MiB is too large for an annotation file", path=path
            )
        with open(path, "rb") as fh:
            data = fh.read()
    except OSError as exc:
        raise AnnotationError(f"cannot read: {exc.strerror or exc}", path=path) from exc
    data = _utf8(data, path)
    head = data.lstrip()[:1]
    if head in (b"{", b"["):
        return check_classes(geojson(data, path, wanted), path)
    if head == b"<":
        return check_classes(_xml(data, path), path)
    raise AnnotationError(
        "not an annotation file (neither JSON nor XML: expected QuPath GeoJSON, or ASAP, Aperio "
        "or HALO XML)",
        path=path,
    )


def check_classes(parsed: Parsed, path: str) -> Parsed:
    """``parsed`` when its class names and their number are within `MAX_CLASS_NAME` and
    `MAX_CLASSES`; else an `AnnotationError` that says so (``path``: the file or files)."""
    names = {shape.name for shape in parsed.shapes}
    longest = max(names, key=len, default="")
    if len(longest) > MAX_CLASS_NAME:
        raise AnnotationError(
            f"a class name of {len(longest):,} characters ({shorten(longest)}): class names "
            f"are at most {MAX_CLASS_NAME} characters",
            path=path,
        )
    if len(names) > MAX_CLASSES:
        raise AnnotationError(
            f"{len(names):,} classes, more than the {MAX_CLASSES:,} an index holds (each "
            "class is a coverage column of every tile); class names are meant to be few "
            "(Tumor, Stroma...), not one per object",
            path=path,
        )
    return parsed


# Windows tools (Notepad, PowerShell, .NET's XmlWriter) start text with a byte order mark, and
# some write UTF-16. UTF-32's marks first: UTF-32-LE's begins with UTF-16-LE's.
_BYTE_ORDER_MARKS = (
    (codecs.BOM_UTF32_LE, "utf-32"),
    (codecs.BOM_UTF32_BE, "utf-32"),
    (codecs.BOM_UTF8, "utf-8-sig"),
    (codecs.BOM_UTF16_LE, "utf-16"),
    (codecs.BOM_UTF16_BE, "utf-16"),
)
_XML_ENCODING = re.compile(r"""^(\s*<\?xml[^>]*?\bencoding\s*=\s*)(["'])[^"']*\2""")


def _utf8(data: bytes, path: str) -> bytes:
    """The file's text as UTF-8 without a byte order mark (an XML declaration's encoding
    rewritten to match); a file without a mark is left as it is (JSON is UTF-8, and XML
    without a mark says its encoding in its declaration)."""
    for mark, codec in _BYTE_ORDER_MARKS:
        if data.startswith(mark):
            try:
                text = data.decode(codec)
            except UnicodeDecodeError as exc:
                raise AnnotationError(
                    f"not {codec.removesuffix('-sig').upper()} text, although it starts with "
                    f"that byte order mark ({exc.reason} at byte {exc.start})",
                    path=path,
                ) from None
            return _XML_ENCODING.sub(r"\1\2UTF-8\2", text, count=1).encode("utf-8")
    return data


# -- XML (ASAP, Aperio) ------------------------------------------------------------------------
def _xml(data: bytes, path: str) -> Parsed:
    try:
        root = xml_from_bytes(data, forbid_dtd=True)
    except DefusedXmlException as exc:
        raise AnnotationError(
            f"refused: the XML declares a DTD or entities ({type(exc).__name__})", path=path
        ) from None
    except ParseError as exc:
        raise AnnotationError(f"malformed XML: {exc}", path=path) from None
    if root.tag == "ASAP_Annotations":
        return asap(root, path)
    if root.tag == "Annotations" and (root.find("Annotation/Regions") is not None or not len(root)):
        return aperio(root, path)
    raise AnnotationError(
        f"unknown XML annotations (root element <{root.tag}>): expected ASAP "
        "(<ASAP_Annotations>) or Aperio ImageScope / HALO (<Annotations><Annotation><Regions>)",
        path=path,
    )
