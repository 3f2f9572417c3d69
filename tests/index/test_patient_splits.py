"""Patients in splits: a patient's slides are in one split (given by a 'patient' or 'case_id'
column, or from TCGA barcodes), and `write_splits` deals whole patients to train/val/test or
k folds, stratified by label and the same for the same seed."""

from __future__ import annotations

import shutil
from collections import Counter, defaultdict
from pathlib import Path

import pytest

from tests.conftest import SlideFactory
from wsi_loader import InputError, SlideIndex, build_index
from wsi_loader.index._labels import patient_of, tcga_case
from wsi_loader.index._splits import SplitPlan, assign, write_splits
from wsi_loader.index._table_files import SlideRecord


def test_tcga_barcodes_name_their_case() -> None:
    assert tcga_case("TCGA-CR-7395-01A-01-TS1") == "TCGA-CR-7395"
    assert tcga_case("TCGA-CR-7395-01Z-00-DX1.0F5B1B5B-6D9C-4D66-9C5C-2A3C1C1E0E7B") == (
        "TCGA-CR-7395"
    )
    assert tcga_case("tcga-cr-7395-01a-01-ts1") == "TCGA-CR-7395"
    assert tcga_case("TCGA-CR-7395") == "TCGA-CR-7395"
    for other in ("CMU-1", "TCGA-CR-73950", "my-TCGA-CR-7395-01A", "TCGA-C-7395-01A"):
        assert tcga_case(other) is None
    # a given patient wins over the barcode
    given = SlideRecord(path="a/TCGA-CR-7395-01A-01-TS1.svs", patient="P7")
    assert patient_of(given) == "P7"
    assert patient_of(SlideRecord(path="a/TCGA-CR-7395-01A-01-TS1.svs")) == "TCGA-CR-7395"
    assert patient_of(SlideRecord(path="a/CMU-1.svs")) is None


@pytest.fixture
def slides(tmp_path: Path, make_slide: SlideFactory) -> Path:
    """Four different slides in a folder, as TCGA names them: two of case TCGA-CR-7395."""
    folder = tmp_path / "slides"
    folder.mkdir()
    names = (
        "TCGA-CR-7395-01A-01-TS1",
        "TCGA-CR-7395-01Z-00-DX1",
        "TCGA-AB-0001-01Z-00-DX1",
        "TCGA-AB-0002-01Z-00-DX1",
    )
    for seed, name in enumerate(names, start=60):
        shutil.copy(make_slide(width=512, height=512, seed=seed), folder / f"{name}.svs")
    return folder


def _build(folder: Path, out: Path, labels: str) -> SlideIndex:
    table = folder / "labels.csv"
    table.write_text(labels)
    return build_index([folder], out, tile_size=128, level=0, min_tissue=0.0, labels=str(table))


def test_a_patient_in_two_splits_is_refused(slides: Path, tmp_path: Path) -> None:
    """Two slides of one TCGA case, one in train and one in val: the case's tissue on both
    sides, refused as one slide in two splits is."""
    rows = (
        "slide,label,split\nTCGA-CR-7395-01A-01-TS1,a,train\nTCGA-CR-7395-01Z-00-DX1,a,val\n"
        "TCGA-AB-0001-01Z-00-DX1,b,train\nTCGA-AB-0002-01Z-00-DX1,b,val\n"
    )
    with pytest.raises(InputError, match=r"patient 'TCGA-CR-7395' is in two splits"):
        _build(slides, tmp_path / "idx", rows)
    assert not (tmp_path / "idx" / "CURRENT").exists()
    # the patient column decides where given: here the two AB slides are one patient
    rows = (
        "slide,label,split,case_id\nTCGA-CR-7395-01A-01-TS1,a,train,\n"
        "TCGA-CR-7395-01Z-00-DX1,a,train,\nTCGA-AB-0001-01Z-00-DX1,b,train,X\n"
        "TCGA-AB-0002-01Z-00-DX1,b,val,X\n"
    )
    with pytest.raises(InputError, match=r"patient 'X' is in two splits"):
        _build(slides, tmp_path / "idx", rows)
    rows = rows.replace("val,X", "train,X")
    index = _build(slides, tmp_path / "idx", rows)
    assert sorted(s.patient or "-" for s in index.slides) == ["-", "-", "X", "X"]


