from __future__ import annotations

import unicodedata
from pathlib import Path

import pytest

from wsi_loader.errors import InputError
from wsi_loader.index._fingerprints import fingerprint
from wsi_loader.index._inputs import discover, join_labels, read_manifest


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "empty CSV"),
        ("label\nx\n", "required columns"),
        ("path,label\n,x\n", "empty 'path'"),
        ("path,label\na.svs,x\na.svs,y\n", "listed twice"),
        ("path,mpp\na.svs,fast\n", "'mpp': 'fast' is not a number"),
        ("path,mpp\na.svs,-1\n", "must be > 0"),
        ("path,mpp\na.svs,inf\n", "'mpp': 'inf' is not a finite number"),
        ("path,mpp\na.svs,1e400\n", "'mpp': '1e400' is not a finite number"),
        # um/px 100x off (a typo, or nanometres per pixel divided the wrong way)
        ("path,mpp\na.svs,0.0025\n", "'mpp': 0.0025 um/px is finer than a light microscope"),
        ("path,mpp\na.svs,2500\n", "'mpp': 2500 um/px is coarser than"),
        ("path,label\na.svs,x,extra\n", "3 fields where the header has 2"),
    ],
)
def test_manifest_errors_name_file_and_line(tmp_path: Path, text: str, message: str) -> None:
    manifest = write(tmp_path / "m.csv", text)
    with pytest.raises(InputError, match=message) as info:
        read_manifest(str(manifest))
    assert info.value.path == str(manifest)


def test_manifest_error_has_line_number(tmp_path: Path) -> None:
    manifest = write(tmp_path / "m.csv", "path,label\na.svs,x\n,y\n")
    with pytest.raises(InputError) as info:
        read_manifest(str(manifest))
    assert info.value.line == 3 and str(info.value).startswith(f"{manifest}:3:")


def test_discover_folders_globs_and_dicom_series(tmp_path: Path) -> None:
    (tmp_path / "d" / "series").mkdir(parents=True)
    for name in [
        "d/x.svs",
        "d/y.NDPI",
        "d/z.txt",
        "d/series/1.dcm",
        "d/series/0.dcm",
        "d/.hidden.svs",
    ]:
        write(tmp_path / name, "x")
    found = [Path(e.path).relative_to(tmp_path).as_posix() for e in discover([tmp_path / "d"])]
    assert found == ["d/x.svs", "d/y.NDPI", "d/series/0.dcm"]
    globbed = discover([str(tmp_path / "d" / "*.svs"), str(tmp_path / "d" / "x.svs")])
    assert len(globbed) == 1
    with pytest.raises(InputError, match="matches no slide files"):
        discover([str(tmp_path / "nothing*.svs")])


def test_labels_join_by_path_then_name(tmp_path: Path) -> None:
    entries = discover([write(tmp_path / "a.svs", "x"), write(tmp_path / "b.svs", "x")])
    labels = write(tmp_path / "l.csv", "path,slide,label,split\na.svs,,one,train\n,b,two,\n")
    joined, _ = join_labels(entries, str(labels))
    assert [(e.label, e.split) for e in joined] == [("one", "train"), ("two", None)]
    with pytest.raises(InputError, match="needs a 'label' column"):
        join_labels(entries, str(write(tmp_path / "bad.csv", "slide,diagnosis\na,x\n")))
    with pytest.raises(InputError, match="unknown column 'lbl' \\(did you mean 'label'"):
        join_labels(entries, str(write(tmp_path / "bad.csv", "slide,lbl\na,x\n")))
    with pytest.raises(InputError, match="two different labels"):
        join_labels(entries, str(write(tmp_path / "dup.csv", "slide,label\na,x\na,y\n")))


def test_fingerprint_notices_same_size_rewrite(tmp_path: Path) -> None:
    path = write(tmp_path / "a.svs", "a" * 1000)
    before = fingerprint(str(path))
    stat = path.stat()
    path.write_text("b" * 1000)
    import os

    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    after = fingerprint(str(path))
    assert before[:2] == after[:2] and before[2] != after[2]


