"""`wsi-loader split`: patients dealt to train/val/test or k folds, run as a user runs it."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

from tests.conftest import SlideFactory
from wsi_loader import SlideIndex, build_index


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "wsi_loader.cli", *args]
    return subprocess.run(command, capture_output=True, text=True, check=False)


def _index(tmp_path: Path, make_slide: SlideFactory, unlabelled: bool = False) -> Path:
    """Six slides of three patients (two each, labels a, a, b), from a manifest."""
    folder = tmp_path / "slides"
    folder.mkdir()
    rows = ["path,label,patient"]
    for i in range(6):
        name = f"s{i}.svs"
        shutil.copy(make_slide(width=512, height=512, seed=70 + i), folder / name)
        label = "" if unlabelled and i == 5 else "ab"[i // 4]
        rows.append(f"{name},{label},P{i // 2}")
    (folder / "manifest.csv").write_text("\n".join(rows) + "\n")
    out = tmp_path / "idx"
    build_index([folder / "manifest.csv"], out, tile_size=128, level=0, min_tissue=0.0)
    return out


def _splits(out: Path) -> dict[str, str | None]:
    return {Path(s.path).name: s.split for s in SlideIndex.open(out).slides}


def test_split_writes_folds_every_command_selects(tmp_path: Path, make_slide: SlideFactory) -> None:
    out = _index(tmp_path, make_slide)
    args = ["split", str(out), "--folds", "3", "--by", "patient", "--test", "0"]
    done = cli(*args, "--stratify", "label", "--seed", "7")
    assert done.returncode == 0, done.stderr
    for k in (1, 2, 3):
        assert f"fold{k}: 1 patients, 2 slides" in done.stdout
    assert "--split foldN:train" in done.stderr
    first = _splits(out)
    for i in range(0, 6, 2):  # a patient's two slides in one fold
        assert first[f"s{i}.svs"] == first[f"s{i + 1}.svs"]
    # splits there already, every slide in one: nothing to assign, the index unchanged;
    # another plan is refused; the same seed gives the same folds
    generation = SlideIndex.open(out).meta["generation"]
    again = cli(*args, "--seed", "7")
    assert again.returncode == 0 and "nothing assigned" in again.stderr, again.stderr
    assert SlideIndex.open(out).meta["generation"] == generation
    refused = cli(*args, "--stratify", "none")
    assert refused.returncode == 2 and "--overwrite" in refused.stderr
    assert "stratify label" in refused.stderr and "Traceback" not in refused.stderr
    assert cli(*args, "--stratify", "label", "--seed", "7", "--overwrite").returncode == 0
    assert _splits(out) == first
    shown = cli("info", str(out), "--split", "fold2:train", "--json")
    assert shown.returncode == 0, shown.stderr
    summary = json.loads(shown.stdout)
    assert summary["split"] == "fold2:train"
    in_fold2 = {n for n, s in first.items() if s == "fold2"}
    assert {s["slide_id"] for s in summary["slides"] if s["tiles"]} == {
        i for i, name in enumerate(sorted(first)) if name not in in_fold2
    }
    counted = json.loads(cli("split", str(out), "--overwrite", "--json").stdout)
    assert set(counted["splits"]) == {"train", "val", "test"}
    assert sum(e["patients"] for e in counted["splits"].values()) == 3


def test_split_errors_are_said_in_one_line(tmp_path: Path, make_slide: SlideFactory) -> None:
    out = _index(tmp_path, make_slide, unlabelled=True)
    cases = {
        ("--folds", "5"): "--folds 5 needs at least 5 patients outside the test split; there are",
        ("--stratify", "label"): "--stratify label: 1 slides have no label (s5.svs)",
        ("--folds", "3", "--val", "0.1"): "--val does not apply with --folds",
        ("--test", "0.6", "--val", "0.5"): "leave nothing to train on",
    }
    for extra, said in cases.items():
        done = cli("split", str(out), *extra)
        assert done.returncode == 2, (extra, done.stderr)
        assert said in done.stderr and "Traceback" not in done.stderr
    assert cli("split", str(out), "--test", "1.5").returncode == 2  # argparse's own
    assert all(s is None for s in _splits(out).values())  # nothing was written


def test_split_again_deals_only_the_slides_added(tmp_path: Path, make_slide: SlideFactory) -> None:
    """Folds written, then the index rebuilt with more slides (a new one of patient P0, and
    patients P3, P4): the folds survive the rebuild, and `split` with no options deals only
    the new slides, P0's to P0's fold, saying what it assigned."""
    out = _index(tmp_path, make_slide)
    done = cli("split", str(out), "--folds", "3", "--test", "0", "--seed", "4")
    assert done.returncode == 0, done.stderr
    first = _splits(out)
    folder = tmp_path / "slides"
    rows = (folder / "manifest.csv").read_text().splitlines()
    for i, patient in ((6, "P0"), (7, "P3"), (8, "P4")):
        shutil.copy(make_slide(width=512, height=512, seed=70 + i), folder / f"s{i}.svs")
        rows.append(f"s{i}.svs,b,{patient}")
    (folder / "manifest.csv").write_text("\n".join(rows) + "\n")
    rebuilt = cli(
        "index", str(folder / "manifest.csv"), "--out", str(out), "--tile-size", "128",
        "--level", "0", "--min-tissue", "0",
    )  # fmt: skip
    assert rebuilt.returncode == 0, rebuilt.stderr
    assert _splits(out) == {**first, "s6.svs": None, "s7.svs": None, "s8.svs": None}
    again = cli("split", str(out))
    assert again.returncode == 0, again.stderr
    assert "assigned 3 slides without a split" in again.stderr, again.stderr
    assert "the 6 slides with one kept theirs" in again.stderr
    now = _splits(out)
    assert {k: now[k] for k in first} == first
    assert now["s6.svs"] == first["s0.svs"]
    assert {now["s7.svs"], now["s8.svs"]} <= {"fold1", "fold2", "fold3"}
    assert now["s7.svs"] != now["s8.svs"]  # each fold had one patient: two get two folds
    # nothing left: said, nothing written; other options refused, naming --overwrite
    same = cli("split", str(out), "--json")
    assert same.returncode == 0 and json.loads(same.stdout)["assigned"] == {}
    other = cli("split", str(out), "--folds", "5")
    assert other.returncode == 2 and "--overwrite" in other.stderr
    assert "Traceback" not in other.stderr


def test_slides_without_tiles_are_left_out_of_the_dealing(
    tmp_path: Path, make_slide: SlideFactory
) -> None:
    """A slide with no tile (smaller than one, no tissue) was dealt like any other: in the
    trial the test split got one slide and 0 tiles. Such slides get no split, are named in a
    warning, and the shares are dealt among the patients with tiles."""
    out = _index(tmp_path, make_slide)
    folder = tmp_path / "slides"
    rows = (folder / "manifest.csv").read_text().splitlines()
    for i, patient in ((0, "P3"), (1, "P4")):
        shutil.copy(make_slide(width=100, height=100, seed=90 + i), folder / f"empty{i}.svs")
        rows.append(f"empty{i}.svs,b,{patient}")
    (folder / "manifest.csv").write_text("\n".join(rows) + "\n")
    build_index([folder / "manifest.csv"], out, tile_size=128, level=0, min_tissue=0.0)
    for args in (["--folds", "3", "--test", "0"], ["--test", "0.2", "--val", "0.2"]):
        for seed in range(4):
            done = cli("split", str(out), *args, "--seed", str(seed), "--overwrite", "--json")
            assert done.returncode == 0, done.stderr
            found = json.loads(done.stdout)
            assert found["no_tiles"] == [str(folder / "empty0.svs"), str(folder / "empty1.svs")]
            assert len(found["splits"]) == 3, found["splits"]  # each patient with tiles in one
            assert all(entry["tiles"] > 0 for entry in found["splits"].values()), found
            splits = _splits(out)
            assert splits["empty0.svs"] is None and splits["empty1.svs"] is None
    said = cli("split", str(out), "--folds", "3", "--test", "0", "--overwrite")
    assert said.returncode == 0, said.stderr
    assert (
        f"2 slides have no tiles and were left out of the dealing (no split): "
        f"{folder / 'empty0.svs'}, {folder / 'empty1.svs'}"
    ) in said.stderr, said.stderr
    assert "no split: 2 slides with no tiles" in said.stdout, said.stdout
    # dealt already: nothing more to assign, the index unchanged
    generation = SlideIndex.open(out).meta["generation"]
    again = cli("split", str(out))
    assert again.returncode == 0 and "nothing assigned" in again.stderr, again.stderr
    assert SlideIndex.open(out).meta["generation"] == generation


def test_a_copy_of_a_scan_counts_as_its_patient(tmp_path: Path, make_slide: SlideFactory) -> None:
    """A symlinked copy with no patient goes with its original (one scan), but the printout
    counted it as a patient of its own ("3 patients" in a fold of two)."""
    folder = tmp_path / "slides"
    folder.mkdir()
    for i in range(4):
        shutil.copy(make_slide(width=512, height=512, seed=60 + i), folder / f"case {i}.svs")
    (folder / "copy of case 0.svs").symlink_to(folder / "case 0.svs")
    out = tmp_path / "idx"
    build_index([folder], out, tile_size=256, level=0, min_tissue=0.0)
    done = cli("split", str(out), "--folds", "2", "--test", "0", "--seed", "3", "--json")
    assert done.returncode == 0, done.stderr
    found = json.loads(done.stdout)["splits"]
    splits = _splits(out)
    assert splits["copy of case 0.svs"] == splits["case 0.svs"]
    assert sum(entry["slides"] for entry in found.values()) == 5
    assert {name: entry["patients"] for name, entry in found.items()} == {
        "fold1": 2,
        "fold2": 2,
    }, found
    shown = cli("split", str(out), "--folds", "2", "--test", "0", "--seed", "3", "--overwrite")
    fold = splits["case 0.svs"]
    assert f"{fold}: 2 patients, 3 slides" in shown.stdout, shown.stdout