def test_a_manifest_patient_column_is_recorded(slides: Path, tmp_path: Path) -> None:
    manifest = tmp_path / "m.csv"
    manifest.write_text(
        "path,label,patient,split\n"
        + "".join(
            f"{p},{'ab'[i % 2]},P{i // 2},{'train' if i < 2 else 'val'}\n"
            for i, p in enumerate(sorted(slides.glob("*.svs")))
        )
    )
    index = build_index([manifest], tmp_path / "idx", tile_size=128, level=0, min_tissue=0)
    assert [s.patient for s in index.slides] == ["P0", "P0", "P1", "P1"]
    manifest.write_text(manifest.read_text().replace(",P1,val", ",P1,train", 1))
    with pytest.raises(InputError, match="patient 'P1' is in two splits"):
        build_index([manifest], tmp_path / "idx", tile_size=128, level=0, min_tissue=0)
    both = tmp_path / "both.csv"
    both.write_text(f"path,patient,case_id\n{next(slides.glob('*.svs'))},A,B\n")
    with pytest.raises(InputError, match=r"both.csv:2: 'patient' 'A' and 'case_id' 'B' differ"):
        build_index([both], tmp_path / "j", tile_size=128, level=0)


def _records(patients: int, seed: int = 0) -> list[SlideRecord]:
    """Patients of labels a (3 of 4) and b, with 1 to 3 slides each, in a shuffled order."""
    import random

    rng = random.Random(seed)
    records = [
        SlideRecord(
            path=f"s/{p}-{k}.svs", label="b" if p % 4 == 0 else "a", patient=f"P{p}", tiles=4
        )
        for p in range(patients)
        for k in range(rng.randint(1, 3))
    ]
    rng.shuffle(records)
    return records


def _by_patient(records: list[SlideRecord], splits: list[str | None]) -> dict[str, str]:
    seen: dict[str, set[str | None]] = defaultdict(set)
    for record, split in zip(records, splits, strict=True):
        seen[str(record.patient)].add(split)
    assert all(len(s) == 1 for s in seen.values()), "a patient in two splits"
    return {p: str(next(iter(s))) for p, s in seen.items()}


@pytest.mark.parametrize("patients", [10, 37, 200])
def test_patients_are_dealt_whole_stratified_and_by_seed(patients: int) -> None:
    records = _records(patients)
    plan = SplitPlan(stratify="label", test=0.2, val=0.1, seed=3)
    splits = assign(records, plan)
    of = _by_patient(records, splits)
    label = {str(r.patient): r.label for r in records}
    for name, share in (("test", 0.2), ("val", 0.1), ("train", 0.7)):
        for wanted in ("a", "b"):
            members = [p for p in of if label[p] == wanted]
            got = sum(of[p] == name for p in members)
            assert abs(got - share * len(members)) <= 1.01, (name, wanted, got, len(members))
    # the same seed, the same splits whatever the order of the slides; another seed, others
    assert assign(records[::-1], plan) == splits[::-1]
    others = [
        assign(records, SplitPlan(stratify="label", test=0.2, val=0.1, seed=s)) for s in (4, 5)
    ]
    assert any(o != splits for o in others)


def test_k_folds_split_the_rest_evenly() -> None:
    records = _records(53)
    splits = assign(records, SplitPlan(stratify="label", folds=5, test=0.2, val=0.0, seed=1))
    of = _by_patient(records, splits)
    sizes = Counter(of.values())
    assert set(sizes) == {"test", "fold1", "fold2", "fold3", "fold4", "fold5"}
    assert abs(sizes["test"] - 0.2 * 53) <= 1
    folds = [sizes[f"fold{k}"] for k in range(1, 6)]
    assert max(folds) - min(folds) <= 1
    label = {str(r.patient): r.label for r in records}
    per_fold_b = [sum(of[p] == f"fold{k}" and label[p] == "b" for p in of) for k in range(1, 6)]
    assert max(per_fold_b) - min(per_fold_b) <= 1  # stratified: b spread over the folds
    # no test split: every patient in a fold
    plain = assign(records, SplitPlan(folds=3, test=0.0, val=0.0, seed=1))
    assert not {"test", None} & set(plain)


