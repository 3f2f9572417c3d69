from __future__ import annotations

import csv
import gc
import hashlib
import io
import json
import tarfile
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image

from tests.conftest import corrupt_rows
from wsi_loader.cli import main
from wsi_loader.dataset import TileDataset, _cores
from wsi_loader.errors import ConfigError, UnitsNotDoneError, UnitTimeoutError, WorkerDiedError
from wsi_loader.export import _folder, export_index, label_folders
from wsi_loader.export import _running as running_module
from wsi_loader.export import _unit as unit_module
from wsi_loader.export import _webdataset as webdataset_module
from wsi_loader.index import SlideIndex, build_index
from wsi_loader.index._naming import safe_component


def manifest(out: Path, name: str = "manifest.csv") -> list[dict[str, str]]:
    with open(out / name, newline="") as fh:
        return list(csv.DictReader(fh))


def test_imagefolder_layout_manifest_and_failures(index: SlideIndex, tmp_path: Path) -> None:
    bad = corrupt_rows(index)
    TileDataset(index).__getitems__(bad[:2].tolist())  # two quarantined before the export
    out = tmp_path / "out"
    report = export_index(index, out, format="imagefolder", image_format="png", shard_size=50)
    assert report.quarantined == 2 and report.failed == len(bad) - 2
    assert report.tiles == len(index) - len(bad)
    assert sorted(p.name for p in out.iterdir() if p.is_dir() and not p.name.startswith(".")) == [
        "normal",
        "tumour",
    ]
    rows = manifest(out)
    assert len(rows) == report.tiles
    ds = TileDataset(index, record_failures=False)
    for entry in rows[:: max(1, len(rows) // 8)]:
        path = out / entry["file"]
        assert hashlib.sha256(path.read_bytes()).hexdigest() == entry["sha256"]
        assert path.parent.name == entry["label"]
        assert f"_x{entry['x']}_y{entry['y']}." in path.name
        with Image.open(path) as image:  # lossless: exactly the dataset's pixels
            pixels = np.asarray(image.convert("RGB"))
        expected = ds[int(entry["row"])]["image"].permute(1, 2, 0).numpy()
        np.testing.assert_array_equal(pixels, expected)
    failures = manifest(out, "failures.csv")
    assert sorted(int(f["row"]) for f in failures) == sorted(bad.tolist())
    reasons = {f["reason"].split(":")[0] for f in failures}
    assert reasons == {"quarantined before export", "read failed"}
    summary = json.loads((out / "export.json").read_text())
    assert summary["settings"]["index"] == str(index.path.resolve())


@pytest.mark.parametrize("image_format", ["png", "webp"])
def test_threads_write_the_same_export(
    index: SlideIndex, tmp_path: Path, image_format: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A local export reads and encodes on usable cores / workers threads; the files, the
    manifest and the failures are those of a one-thread export."""
    real_unit, real_encode = running_module.export_unit, unit_module._encode
    unit_threads: list[int] = []
    encoders: list[str] = []

    def unit_spy(unit: unit_module.ExportUnit) -> dict[str, Any]:
        unit_threads.append(unit.threads)
        return real_unit(unit)

    def encode_spy(pixels: np.ndarray, options: unit_module.ExportOptions) -> bytes:
        encoders.append(threading.current_thread().name)
        return real_encode(pixels, options)

    monkeypatch.setattr(running_module, "export_unit", unit_spy)
    monkeypatch.setattr(unit_module, "_encode", encode_spy)
    outputs = {}
    for cores in (1, 3):
        monkeypatch.setattr(_cores, "usable_cores", lambda cores=cores: cores)
        unit_threads.clear()
        encoders.clear()
        (index.path / "quarantine.jsonl").unlink(missing_ok=True)  # the same start for both
        outputs[cores] = tmp_path / f"out-{cores}"
        report = export_index(index, outputs[cores], image_format=image_format, shard_size=40)
        assert set(unit_threads) == {cores}
        in_threads = sum(name.startswith("wsi-encode") for name in encoders)
        assert in_threads == (report.tiles if cores > 1 else 0)
    assert manifest(outputs[1]) == manifest(outputs[3])
    assert manifest(outputs[1], "failures.csv") == manifest(outputs[3], "failures.csv")
    assert not any(t.name.startswith("wsi-encode") for t in threading.enumerate())


@pytest.mark.filterwarnings("ignore::ResourceWarning")
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_webdataset_shards_are_read_by_tarfile_and_webdataset(
    index: SlideIndex, tmp_path: Path
) -> None:
    out = tmp_path / "wds"
    report = export_index(
        index, out, format="webdataset", image_format="jpeg", quality=85, shard_size=40
    )
    shards = sorted(out.glob("shard-*.tar"))
    assert len(shards) == len(report.shards) == -(-(len(index)) // 40)
    assert all(s["tiles"] <= 40 for s in report.shards)
    with tarfile.open(shards[0]) as tar:
        names = tar.getnames()
        assert names[0].endswith(".jpg") and names[1].endswith(".json")
        meta = json.loads(tar.extractfile(names[1]).read())  # type: ignore[union-attr]
        assert {"slide", "x", "y", "level", "mpp", "label"} <= meta.keys()
    import webdataset as wds

    samples = list(wds.WebDataset([str(s) for s in shards], shardshuffle=False))
    ok_rows = {int(r["row"]) for r in manifest(out)}
    assert len(samples) == len(ok_rows)
    first = samples[0]
    assert {"__key__", "jpg", "json"} <= first.keys()
    with Image.open(io.BytesIO(first["jpg"])) as image:
        assert image.size == (256, 256)
    assert json.loads(first["json"])["row"] in ok_rows
    del samples, first
    gc.collect()  # the webdataset library leaves its shard files to the garbage collector


def test_resume_writes_only_what_is_missing(
    archive: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    index = build_index([archive / "good.svs"], tmp_path / "idx", level=0, min_tissue=0)
    out = tmp_path / "out"
    real = running_module.export_unit
    calls: list[int] = []

    def dies_on_third(unit: unit_module.ExportUnit) -> dict:  # type: ignore[type-arg]
        calls.append(unit.number)
        if len(calls) == 3:
            (out / f".shard-{unit.number:06d}.tar.tmp-999").write_bytes(b"half")  # a torn write
            raise KeyboardInterrupt("killed")
        return real(unit)

    monkeypatch.setattr(running_module, "export_unit", dies_on_third)
    with pytest.raises(KeyboardInterrupt):
        export_index(index, out, format="webdataset", shard_size=30)
    first = {p.name: p.stat().st_mtime_ns for p in out.glob("shard-*.tar")}
    assert len(first) == 2 and not (out / "manifest.csv").exists()
    calls.clear()
    monkeypatch.setattr(running_module, "export_unit", lambda u: calls.append(u.number) or real(u))
    report = export_index(index, out, format="webdataset", shard_size=30)
    assert report.units_skipped == 2 and sorted(calls) == list(range(2, report.units))
    assert {
        p.name: p.stat().st_mtime_ns for p in out.glob("shard-*.tar") if p.name in first
    } == first
    assert not list(out.glob(".*.tmp-*"))
    reference = export_index(index, tmp_path / "clean", format="webdataset", shard_size=30)
    for shard in reference.shards:  # deterministic: same bytes as an uninterrupted run
        assert (out / shard["file"]).read_bytes() == (
            tmp_path / "clean" / shard["file"]
        ).read_bytes()


# In the export's worker processes: the worker of unit 1 is killed as the kernel's
# out-of-memory killer kills (SIGKILL)
UNIT_1_KILLS_ITS_WORKER = """
import os, signal
import wsi_loader.export._unit as export

_export_unit = export.export_unit

def export_unit(unit):
    if unit.number == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    return _export_unit(unit)

export.export_unit = export_unit
"""


def test_a_unit_whose_worker_dies_is_said_and_the_others_are_finished(
    archive: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    hook_workers: Callable[[str], None],
) -> None:
    """A dead export worker (out of memory) ended the export with BrokenProcessPool (a
    traceback from the command); now the other units finish, the error names the unit and
    how its worker ended, and a rerun exports only that unit."""
    index = build_index([archive / "good.svs"], tmp_path / "idx", level=0, min_tissue=0)
    out = tmp_path / "out"
    hook_workers(UNIT_1_KILLS_ITS_WORKER)
    with pytest.raises(WorkerDiedError, match=r"unit 1 .*killed by SIGKILL") as info:
        export_index(index, out, format="webdataset", shard_size=30, workers=2)
    assert info.value.units == [1]
    assert "run the same export again" in str(info.value)
    finished = sorted(p.name for p in out.glob("shard-*.tar"))
    assert "shard-000001.tar" not in finished and len(finished) >= 2
    monkeypatch.delenv("PYTHONPATH")
    report = export_index(index, out, format="webdataset", shard_size=30, workers=2)
    assert report.units_skipped == report.units - 1
    assert report.tiles == len(index)


# In the export's worker processes: unit 1 hangs, as a read from a mount that stopped
# answering does
UNIT_1_HANGS = """
import time
import wsi_loader.export._unit as export

_export_unit = export.export_unit

def export_unit(unit):
    if unit.number == 1:
        time.sleep(3600)
    return _export_unit(unit)

export.export_unit = export_unit
"""


@pytest.mark.parametrize("workers", [1, 2])
def test_a_unit_that_hangs_is_given_up_after_unit_timeout_and_the_others_are_finished(
    archive: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    hook_workers: Callable[[str], None],
    workers: int,
) -> None:
    """A unit whose reads hang (a mount that stopped answering) kept the export waiting
    forever; with unit_timeout it is given up, the other units finish, the error names it,
    and the same export again does only that unit."""
    index = build_index([archive / "good.svs"], tmp_path / "idx", level=0, min_tissue=0)
    out = tmp_path / "out"
    hook_workers(UNIT_1_HANGS)
    # 30 s: unit 1 hangs for good, and a good unit must not come near it on a busy machine
    with pytest.raises(UnitTimeoutError, match=r"unit 1 was not done after 30 s") as info:
        export_index(
            index, out, format="webdataset", shard_size=30, workers=workers, unit_timeout=30
        )
    assert info.value.units == [1] and isinstance(info.value, UnitsNotDoneError)
    assert "run the same export again" in str(info.value)
    finished = sorted(p.name for p in out.glob("shard-*.tar"))
    assert "shard-000001.tar" not in finished and len(finished) >= 2
    monkeypatch.delenv("PYTHONPATH")
    report = export_index(index, out, format="webdataset", shard_size=30, unit_timeout=30)
    assert report.units_skipped == report.units - 1
    assert report.tiles == len(index)


def test_unit_timeout_is_a_flag_and_needs_local_workers(
    index: SlideIndex, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import concurrent.futures as cf

    with cf.ThreadPoolExecutor(1) as pool, pytest.raises(ConfigError, match="unit_timeout"):
        export_index(index, tmp_path / "a", executor=pool, unit_timeout=5)
    with pytest.raises(ConfigError, match="unit_timeout"):
        export_index(index, tmp_path / "b", unit_timeout=-1)
    code = main(["export", str(index.path), "--out", str(tmp_path / "c"), "--unit-timeout", "60",
                 "--format", "webdataset", "--no-progress"])  # fmt: skip
    assert code == 0
    settings = json.loads((tmp_path / "c" / "export.json").read_text())["settings"]
    assert "unit_timeout" not in settings  # how long a unit may take is not what it holds


def test_different_arguments_into_existing_export_is_an_error(
    index: SlideIndex, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    export_index(index, out, shard_size=100)
    with pytest.raises(ConfigError, match="different arguments \\(image_format\\)"):
        export_index(index, out, shard_size=100, image_format="jpeg")
    other = tmp_path / "busy"
    other.mkdir()
    (other / "x.txt").write_text("mine")
    with pytest.raises(ConfigError, match="not empty and holds no export"):
        export_index(index, other)
    with pytest.raises(ConfigError, match="format"):
        export_index(index, tmp_path / "n", format="zip")


def test_hostile_labels_stay_inside(archive: Path, tmp_path: Path) -> None:
    labels = tmp_path / "labels.csv"
    labels.write_text('slide,label\ngood,../../escape\nbad,"a/b\\\\c"\n')
    index = build_index([archive], tmp_path / "idx", level=0, min_tissue=0.9, labels=str(labels))
    out = tmp_path / "out"
    export_index(index, out)
    written = [p for p in tmp_path.rglob("*.png")]
    assert written and all(out in p.parents for p in written)
    assert not (tmp_path / "escape").exists()
    assert safe_component("../../x") == "_.._x" and safe_component("..") == "_"
    assert safe_component("") == "_" and safe_component("a\\b/c") == "a_b_c"
    folders = label_folders(["a/b", "a_b", None, "unlabelled"])
    assert len(set(folders.values())) == 3 and None not in folders  # no label: no folder


def test_label_folders_sort_as_the_labels_do() -> None:
    # torchvision's ImageFolder numbers classes by sorted folder name; sanitising can reorder
    # them ("Tumor: Positive" < "Tumor_A", but "Tumor_A" < "Tumor_Positive"), which would
    # silently swap the ids of QuPath's derived classes against the index's label ids
    labels = ["Tumor: Positive", "Tumor_A", "Stroma", "Tumor: Negative"]
    folders = label_folders([*labels, None])
    assert sorted(labels, key=lambda lb: folders[lb]) == sorted(labels)
    assert all(folders[lb] == safe_component(folders[lb]) for lb in labels)  # still safe
    plain = label_folders(["Tumor", "Stroma", None])  # in order already: names untouched
    assert plain == {"Stroma": "Stroma", "Tumor": "Tumor"}


def test_label_folders_keep_the_index_order_of_numeric_labels() -> None:
    # the index numbers '2' before '10'; ImageFolder sorts the folder '10' first
    folders = label_folders(["10", "2", None])
    assert sorted(["2", "10"], key=lambda lb: folders[lb]) == ["2", "10"]
    # an index built before numeric order keeps its own ('10' before '2')
    old = label_folders(["10", "2", None], order=["10", "2"])
    assert old == {"10": "10", "2": "2"}


def test_cli_export(index: SlideIndex, tmp_path: Path) -> None:
    out = tmp_path / "cli"
    assert (
        main(
            [
                "export",
                str(index.path),
                "--out",
                str(out),
                "--format",
                "webdataset",
                "--shard-size",
                "64",
                "--workers",
                "2",
                "--no-progress",
            ]
        )
        == 0
    )
    assert len(list(out.glob("shard-*.tar"))) == -(-len(index) // 64)
    assert main(["export", str(index.path), "--out", str(out), "--format", "imagefolder"]) == 2


def test_cli_export_reads_the_config_section(index: SlideIndex, tmp_path: Path) -> None:
    config = tmp_path / "c.yaml"
    config.write_text("export:\n  format: webdataset\n  shard_size: 500\n  image_format: jpeg\n")
    out = tmp_path / "cfg"
    assert (
        main(
            [
                "export",
                str(index.path),
                "--out",
                str(out),
                "--config",
                str(config),
                "--shard-size",
                "100",
            ]
        )
        == 0
    )
    settings = json.loads((out / "export.json").read_text())["settings"]
    assert (settings["format"], settings["shard_size"], settings["image_format"]) == (
        "webdataset",
        100,
        "jpeg",
    )
    bad = tmp_path / "bad.yaml"
    bad.write_text("export:\n  shards: 3\n")
    assert (
        main(["export", str(index.path), "--out", str(tmp_path / "x"), "--config", str(bad)]) == 2
    )


def test_a_unit_is_complete_only_after_its_shard_is_written(
    archive: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    index = build_index([archive / "good.svs"], tmp_path / "idx", level=0, min_tissue=0)
    out = tmp_path / "out"
    real = webdataset_module.write_file

    def dies_writing_a_shard(path: Path, data: bytes, tmp: Path | None = None) -> None:
        if path.name.endswith(".tar"):
            raise KeyboardInterrupt("killed while writing the shard")
        real(path, data, tmp)

    monkeypatch.setattr(webdataset_module, "write_file", dies_writing_a_shard)
    with pytest.raises(KeyboardInterrupt):
        export_index(index, out, format="webdataset", shard_size=30)
    assert not _folder.part_records(out)  # nothing marked done
    monkeypatch.undo()
    report = export_index(index, out, format="webdataset", shard_size=30)
    assert report.units_skipped == 0 and report.tiles == len(index)
    assert all((out / s["file"]).exists() for s in report.shards)


def test_a_resumed_export_keeps_its_first_plan(
    archive: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    labels = str(archive / "labels.csv")
    index = build_index(
        [archive / "good.svs"], tmp_path / "i", level=0, min_tissue=0, labels=labels
    )
    out = tmp_path / "out"
    real = running_module.export_unit
    calls: list[int] = []

    def dies_on_second(unit: unit_module.ExportUnit) -> dict:  # type: ignore[type-arg]
        calls.append(unit.number)
        if len(calls) == 2:
            raise KeyboardInterrupt("killed")
        return real(unit)

    monkeypatch.setattr(running_module, "export_unit", dies_on_second)
    with pytest.raises(KeyboardInterrupt):
        export_index(index, out, format="imagefolder", shard_size=20)
    monkeypatch.undo()
    # a tile of the finished first unit is quarantined in the meantime
    row = 3
    index.quarantine.append(
        {
            "slide_id": 0,
            "path": index.slides[0].path,
            "x": int(index.columns["l0_x"][row]),
            "y": int(index.columns["l0_y"][row]),
            "error": "found later",
        }
    )
    report = export_index(index, out, format="imagefolder", shard_size=20)
    with open(out / "manifest.csv", newline="") as fh:
        rows = [int(r["row"]) for r in csv.DictReader(fh)]
    # the plan of the first run: every row once, units unchanged, nothing shifted or lost
    assert sorted(rows) == list(range(len(index))) and report.quarantined == 0


def test_failures_csv_carries_the_quarantine_reason(index: SlideIndex, tmp_path: Path) -> None:
    TileDataset(index).__getitems__(corrupt_rows(index).tolist())
    export_index(index, tmp_path / "out", shard_size=50)
    with open(tmp_path / "out" / "failures.csv", newline="") as fh:
        reasons = [r["reason"] for r in csv.DictReader(fh)]
    assert len(reasons) == 4
    assert all(r.startswith("quarantined before export: ") and len(r) > 30 for r in reasons)
    assert all(
        "Jpeg" in r or "JPEG" in r or "marker" in r or "corrupt" in r.lower() for r in reasons
    ), reasons


def test_failures_csv_reason_is_the_record_of_that_tile(index: SlideIndex, tmp_path: Path) -> None:
    """A quarantine shared with another index (another level) or kept from an older version of
    the slide holds records at the same position: the reason is the one of this tile."""
    row = 3
    slide = index.slides[int(index.columns["slide_id"][row])]
    at = {
        "slide_id": 0,
        "path": slide.path,
        "x": int(index.columns["l0_x"][row]),
        "y": int(index.columns["l0_y"][row]),
    }
    level = int(index.columns["level"][row])
    index.quarantine.append({**at, "level": level, "error": "this tile", **fingerprint(slide)})
    index.quarantine.append({**at, "level": level + 1, "error": "another level"})
    index.quarantine.append({**at, "level": level, "error": "old version", "fingerprint": "x"})
    export_index(index, tmp_path / "out", shard_size=50)
    reasons = {int(r["row"]): r["reason"] for r in manifest(tmp_path / "out", "failures.csv")}
    assert reasons[row] == "quarantined before export: this tile"


def fingerprint(slide: Any) -> dict[str, str]:
    return {"fingerprint": slide.fingerprint} if slide.fingerprint else {}


@pytest.fixture
def half_labelled(archive: Path, tmp_path: Path) -> SlideIndex:
    """The archive with a label for good.svs only: bad.svs's tiles have none."""
    labels = tmp_path / "half.csv"
    labels.write_text("slide,label\ngood,normal\n")
    return build_index([archive], tmp_path / "half", level=0, min_tissue=0.0, labels=str(labels))


def test_unlabelled_tiles_are_left_out_of_image_folders_and_counted(
    half_labelled: SlideIndex,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    # an "unlabelled" folder is one more class to torchvision's ImageFolder and to Hugging
    # Face's ClassLabel: tiles without a label train as a class of their own
    index = half_labelled
    unlabelled = int((index.tile_labels() < 0).sum())
    assert 0 < unlabelled < len(index)
    out = tmp_path / "out"
    report = export_index(index, out, shard_size=50)
    assert report.unlabelled == unlabelled and report.tiles == len(index) - unlabelled
    assert report.failed == 0
    assert sorted(p.name for p in out.iterdir() if p.is_dir()) == ["normal"]
    assert f"{unlabelled} tiles have no label" in caplog.text
    left_out = [f for f in manifest(out, "failures.csv") if f["reason"].startswith("no label")]
    assert len(left_out) == unlabelled
    assert json.loads((out / "export.json").read_text())["unlabelled"] == unlabelled
    cli_out = tmp_path / "cli"
    assert main(["export", str(index.path), "--out", str(cli_out), "--no-progress"]) == 0
    said = capsys.readouterr().err
    assert f"{unlabelled} without a label left out" in said, said


def test_unlabelled_tiles_are_kept_outside_the_class_folders_on_request(
    half_labelled: SlideIndex, tmp_path: Path
) -> None:
    index = half_labelled
    unlabelled = int((index.tile_labels() < 0).sum())
    out, kept = tmp_path / "out", tmp_path / "unlabelled tiles"
    report = export_index(index, out, shard_size=50, unlabelled_out=kept)
    # (bad.svs, the slide without a label, has tiles that fail)
    assert report.unlabelled == 0 and report.tiles + report.failed == len(index)
    assert sorted(p.name for p in out.iterdir() if p.is_dir()) == ["normal"]
    assert len(list(kept.glob("*.png"))) == unlabelled - report.failed
    rows = [r for r in manifest(out) if r["label"] == ""]
    assert len(rows) == unlabelled - report.failed
    assert all((out / r["file"]).resolve().parent == kept.resolve() for r in rows)
    # a resume trusts them as it trusts the class folders; --overwrite removes them
    again = export_index(index, out, shard_size=50, unlabelled_out=kept)
    assert again.units_skipped == again.units
    victim = next(kept.glob("*.png"))
    victim.unlink()
    assert export_index(index, out, shard_size=50, unlabelled_out=kept).units_skipped < again.units
    assert victim.exists()
    with pytest.raises(ConfigError, match="unlabelled_out"):
        export_index(index, out, shard_size=50)  # another argument: refused, as any other
    export_index(index, out, shard_size=50, overwrite=True)
    assert not kept.exists()
    cli = [
        "export",
        str(index.path),
        "--out",
        str(tmp_path / "cli"),
        "--no-progress",
        "--unlabelled-out",
    ]
    assert main([*cli, str(tmp_path / "cli-unlabelled")]) == 0
    assert len(list((tmp_path / "cli-unlabelled").glob("*.png"))) == unlabelled - report.failed


def test_unlabelled_out_must_be_outside_the_class_folders(
    half_labelled: SlideIndex, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    with pytest.raises(ConfigError, match="class"):
        export_index(half_labelled, out, unlabelled_out=out / "unlabelled")
    with pytest.raises(ConfigError, match="imagefolder"):
        export_index(half_labelled, out, format="webdataset", unlabelled_out=tmp_path / "u")
    assert not out.exists()


def test_an_index_without_labels_is_refused_for_image_folders(
    archive: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # nothing would be exported: said before anything is read or written
    index = build_index([archive / "good.svs"], tmp_path / "idx", level=0, min_tissue=0.0)
    out = tmp_path / "out"
    with pytest.raises(ConfigError, match=r"none of the \d+ tiles .* has a label"):
        export_index(index, out)
    assert not out.exists()
    assert main(["export", str(index.path), "--out", str(out), "--no-progress"]) == 2
    assert "--unlabelled-out DIR" in capsys.readouterr().err
    kept = tmp_path / "tiles"
    assert export_index(index, out, unlabelled_out=kept).tiles == len(index)
    assert len(list(kept.iterdir())) == len(index)


def test_an_export_of_an_older_layout_is_refused_with_that_reason(
    index: SlideIndex, tmp_path: Path
) -> None:
    # version 2 named files after their slide and kept an unlabelled/ folder: resuming it
    # would mix both layouts
    out = tmp_path / "out"
    export_index(index, out, shard_size=50)
    settings = out / _folder.SETTINGS_FILE
    old = json.loads(settings.read_text())
    settings.write_text(json.dumps({**old, "version": 2}))
    with pytest.raises(ConfigError, match="another version of wsi_loader"):
        export_index(index, out, shard_size=50)
    assert export_index(index, out, shard_size=50, overwrite=True).tiles > 0


def test_a_flat_export_resumed_after_the_index_got_splits_says_what_changed(
    index: SlideIndex, tmp_path: Path
) -> None:
    """An image-folder export begun flat, resumed once the index has splits (which lay the
    folders out by split): refused, naming the layout by split and what to do."""
    from wsi_loader.index._splits import SplitPlan, write_splits

    out = tmp_path / "out"
    export_index(index, out, format="imagefolder", image_format="png", shard_size=50)
    split = write_splits(index.path, SplitPlan(by="slide", stratify=None, test=0, val=0.5), False)
    with pytest.raises(ConfigError) as caught:
        export_index(split, out, format="imagefolder", image_format="png", shard_size=50)
    said = str(caught.value)
    assert "()" not in said and "split_folders" in said
    assert "by split" in said and "--split" in said and "--overwrite" in said


def test_an_export_into_a_folder_another_export_is_writing_is_refused(
    index: SlideIndex, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two exports at once into one folder were not kept apart: a second one with --overwrite
    cleared the first's finished shards mid-run, and the first then ended with exit 0 and an
    export missing most of its tiles (380 of 1,330 in the trial)."""
    started, release = threading.Event(), threading.Event()
    real_unit = running_module.export_unit

    def paused_unit(unit: Any) -> Any:
        if not started.is_set():
            started.set()
            release.wait(600)
        return real_unit(unit)

    monkeypatch.setattr(running_module, "export_unit", paused_unit)
    out = tmp_path / "out"
    first: list[Any] = []
    thread = threading.Thread(
        target=lambda: first.append(export_index(index, out, format="webdataset", shard_size=8))
    )
    thread.start()
    try:
        assert started.wait(600)
        for overwrite in (False, True):
            with pytest.raises(ConfigError, match="another export is writing"):
                export_index(index, out, format="webdataset", shard_size=8, overwrite=overwrite)
    finally:
        release.set()
        thread.join()
    assert first and first[0].tiles + first[0].failed == len(index)  # (bad.svs's corrupt tiles)
    with open(out / "manifest.csv", newline="") as fh:
        assert len(list(csv.DictReader(fh))) == first[0].tiles
    again = export_index(index, out, format="webdataset", shard_size=8)  # the lock was let go
    assert again.units_skipped == again.units
