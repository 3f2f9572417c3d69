from __future__ import annotations

from pathlib import Path

import pytest

from wsi_loader.errors import InputError
from wsi_loader.index.inputs import discover, fingerprint, join_labels, read_manifest


def write(path: Path, text: str) -> Path:
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