def test_plans_that_cannot_be_met_say_why() -> None:
    records = _records(6)
    with pytest.raises(InputError, match=r"--folds 10 needs at least 10 patients outside the test"):
        assign(records, SplitPlan(folds=10, test=0.2, val=0.0))
    unlabelled = [*records, SlideRecord(path="s/nolabel.svs", patient="Q", tiles=4)]
    with pytest.raises(InputError, match=r"--stratify label: 1 slides have no label \(nolabel.svs"):
        assign(unlabelled, SplitPlan(stratify="label"))
    assert None not in assign(unlabelled, SplitPlan(stratify=None))
    with pytest.raises(ValueError, match="--val does not apply with --folds"):
        assign(records, SplitPlan(folds=3, val=0.2))
    with pytest.raises(ValueError, match="leave nothing to train on"):
        assign(records, SplitPlan(test=0.5, val=0.5))
    with pytest.raises(InputError, match="no indexed slide"):
        assign([SlideRecord(path="x.svs", status="failed")], SplitPlan())
    # slides without a patient are their own; failed slides get no split
    mixed = [SlideRecord(path=f"s/{i}.svs", label="a", tiles=4) for i in range(10)]
    mixed.append(SlideRecord(path="s/bad.svs", status="failed"))
    dealt = assign(mixed, SplitPlan(stratify=None, test=0.2, val=0.2))
    assert dealt[-1] is None and Counter(dealt[:-1]) == {"train": 6, "val": 2, "test": 2}


def test_written_folds_are_selected_by_name(slides: Path, tmp_path: Path) -> None:
    labels = "".join(
        f"{p.stem},{'ab'[i % 2]}\n" for i, p in enumerate(sorted(slides.glob("*.svs")))
    )
    index = _build(slides, tmp_path / "idx", "slide,label\n" + labels)
    before = index.meta["generation"]
    written = write_splits(index.path, SplitPlan(folds=3, test=0.0, val=0.0, seed=2), False)
    assert written.meta["generation"] != before and written.meta["splits"]["folds"] == 3
    assert len(written) == len(index) and written.label_names == index.label_names
    # the two slides of case TCGA-CR-7395 went to one fold
    cr = {s.split for s in written.slides if Path(s.path).name.startswith("TCGA-CR-7395")}
    assert len(cr) == 1 and sorted(written.splits()) == ["fold1", "fold2", "fold3"]
    for k in (1, 2, 3):
        train = SlideIndex.open(index.path, split=f"fold{k}:train")
        val = SlideIndex.open(index.path, split=f"fold{k}:val")
        assert len(train) + len(val) == len(index) and len(val) > 0
        assert set(val.columns["slide_id"].tolist()).isdisjoint(train.columns["slide_id"].tolist())
        assert val.split == f"fold{k}:val"
    with pytest.raises(Exception, match=r"fold1 \.\. fold3 .*fold1:train \.\. fold3:train"):
        SlideIndex.open(index.path, split="fold4:train")
    assert len(SlideIndex.open(index.path, split="fold2")) == len(
        SlideIndex.open(index.path, split="fold2:val")
    )  # a fold's own name, which the error above offers too
    # splits already there: replaced only when asked
    with pytest.raises(InputError, match=r"split with --folds 3 .*--overwrite"):
        write_splits(index.path, SplitPlan(test=0.25, val=0.25), False)
    again = write_splits(index.path, SplitPlan(test=0.25, val=0.25, seed=2), True)
    assert sorted(again.splits()) == ["test", "train", "val"]
    assert len(SlideIndex.open(index.path, split="train")) > 0
    # splitting by slide would part the TCGA case: refused, pointing to --by patient
    with pytest.raises(InputError, match="--by patient"):
        for seed in range(20):  # some seed parts the two slides of the case
            write_splits(index.path, SplitPlan(by="slide", test=0.25, val=0.25, seed=seed), True)


