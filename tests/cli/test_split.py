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
    # splits there already: refused, the index unchanged; the same seed gives the same folds
    again = cli(*args, "--seed", "7")
    assert again.returncode == 2 and "--overwrite" in again.stderr
    assert "Traceback" not in again.stderr
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
