"""The quarantine file: records appended under a lock, validated when read, matched by tile."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest

from wsi_loader import SlideIndex, build_index
from wsi_loader.cli.main import main
from wsi_loader.index import _quarantine as quarantine_module
from wsi_loader.index._quarantine import Quarantine


def _tile(x: int) -> dict[str, object]:
    return {"slide_id": 0, "path": "a.svs", "x": x, "y": 0, "level": 0, "error": "bad"}


def test_an_append_during_a_rewrite_is_not_lost(tmp_path: Path) -> None:
    """`rewrite` (quarantine --clear / --retry) replaces the file under the writers' lock; a
    worker appending meanwhile waits for it, so its record lands in the new file. Without the
    lock it went to the replaced file and was lost (a mutant the other tests let live)."""
    q = Quarantine(tmp_path / "quarantine.jsonl")
    q.append(_tile(1))
    writer = threading.Thread(target=lambda: Quarantine(q.path).append(_tile(2)))

    def keep(record: dict[str, object]) -> bool:
        if writer.ident is None:  # the file is read, not yet replaced
            writer.start()
            writer.join(timeout=1.0)  # it waits for the lock (or, without one, appends now)
        return False

    assert q.rewrite(keep) == (0, 1)
    writer.join(timeout=120)
    assert [r["x"] for r in q.read()] == [2]


def test_a_quarantined_tile_leaves_out_only_its_own_level(small_svs: Path, tmp_path: Path) -> None:
    """A level-0 tile at (0, 0) that failed says nothing about the level-1 tile at (0, 0):
    a rebuild at level 1 keeps it (it dropped it: 15 of 16 kept)."""
    out = tmp_path / "idx"
    index = build_index([small_svs], out, tile_size=256, level=0, min_tissue=0.0)
    first = {"x": 0, "y": 0, "path": index.slides[0].path, "error": "boom"}
    index.quarantine.append({**first, "slide_id": 0, "level": 0})
    at_level_0 = build_index([small_svs], out, tile_size=256, level=0, min_tissue=0.0)
    assert at_level_0.slides[0].excluded == 1
    fresh = build_index([small_svs], tmp_path / "fresh", tile_size=256, level=1, min_tissue=0.0)
    rebuilt = build_index([small_svs], out, tile_size=256, level=1, min_tissue=0.0)
    assert len(rebuilt) == len(fresh) and rebuilt.slides[0].excluded == 0
    assert len(SlideIndex.open(out, exclude_quarantined=True)) == len(fresh)
    # a record at level 1 leaves that tile out, of the index opened and of a rebuild
    index.quarantine.append({**first, "slide_id": 0, "level": 1})
    assert len(SlideIndex.open(out, exclude_quarantined=True)) == len(fresh) - 1
    assert (
        build_index([small_svs], out, tile_size=256, level=1, min_tissue=0.0).slides[0].excluded
        == 1
    )


def test_a_record_without_a_level_leaves_out_the_tile_at_every_level(
    small_svs: Path, tmp_path: Path
) -> None:
    """Records written before levels were recorded (and by the device decoder, which knows no
    level) say no level: they exclude their (x, y) at any level, as they always did."""
    out = tmp_path / "idx"
    index = build_index([small_svs], out, tile_size=256, level=1, min_tissue=0.0)
    index.quarantine.append({"slide_id": 0, "path": index.slides[0].path, "x": 0, "y": 0})
    assert len(SlideIndex.open(out, exclude_quarantined=True)) == len(index) - 1


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("level", -5),
        ("level", 1e300),
        ("level", "1"),
        ("level", True),
        ("level", 2**15),
        ("x", 2.5),
        ("fingerprint", 7),
        ("error", ["not", "text"]),
        ("time", {"a": 1}),
        ("pid", "12"),
        ("slide_id", -1),
        ("row", 1.5),
        ("kind", "tiles"),
    ],
)
def test_a_record_with_a_bad_field_is_skipped_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, field: str, value: object
) -> None:
    q = Quarantine(tmp_path / "quarantine.jsonl")
    q.append(_tile(1))
    lines = [json.dumps({**_tile(2), "kind": "tile", field: value}), json.dumps(_tile(3))]
    with open(q.path, "a") as fh:
        fh.write("\n".join(lines) + "\n")
    assert [r["x"] for r in q.read()] == [1, 3]
    assert "quarantine.jsonl:2: skipping an invalid quarantine record" in caplog.text
    assert f"({field}:" in caplog.text  # the message names the field at fault


@pytest.mark.parametrize("level", [-5, 1e300, "1", 7])
def test_retry_survives_records_with_a_bad_level(
    small_svs: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], level: object
) -> None:
    """`quarantine --retry` crashed with an IndexError on these (-5, 1e300; 7: a level the
    slide does not have); the invalid ones are dropped (a rewrite keeps valid records only),
    one at a level the slide lacks is kept as still failing, and the command ends normally."""
    out = tmp_path / "idx"
    index = build_index([small_svs], out, tile_size=256, level=0, min_tissue=0.0)
    record = {
        "kind": "tile",
        "path": index.slides[0].path,
        "fingerprint": index.slides[0].fingerprint,
        "x": 0,
        "y": 0,
        "level": level,
        "error": "boom",
    }
    (out / "quarantine.jsonl").write_text(json.dumps(record) + "\n")
    assert main(["quarantine", str(out), "--retry"]) == 0
    left = Quarantine(out / "quarantine.jsonl").read()
    assert [r["level"] for r in left] == ([7] if level == 7 else [])
    assert "Traceback" not in capsys.readouterr().err


def test_slide_records_are_checked_against_the_file_in_linear_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`append_slide` skips a slide already recorded by another worker. It parsed the whole
    file for every record: 1,000 / 2,000 / 4,000 slide faults took 6 / 27 / 101 s. Now each
    call reads only what was appended since the last (lines parsed: about one per record),
    and still sees the records other processes (other Quarantine objects) append."""
    parsed = []
    real_loads = json.loads
    monkeypatch.setattr(
        quarantine_module.json, "loads", lambda *a, **k: parsed.append(1) or real_loads(*a, **k)
    )
    q = Quarantine(tmp_path / "quarantine.jsonl")
    other = Quarantine(q.path)
    count = 400
    for i in range(count):
        record = {"path": f"s{i}.svs", "fingerprint": "f", "error": "gone"}
        assert q.append_slide(record)
        assert not q.append_slide(record)
        assert not other.append_slide(record)  # another worker's object sees it
    assert len(parsed) <= 3 * count  # each line parsed by each of the two objects, once
    assert len(q.slide_records()) == count
    # a rewrite (quarantine --clear) replaces the file: the next call reads it afresh
    q.rewrite(lambda r: r["path"] != "s0.svs")
    assert q.append_slide({"path": "s0.svs", "fingerprint": "f", "error": "gone"})
    assert not q.append_slide({"path": "s1.svs", "fingerprint": "f", "error": "gone"})