def _names(index: SlideIndex) -> dict[str, str | None]:
    return {Path(s.path).stem: s.split for s in index.slides}


def test_a_rebuild_keeps_the_splits_split_wrote(
    slides: Path, tmp_path: Path, make_slide: SlideFactory
) -> None:
    """Folds written by `write_splits` survive a rebuild (slides reused), a re-index (grid
    changed: every slide read again) and new slides; a split the inputs give wins, and a
    patient parted by it across a kept split is refused."""
    label = {p.stem: "ab"[i % 2] for i, p in enumerate(sorted(slides.glob("*.svs")))}

    def table(splits: dict[str, str]) -> str:
        return "slide,label,split\n" + "".join(
            f"{name},{label[name]},{splits.get(name, '')}\n" for name in label
        )

    labels = table({})
    index = _build(slides, tmp_path / "idx", labels)
    plan = SplitPlan(stratify=None, folds=2, test=0.34, val=0.0)  # 3 patients: 1 test, 2 folds
    written = _names(write_splits(index.path, plan, False))
    assert sorted(set(written.values())) == ["fold1", "fold2", "test"]
    shutil.copy(make_slide(width=512, height=512, seed=69), slides / "new.svs")
    rebuilt = _build(slides, tmp_path / "idx", labels)
    assert rebuilt.meta["build"]["unchanged"] == 4
    assert _names(rebuilt) == {**written, "new": None}
    assert rebuilt.meta["splits"] == plan.as_json()
    for name in ("fold1:val", "fold2:train", "test"):
        assert len(SlideIndex.open(index.path, split=name)) > 0
    reindexed = build_index(
        [slides], tmp_path / "idx", tile_size=64, level=0, min_tissue=0.0,
        labels=str(slides / "labels.csv"),
    )  # fmt: skip
    assert reindexed.meta["build"]["unchanged"] == 0
    assert _names(reindexed) == {**written, "new": None}
    # the input's split wins over the kept one
    mine = "TCGA-AB-0001-01Z-00-DX1"
    other = next(f for f in ("fold1", "fold2", "test") if f != written[mine])
    assert _names(_build(slides, tmp_path / "idx", table({mine: other})))[mine] == other
    # a case parted: one slide given a split, the other's kept one differs
    case = "TCGA-CR-7395-01A-01-TS1"
    kept = written["TCGA-CR-7395-01Z-00-DX1"]
    parted = next(f for f in ("fold1", "fold2", "test") if f != kept)
    with pytest.raises(InputError, match=r"patient 'TCGA-CR-7395' is in two splits.*kept"):
        _build(slides, tmp_path / "idx", table({case: parted}))


def test_splitting_again_deals_only_the_new_patients(
    slides: Path, tmp_path: Path, make_slide: SlideFactory
) -> None:
    """Slides added after `write_splits`: splitting again without overwrite keeps every
    assignment, puts a new slide of a split patient in its patient's split and deals the
    new patients; with nothing unassigned it writes nothing."""
    index = _build(slides, tmp_path / "idx", "slide,label\n")
    first = _names(write_splits(index.path, SplitPlan(stratify=None, test=0.25, val=0.25), False))
    shutil.copy(make_slide(width=512, height=512, seed=66), slides / "TCGA-CR-7395-01A-02-TS2.svs")
    for k in range(8):
        shutil.copy(make_slide(width=512, height=512, seed=80 + k), slides / f"n{k}.svs")
    rebuilt = _build(slides, tmp_path / "idx", "slide,label\n")
    assert sum(s.split is None for s in rebuilt.slides) == 9
    again = write_splits(index.path, None, False)
    now = _names(again)
    assert {k: now[k] for k in first} == first
    assert now["TCGA-CR-7395-01A-02-TS2"] == first["TCGA-CR-7395-01A-01-TS1"]
    dealt = Counter(now[f"n{k}"] for k in range(8))
    assert dealt == {"train": 4, "val": 2, "test": 2}, dealt
    same = write_splits(index.path, None, False)
    assert same.meta["generation"] == again.meta["generation"]
    # another plan for the new patients is refused; --overwrite deals everything again
    with pytest.raises(InputError, match=r"--folds 3.*--overwrite"):
        write_splits(index.path, SplitPlan(stratify=None, folds=3, val=0.0), False)
    folds = write_splits(index.path, SplitPlan(stratify=None, folds=3, val=0.0), True)
    assert sorted(folds.splits()) == ["fold1", "fold2", "fold3", "test"]