# -- CSVs as spreadsheets write them ---------------------------------------------------------
# Excel in German, French, Dutch... locales saves "CSV" with ';' between fields and decimal
# commas in numbers; tab-separated text is what copying a sheet, or R's write.table, gives.
@pytest.mark.parametrize(
    ("raw", "where"),
    [
        (
            b"path;label;mpp\r\na.svs;tumour;0,25\r\nb.svs;normal;0.5\r\n",
            "excel ';' + decimal comma",
        ),
        (b"\xef\xbb\xbfpath;label;mpp\r\na.svs;tumour;0,25\r\nb.svs;normal;0,5\r\n", "with a BOM"),
        (b'"path";"label";"mpp"\na.svs;"tumour";"0,25"\nb.svs;"normal";0.5\n', "quoted"),
        (b"path\tlabel\tmpp\na.svs\ttumour\t0.25\nb.svs\tnormal\t0,5\n", "tab-separated"),
    ],
)
def test_manifests_from_spreadsheets_are_read(tmp_path: Path, raw: bytes, where: str) -> None:
    manifest = tmp_path / "m.csv"
    manifest.write_bytes(raw)
    entries = read_manifest(str(manifest))
    assert [(Path(e.path).name, e.label, e.mpp) for e in entries] == [
        ("a.svs", "tumour", 0.25),
        ("b.svs", "normal", 0.5),
    ], where


def test_labels_and_annotation_tables_from_spreadsheets(tmp_path: Path) -> None:
    entries = discover([write(tmp_path / "a b.svs", "x"), write(tmp_path / "c.d.svs", "x")])
    labels = write(tmp_path / "l.csv", "slide;label;split\na b;one;train\nc.d;two;val\n")
    joined, _ = join_labels(entries, str(labels))
    assert [(e.label, e.split) for e in joined] == [("one", "train"), ("two", "val")]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        # a comma file keeps its meaning: '0,25' there is not a number (and never 0.25)
        ('path,mpp\na.svs,"0,25"\n', "'mpp': '0,25' is not a number"),
        # thousands separators are refused, not read as decimals
        ("path;mpp\na.svs;1.000,5\n", "'mpp': '1.000,5' is not a number"),
        ("path;mpp\na.svs;0,2,5\n", "'mpp': '0,2,5' is not a number"),
        # no delimiter gives a known column: the error says which ones were tried
        ("path|label\na.svs|x\n", "separated by ',', ';' or tabs"),
    ],
)
def test_spreadsheet_csv_errors(tmp_path: Path, text: str, message: str) -> None:
    manifest = write(tmp_path / "m.csv", text)
    with pytest.raises(InputError, match=message):
        read_manifest(str(manifest))


def test_a_csv_in_a_windows_code_page_says_how_to_save_it(tmp_path: Path) -> None:
    manifest = tmp_path / "m.csv"
    manifest.write_bytes("path,label\nré.svs,tumeur\n".encode("cp1252"))
    with pytest.raises(InputError, match=r"not UTF-8 text.*CSV UTF-8"):
        read_manifest(str(manifest))


def test_column_names_are_matched_whatever_their_case(tmp_path: Path) -> None:
    manifest = write(tmp_path / "m.csv", "Path;Label;Split;MPP\na.svs;tumour;train;0,25\n")
    (entry,) = read_manifest(str(manifest))
    assert (entry.label, entry.split, entry.mpp) == ("tumour", "train", 0.25)
    entries = discover([write(tmp_path / "a.svs", "x")])
    joined, _ = join_labels(entries, str(write(tmp_path / "l.csv", "SLIDE,Label\na,one\n")))
    assert joined[0].label == "one"
    with pytest.raises(InputError, match="'label' and 'Label' are the same column"):
        read_manifest(str(write(tmp_path / "twice.csv", "path,label,Label\na.svs,x,y\n")))


def test_manifests_written_on_windows(tmp_path: Path) -> None:
    """Relative paths with '\\' (Excel or pandas on Windows) name the same files here."""
    write(tmp_path / "slides" / "case 1.svs", "x")
    write(tmp_path / "slides" / "sub.dir" / "b.2.svs", "x")
    write(tmp_path / "notes" / "case 1.geojson", "{}")
    manifest = write(
        tmp_path / "m.csv",
        "path,label,annotations\n"
        "slides\\case 1.svs,x,notes\\case 1.geojson\n"
        ".\\slides\\sub.dir\\b.2.svs,y,\n",
    )
    entries = read_manifest(str(manifest))
    assert [e.path for e in entries] == [
        str(tmp_path / "slides" / "case 1.svs"),
        str(tmp_path / "slides" / "sub.dir" / "b.2.svs"),
    ]
    assert entries[0].annotations == (str(tmp_path / "notes" / "case 1.geojson"),)


