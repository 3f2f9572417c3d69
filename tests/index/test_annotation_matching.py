"""Which annotation files belong to which slide: by relative path first, then by name; a file
that could belong to several slides is an error naming them."""

from __future__ import annotations

from pathlib import Path

import pytest

from wsi_loader.errors import InputError
from wsi_loader.index._inputs import SlideEntry
from wsi_loader.index.annotations import match_annotations


def _files(root: Path, *names: str) -> list[str]:
    paths = []
    for name in names:
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("{}")
        paths.append(str(path))
    return paths


def _slides(root: Path, *names: str) -> list[SlideEntry]:
    return [SlideEntry(path=str(root / name)) for name in names]


def test_slides_of_one_name_in_two_folders_get_their_own_files(tmp_path: Path) -> None:
    """a/case.svs and b/case.svs with ann/a/case.geojson and ann/b/case.geojson: both slides
    got both files, silently."""
    a, b = _files(tmp_path / "ann", "a/case.geojson", "b/case.geojson")
    entries = _slides(tmp_path / "slides", "a/case.svs", "b/case.svs")
    found, report = match_annotations(entries, str(tmp_path / "ann"))
    assert found == {entries[0].path: (a,), entries[1].path: (b,)}
    assert report.unmatched_files == []


def test_deeper_folders_match_by_their_trailing_folders(tmp_path: Path) -> None:
    """The annotation tree need not mirror the archive from its root: the file's folders
    relative to the annotations folder must end the slide's folder path."""
    one, two = _files(tmp_path / "ann", "site1/a/case.xml", "site2/a/case.xml")
    entries = _slides(tmp_path / "data", "site1/a/case.svs", "site2/a/case.svs")
    found, _ = match_annotations(entries, str(tmp_path / "ann"))
    assert found == {entries[0].path: (one,), entries[1].path: (two,)}


def test_a_file_that_could_belong_to_several_slides_is_an_error(tmp_path: Path) -> None:
    _files(tmp_path / "ann", "case.geojson")
    entries = _slides(tmp_path / "slides", "a/case.svs", "b/case.svs")
    with pytest.raises(InputError) as caught:
        match_annotations(entries, str(tmp_path / "ann"))
    message = str(caught.value)
    assert "case.geojson" in message and entries[0].path in message and entries[1].path in message
    assert "ambiguous" in message
    # in a folder that names neither slide's folder, the same
    _files(tmp_path / "other", "x/case.geojson")
    with pytest.raises(InputError, match="ambiguous"):
        match_annotations(entries, str(tmp_path / "other"))


def test_names_alone_still_match_a_flat_or_differently_organised_folder(tmp_path: Path) -> None:
    flat, qupath, nested = _files(
        tmp_path / "ann", "one.geojson", "two.svs.geojson", "tumour/three.xml"
    )
    extra = _files(tmp_path / "ann", "one.xml")[0]
    entries = _slides(tmp_path / "slides", "x/one.svs", "y/two.svs", "three.svs")
    found, report = match_annotations(entries, str(tmp_path / "ann"))
    assert found == {
        entries[0].path: (flat, extra),
        entries[1].path: (qupath,),
        entries[2].path: (nested,),
    }
    assert report.unmatched_files == []


def test_a_file_of_another_folder_does_not_join_a_slide_matched_by_path(tmp_path: Path) -> None:
    """Only a/case.svs is indexed: ann/b/case.geojson is b's, not a second file of a's."""
    a, b = _files(tmp_path / "ann", "a/case.geojson", "b/case.geojson")
    entries = _slides(tmp_path / "slides", "a/case.svs")
    found, report = match_annotations(entries, str(tmp_path / "ann"))
    assert found == {entries[0].path: (a,)}
    assert report.unmatched_files == [b]


def test_a_table_naming_a_slide_two_slides_have_is_an_error(tmp_path: Path) -> None:
    (tmp_path / "n.geojson").write_text("{}")
    table = tmp_path / "annotations.csv"
    table.write_text("slide,annotations\ncase,n.geojson\n")
    entries = _slides(tmp_path / "slides", "a/case.svs", "b/case.svs")
    with pytest.raises(InputError, match="ambiguous") as caught:
        match_annotations(entries, str(table))
    assert entries[0].path in str(caught.value) and entries[1].path in str(caught.value)
    by_path = tmp_path / "by_path.csv"
    by_path.write_text("path,annotations\nslides/a/case.svs,n.geojson\n")
    found, _ = match_annotations(entries, str(by_path))
    assert found == {entries[0].path: (str(tmp_path / "n.geojson"),)}


def test_a_misspelt_column_of_the_table_is_named_with_the_one_meant(tmp_path: Path) -> None:
    (tmp_path / "n.geojson").write_text("{}")
    entries = _slides(tmp_path / "slides", "a/case.svs")
    for header, meant in (("slide,anotations", "annotations"), ("slde,annotations", "slide")):
        table = tmp_path / "annotations.csv"
        table.write_text(f"{header}\ncase,n.geojson\n")
        with pytest.raises(InputError, match=f"did you mean '{meant}'") as caught:
            match_annotations(entries, str(table))
        assert str(table) in str(caught.value)