def test_dealing_more_patients_keeps_the_old_and_fills_the_shares() -> None:
    from wsi_loader.index._splits import assign_more

    records = _records(60, seed=1)
    plan = SplitPlan(stratify="label", folds=4, test=0.2, val=0.0, seed=5)
    old = [r for r in records if int(str(r.patient)[1:]) < 30]
    from dataclasses import replace

    split_old = [replace(r, split=s) for r, s in zip(old, assign(old, plan), strict=True)]
    merged = split_old + [r for r in records if int(str(r.patient)[1:]) >= 30]
    splits = assign_more(merged, plan)
    assert splits[: len(split_old)] == [r.split for r in split_old]
    of = _by_patient(merged, splits)
    sizes = Counter(of.values())
    assert abs(sizes["test"] - 12) <= 1
    folds = [sizes[f"fold{k}"] for k in range(1, 5)]
    assert max(folds) - min(folds) <= 1, sizes


def test_copies_of_one_scan_are_dealt_to_one_split(
    tmp_path: Path, make_slide: SlideFactory
) -> None:
    """A symlink beside its target (two names, one scan) was dealt like two patients: the
    copy in test and the original in train, and the next `wsi-loader index` refused the
    index ("the same slide is in two splits")."""
    folder = tmp_path / "slides"
    folder.mkdir()
    for i in range(7):
        shutil.copy(make_slide(width=512, height=512, seed=80 + i), folder / f"case {i}.svs")
    (folder / "copy of case 0.svs").symlink_to(folder / "case 0.svs")
    out = tmp_path / "idx"
    build_index([folder], out, tile_size=256, level=0, min_tissue=0.0)
    for seed in range(6):
        plan = SplitPlan(stratify=None, test=0.25, val=0.25, seed=seed)
        split = {Path(s.path).name: s.split for s in write_splits(out, plan, True).slides}
        assert split["copy of case 0.svs"] == split["case 0.svs"], (seed, split)
    build_index([folder], out, tile_size=256, level=0, min_tissue=0.0)  # the rebuild is not refused


def test_info_shows_each_slides_patient(slides: Path, tmp_path: Path) -> None:
    """`info --json` listed label and split per slide but not the patient the split deals
    by, so a user could not check that a patient's slides stayed together."""
    index = build_index([slides], tmp_path / "idx", tile_size=128, level=0, min_tissue=0)
    patients = {Path(s["path"]).stem: s["patient"] for s in index.summary()["slides"]}
    assert patients["TCGA-CR-7395-01A-01-TS1"] == patients["TCGA-CR-7395-01Z-00-DX1"]
    assert patients["TCGA-CR-7395-01A-01-TS1"] == "TCGA-CR-7395"


def test_a_rebuild_of_a_moved_archive_keeps_the_splits_split_wrote(
    slides: Path, tmp_path: Path
) -> None:
    """An index of absolute paths is rebuilt where its slides are now (a root cannot remap
    it): the splits were kept by path, so every one was dropped without a word, and the next
    `split` dealt the test set again."""
    labels = "slide,label\n" + "".join(
        f"{p.stem},{'ab'[i % 2]}\n" for i, p in enumerate(sorted(slides.glob("*.svs")))
    )
    index = _build(slides, tmp_path / "idx", labels)
    written = _names(write_splits(index.path, SplitPlan(stratify=None, test=0.34), False))
    moved = tmp_path / "moved"
    slides.rename(moved)
    table = moved / "labels.csv"
    rebuilt = build_index(
        [moved], tmp_path / "idx", tile_size=128, level=0, min_tissue=0.0, labels=str(table),
        allow_shrink=True,
    )  # fmt: skip
    assert all(r.path.startswith(str(moved)) for r in rebuilt.slides)
    assert _names(rebuilt) == written