def test_a_file_named_with_a_backslash_is_taken_as_it_is(tmp_path: Path) -> None:
    write(tmp_path / "odd\\name.svs", "x")  # legal on POSIX
    entries = read_manifest(str(write(tmp_path / "m.csv", "path\nodd\\name.svs\n")))
    assert [e.path for e in entries] == [str(tmp_path / "odd\\name.svs")]


@pytest.mark.parametrize("cell", ["C:\\data\\a.svs", "d:/data/a.svs", "\\\\server\\share\\a.svs"])
def test_windows_absolute_paths_in_a_manifest_are_an_error(tmp_path: Path, cell: str) -> None:
    manifest = write(tmp_path / "m.csv", f"path\nb.svs\n{cell}\n")
    with pytest.raises(InputError, match=r"m.csv:3: .*a Windows path.*relative to the manifest"):
        read_manifest(str(manifest))


def test_labels_with_windows_paths_join_by_name(tmp_path: Path) -> None:
    entries = discover([write(tmp_path / "a.b.svs", "x"), write(tmp_path / "c.svs", "x")])
    labels = write(
        tmp_path / "l.csv", "path,label\nC:\\scans\\a.b.svs,one\n\\\\nas\\scans\\c.svs,two\n"
    )
    joined, report = join_labels(entries, str(labels))
    assert [e.label for e in joined] == ["one", "two"] and not report.unmatched_rows


def test_labels_name_slides_by_file_name_too(tmp_path: Path) -> None:
    # 'slide' written as the file name ('a.b.svs', as listed by ls or TRIDENT) or as the name
    entries = discover([write(tmp_path / "a.b.svs", "x"), write(tmp_path / "c.ndpi", "x")])
    labels = write(tmp_path / "l.csv", "slide,label\na.b.svs,one\nc,two\n")
    joined, report = join_labels(entries, str(labels))
    assert [e.label for e in joined] == ["one", "two"] and not report.unmatched_rows


def test_labels_match_names_in_either_unicode_form(tmp_path: Path) -> None:
    """A file copied from a Mac is named in NFD (u + combining diaeresis), a CSV typed
    elsewhere in NFC: they matched nothing, and the warning showed the same 'scan ü' twice."""
    nfd, nfc = unicodedata.normalize("NFD", "scan ü"), unicodedata.normalize("NFC", "scan ü")
    assert nfd != nfc
    entries = discover([write(tmp_path / f"{nfd}.svs", "x"), write(tmp_path / f"{nfd} 2.svs", "x")])
    labels = write(tmp_path / "l.csv", f"path,slide,label\n,{nfc},one\n{nfc} 2.svs,,two\n")
    joined, report = join_labels(entries, str(labels))
    assert [e.label for e in joined] == ["one", "two"]
    assert not report.unmatched_rows and not report.unlabelled_slides


@pytest.mark.parametrize(
    ("header", "unknown", "meant"),
    [
        ("path,lable,splt", "lable", "label"),
        ("path,label,splt", "splt", "split"),
        ("path,Label,MPP,anotations", "anotations", "annotations"),
    ],
)
def test_misspelt_manifest_columns_are_an_error(
    tmp_path: Path, header: str, unknown: str, meant: str
) -> None:
    # a misspelt column used to be ignored: every slide indexed unlabelled, without a word
    row = ",".join(["a.svs"] + ["1"] * header.count(","))
    manifest = write(tmp_path / "m.csv", f"{header}\n{row}\n")
    expected = f"unknown column {unknown!r} \\(did you mean {meant!r}"
    with pytest.raises(InputError, match=expected) as info:
        read_manifest(str(manifest))
    assert info.value.path == str(manifest)


def test_other_manifest_columns_are_kept_out_of_the_way(tmp_path: Path) -> None:
    # columns of a spreadsheet's own (notes) are no typo of a manifest column; a patient id
    # is the slide's patient
    manifest = write(tmp_path / "m.csv", "path,label,patient_id,notes\na.svs,tumor,P1,fine\n")
    (entry,) = read_manifest(str(manifest))
    assert entry.label == "tumor" and entry.patient == "P1"


def test_misspelt_labels_columns_name_the_close_column(tmp_path: Path) -> None:
    labels = write(tmp_path / "labels.csv", "slide,label,splt\na,tumor,train\n")
    with pytest.raises(InputError, match="unknown column 'splt' \\(did you mean 'split'") as info:
        join_labels([], str(labels))
    assert info.value.path == str(labels)
