"""Feature extraction (CLAM/TRIDENT h5 layout) and bags of features."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import h5py
import numpy as np
import openslide
import pytest
import torch
from torch.nn import functional as F  # noqa: N812
from torch.utils.data import DataLoader, DistributedSampler

from tests.conftest import REPO, corrupt_rows
from tests.feature_models import PoolLinear, tiny
from tests.torchrun import torchrun_cli
from tests.vision import require
from wsi_loader.cli import main
from wsi_loader.dataset import FeatureBagDataset, pad_bags
from wsi_loader.errors import ConfigError, InputError
from wsi_loader.features import assign_slides, extract, load_encoder
from wsi_loader.index import SlideIndex

MEAN, STD = torch.tensor(tiny()[1]["mean"]), torch.tensor(tiny()[1]["std"])


def openslide_tile(index: SlideIndex, row: int) -> torch.Tensor:
    """The tile as OpenSlide reads it: float (1, 3, H, W) in [0, 1]."""
    cols = index.columns
    record = index.slides[int(cols["slide_id"][row])]
    size = int(cols["read_size"][row])
    with openslide.OpenSlide(index.slide_path(int(cols["slide_id"][row]))) as slide:
        rgba = slide.read_region(
            (int(cols["l0_x"][row]), int(cols["l0_y"][row])), int(cols["level"][row]), (size, size)
        )
    assert record.read_size == size
    pixels = torch.from_numpy(np.asarray(rgba)[..., :3].copy())
    return pixels.permute(2, 0, 1)[None].float() / 255


def rows_of(index: SlideIndex, path: str, coords: np.ndarray) -> list[int]:
    cols = index.columns
    sid = [s.path for s in index.slides].index(path)
    lookup = {
        (int(x), int(y)): r
        for r, (x, y, s) in enumerate(
            zip(cols["l0_x"], cols["l0_y"], cols["slide_id"], strict=True)
        )
        if s == sid
    }
    return [lookup[(int(x), int(y))] for x, y in coords]


@pytest.mark.parametrize("workers", [0, 2])
def test_features_equal_the_model_on_openslide_pixels(
    index: SlideIndex, tmp_path: Path, workers: int
) -> None:
    out = tmp_path / "features"
    report = extract(index, "tests.feature_models:tiny", out, batch_size=16, workers=workers)
    bad = set(corrupt_rows(index).tolist())
    assert report.written == 2 and report.failed == len(bad) == len(report.failures)
    assert report.tiles == len(index) - len(bad)
    model = PoolLinear().eval()
    summary = json.loads((out / "features.json").read_text())
    assert summary["dim"] == 16 and summary["model"] == "tests.feature_models:tiny"
    assert summary["failed"] == len(bad) and summary["tiles"] == report.tiles
    for record in index.slides:
        name = Path(record.path).stem
        assert summary["slides"][record.path]["file"] == f"{name}.h5"
        with h5py.File(out / f"{name}.h5", "r") as h5:
            features, coords = h5["features"][:], h5["coords"][:]
            assert features.dtype == np.float32 and coords.dtype == np.int64
            assert (
                h5["coords"].attrs["patch_size"] == 256 and h5["coords"].attrs["patch_level"] == 0
            )
            assert h5.attrs["model"] == "tests.feature_models:tiny"
            assert h5.attrs["generation"] == index.meta["generation"]
        rows = rows_of(index, record.path, coords)
        assert not set(rows) & bad  # failed tiles are left out...
        assert len(rows) == record.tiles - len(
            [r for r in bad if index.columns["slide_id"][r] == index.slides.index(record)]
        )
        for i in np.random.default_rng(0).choice(len(rows), size=5, replace=False):
            tile = openslide_tile(index, rows[i])
            tile = F.interpolate(tile, size=(64, 64), mode="bilinear", antialias=True)
            tile = (tile - MEAN.view(1, 3, 1, 1)) / STD.view(1, 3, 1, 1)
            with torch.inference_mode():
                expected = model(tile)[0].numpy()
            np.testing.assert_allclose(features[i], expected, rtol=1e-4, atol=1e-4)
    # ...and listed with their reason
    reasons = {f["reason"] for f in summary["failures"]}
    assert reasons == {"ValueError: Bogus marker length"}  # what libjpeg said, per tile


def test_plain_model_on_exact_pixels_and_a_rerun_skips_complete_slides(
    index: SlideIndex, tmp_path: Path
) -> None:
    out = tmp_path / "f"
    extract(index, "tests.feature_models:plain", out, batch_size=32, workers=0)
    good = index.slides[[Path(s.path).name for s in index.slides].index("good.svs")]
    with h5py.File(out / "good.h5", "r") as h5:
        features, coords = h5["features"][:], h5["coords"][:]
    rows = rows_of(index, good.path, coords)
    with torch.inference_mode():
        expected = PoolLinear().eval()(openslide_tile(index, rows[3]))[0].numpy()
    np.testing.assert_allclose(features[3], expected, rtol=1e-5, atol=1e-5)
    before = {p.name: p.stat().st_mtime_ns for p in out.glob("*.h5")}
    again = extract(index, "tests.feature_models:plain", out, batch_size=32, workers=0)
    assert (again.written, again.skipped) == (0, 2)
    assert {p.name: p.stat().st_mtime_ns for p in out.glob("*.h5")} == before
    # other weights under the same spec are other content: written again
    other = PoolLinear()
    with torch.no_grad():
        other.linear.bias.add_(1.0)
    with pytest.raises(ConfigError, match="other options"):  # another model: not mixed in
        extract(index, other, out, batch_size=32, workers=0)
    assert extract(index, other, out, batch_size=32, workers=0, overwrite=True).written == 2


def test_resume_after_a_kill(index: SlideIndex, tmp_path: Path) -> None:
    out = tmp_path / "killed"
    command = [
        sys.executable, "-m", "wsi_loader.cli", "features", str(index.path),
        "--model", "tests.feature_models:slow", "--out", str(out), "--batch-size", "16",
        "--workers", "0", "--device", "cpu", "--no-progress",
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(command, cwd=REPO, env=env, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    while not list(out.glob("*.h5")) and time.monotonic() < deadline:
        time.sleep(0.1)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    proc.stderr.close()  # type: ignore[union-attr]
    finished = sorted(p.name for p in out.glob("*.h5"))
    assert len(finished) == 1, finished  # killed during the second slide
    for path in out.glob("*.h5"):  # nothing half-written under a final name
        with h5py.File(path, "r") as h5:
            assert len(h5["features"]) == len(h5["coords"]) > 0
    report = extract(index, "tests.feature_models:slow", out, batch_size=16, workers=0)
    assert (report.written, report.skipped) == (1, 1)
    assert not [p for p in out.iterdir() if ".tmp-" in p.name]  # the killed run's file is gone


@pytest.mark.slow
def test_torchrun_with_two_ranks_covers_every_slide_once(index: SlideIndex, tmp_path: Path) -> None:
    out = tmp_path / "ranks"
    torchrun_cli(
        tmp_path, "features", str(index.path),
        "--model", "tests.feature_models:tiny", "--out", str(out), "--workers", "0",
        "--device", "cpu", "--no-progress", timeout=240,
    ).check_returncode()  # fmt: skip
    summary = json.loads((out / "features.json").read_text())
    assert summary["ranks"] == 2 and summary["written"] == 2
    writers = summary["written_by"]
    assert sorted(writers) == sorted(s.path for s in index.slides)
    assert sorted(writers.values()) == [0, 1]  # one slide each, none twice
    assert summary["tiles"] == len(index) - len(corrupt_rows(index))


def test_slides_are_balanced_across_ranks() -> None:
    owner = assign_slides([100, 10, 10, 60, 40], 2)
    load = [
        sum(t for t, o in zip([100, 10, 10, 60, 40], owner, strict=True) if o == r) for r in (0, 1)
    ]
    assert sorted(load) == [110, 110]
    assert assign_slides([5, 5, 5], 1) == [0, 0, 0]


def test_model_specs_and_their_errors(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    encoder = load_encoder("tests.feature_models:tiny")
    assert encoder.size == 64 and encoder.mean == (0.485, 0.456, 0.406)
    assert load_encoder("tests.feature_models:plain").mean is None
    for spec, message in [
        ("resnet50", "torchvision:NAME, timm:NAME, package.module:callable or a TorchScript"),
        ("no_such_module_xyz:make", "cannot import"),
        ("tests.feature_models:missing", "cannot import"),
        ("tests.feature_models:not_a_model", "must give an nn.Module"),
    ]:
        with pytest.raises(ConfigError, match=message):
            load_encoder(spec)
    monkeypatch.setitem(sys.modules, "timm", None)  # not installed
    with pytest.raises(ConfigError, match="needs timm"):
        load_encoder("timm:vit_small_patch16_224")


@pytest.mark.vision
def test_torchvision_weights_must_be_in_the_local_cache(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    torchvision = require("torchvision")
    monkeypatch.setenv("TORCH_HOME", str(tmp_path))  # an empty hub cache
    with pytest.raises(ConfigError, match="not in the torch hub cache"):
        load_encoder("torchvision:resnet18")
    assert torchvision


def test_cli_features_and_a_bad_model(index: SlideIndex, tmp_path: Path) -> None:
    out = tmp_path / "cli"
    args = ["features", str(index.path), "--out", str(out), "--workers", "0", "--no-progress"]
    assert main([*args, "--model", "tests.feature_models:tiny"]) == 0
    assert (out / "features.json").is_file()
    assert main([*args, "--model", "nope"]) == 2


def test_feature_bags_labels_padding_and_subsets(index: SlideIndex, tmp_path: Path) -> None:
    out = tmp_path / "bags"
    extract(index, "tests.feature_models:tiny", out, workers=0)
    bags = FeatureBagDataset(out, index=index)
    assert bags.label_names == ("normal", "tumour") and len(bags) == 2
    by_slide = {bags[i]["slide"]: bags[i] for i in range(len(bags))}
    assert by_slide["good"]["label"] == 0 and by_slide["bad"]["label"] == 1
    assert by_slide["good"]["features"].shape == (80, 16)
    batch = pad_bags([by_slide["good"], by_slide["bad"]])
    lengths = [80, 64 - len(corrupt_rows(index))]
    assert batch["features"].shape == (2, 80, 16) and batch["lengths"].tolist() == lengths
    assert batch["mask"].sum(dim=1).tolist() == lengths
    assert not batch["features"][1, lengths[1] :].any()
    assert batch["label"].tolist() == [0, 1]
    # at most k instances, the same subset for a given epoch, another one next epoch
    sub = FeatureBagDataset(out, index=index, max_instances=10, seed=3)
    first = sub[0]["coords"]
    assert len(first) == 10 and torch.equal(first, sub[0]["coords"])
    sub.set_epoch(1)
    assert not torch.equal(first, sub[0]["coords"])
    # labels from a CSV; DistributedSampler splits the bags over ranks
    (tmp_path / "labels.csv").write_text("slide,label\ngood,benign\n")
    csv_bags = FeatureBagDataset(out, labels=str(tmp_path / "labels.csv"), unlabelled="drop")
    assert [csv_bags[i]["slide"] for i in range(len(csv_bags))] == ["good"]
    seen = []
    for rank in (0, 1):
        sampler = DistributedSampler(bags, num_replicas=2, rank=rank, shuffle=False)
        loader = DataLoader(bags, batch_size=1, sampler=sampler, collate_fn=pad_bags)
        seen += [name for batch in loader for name in batch["slide"]]
    assert sorted(seen) == ["bad", "good"]


def test_a_replaced_slide_is_not_written_as_complete(index: SlideIndex, tmp_path: Path) -> None:
    """A slide replaced after indexing (same size, other bytes) fails every read as a slide
    fault: its file must not be written, or a rerun after the slide is restored would skip it
    as complete and the bag would stay empty for good."""
    good = index.slide_path([Path(s.path).name for s in index.slides].index("good.svs"))
    original = Path(good).read_bytes()
    Path(good).write_bytes(original[:-4096] + bytes(4096))  # the tail of the file changes
    out = tmp_path / "f"
    report = extract(index, "tests.feature_models:tiny", out, workers=0)
    assert report.written == 1 and not (out / "good.h5").exists()
    stored = [s.path for s in index.slides if s.path.endswith("good.svs")]
    assert [entry["slide"] for entry in report.incomplete] == stored
    assert "changed" in report.incomplete[0]["reason"]
    summary = json.loads((out / "features.json").read_text())
    assert summary["incomplete"] and "good" not in {Path(p).stem for p in summary["slides"]}
    Path(good).write_bytes(original)  # restored: the next run writes it
    again = extract(index, "tests.feature_models:tiny", out, workers=0)
    assert (again.written, again.skipped, again.incomplete) == (1, 1, [])
    with h5py.File(out / "good.h5", "r") as h5:
        assert len(h5["features"]) == 80


def _bag_files(folder: Path, names: list[str]) -> Path:
    folder.mkdir()
    for name in names:
        with h5py.File(folder / f"{name}.h5", "w") as h5:
            h5["features"] = np.zeros((3, 4), np.float32)
            h5["coords"] = np.zeros((3, 2), np.int64)
    return folder


@pytest.mark.parametrize(
    "text",
    [
        "Slide;Label\ngood;benign\ncase.1.2;tumour\n",  # a spreadsheet in a decimal-comma locale
        "slide\tlabel\ngood\tbenign\ncase.1.2\ttumour\n",  # copied from a sheet
        "case_id,slide_id,label\nc1,good,benign\nc2,case.1.2,tumour\n",  # CLAM's dataset CSV
        "slide,label\ngood.svs,benign\ncase.1.2.ndpi,tumour\n",  # file names, as TRIDENT lists
    ],
)
def test_feature_bag_labels_as_other_tools_write_them(tmp_path: Path, text: str) -> None:
    folder = _bag_files(tmp_path / "bags", ["good", "case.1.2", "other"])
    (tmp_path / "labels.csv").write_text(text)
    bags = FeatureBagDataset(folder, labels=str(tmp_path / "labels.csv"))
    labels = {bags[i]["slide"]: bags[i]["label"] for i in range(len(bags))}
    assert bags.label_names == ("benign", "tumour")
    assert labels == {"good": 0, "case.1.2": 1, "other": -1}


def test_feature_bag_labels_errors_and_slides_without_features(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    folder = _bag_files(tmp_path / "bags", ["good"])
    table = tmp_path / "labels.csv"
    table.write_text("slide,label\ngood,a\ngood,b\n")
    with pytest.raises(InputError, match=r"labels.csv:3: .*'good'.* two different labels"):
        FeatureBagDataset(folder, labels=str(table))
    table.write_text("name,label\ngood,a\n")
    with pytest.raises(InputError, match=r"labels.csv: .*required columns"):
        FeatureBagDataset(folder, labels=str(table))
    table.write_text("slide,diagnosis\ngood,a\n")
    with pytest.raises(InputError, match=r"labels.csv: .*'label' column"):
        FeatureBagDataset(folder, labels=str(table))
    # labelled slides whose features are missing (extraction failed or not run) are said
    table.write_text("slide,label\ngood,a\nlost 1,b\nlost.2,b\n")
    bags = FeatureBagDataset(folder, labels=str(table))
    assert len(bags) == 1 and bags.label_names == ("a", "b")
    assert "2 labelled slides have no feature file" in caplog.text
    assert "'lost 1'" in caplog.text and "'lost.2'" in caplog.text


def test_feature_bag_numeric_labels_keep_their_order(tmp_path: Path) -> None:
    folder = _bag_files(tmp_path / "bags", ["a", "b", "c"])
    bags = FeatureBagDataset(folder, labels={"a": "10", "b": "2", "c": "0"})
    assert bags.label_names == ("0", "2", "10")
    assert [bags[i]["label"] for i in range(3)] == [2, 1, 0]


def test_feature_bag_labels_are_checked_as_index_labels_are(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # CLAM's dataset CSVs are often written by pandas: two spellings of a class, or 'nan' for
    # a slide without a label, became classes of their own here as in the index
    folder = _bag_files(tmp_path / "bags", ["a", "b", "c", "d"])
    table = tmp_path / "labels.csv"
    table.write_text("case_id,slide_id,label\n1,a,Tumor\n2,b,tumor\n3,c,nan\n4,d,Normal\n")
    bags = FeatureBagDataset(folder, labels=str(table))
    assert bags.label_names == ("Normal", "Tumor", "nan", "tumor")  # kept as written
    assert "labels that differ only in case or spacing: 'Tumor' / 'tumor'" in caplog.text
    assert (
        "labels that look like a missing value" in caplog.text and "'nan' (1 slide)" in caplog.text
    )


# In every reading process: reads of good.svs hang, as on a share that stopped answering
GOOD_HANGS = """
import time
from wsi_loader.slides import _tiff

_raw = _tiff.TiffReader._raw

def _hangs(self, level, index):
    if self.path.endswith("good.svs"):
        time.sleep(3600)
    return _raw(self, level, index)

_tiff.TiffReader._raw = _hangs
"""


def hang_reads_of_good_slide(
    monkeypatch: pytest.MonkeyPatch, hook_workers: Callable[[str], None]
) -> None:
    """Every read of good.svs hangs: in spawned or forkserver workers (`GOOD_HANGS`) and in
    this process and its forked workers (the patch)."""
    from wsi_loader.slides import _tiff

    hook_workers(GOOD_HANGS)
    real = _tiff.TiffReader._raw

    def _hangs(self: _tiff.TiffReader, level: int, i: int) -> bytes:
        if self.path.endswith("good.svs"):
            time.sleep(3600)
        return real(self, level, i)

    monkeypatch.setattr(_tiff.TiffReader, "_raw", _hangs)


@pytest.mark.timeout(600)
def test_a_slide_that_hangs_is_left_for_the_next_run_after_timeout(
    index: SlideIndex,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    hook_workers: Callable[[str], None],
) -> None:
    """A read that hangs kept feature extraction waiting forever. With ``timeout`` the slide
    being read is left unwritten (incomplete, with the reason), the other slides are written
    by fresh workers, the command says so (exit 1), and the next run does the slide."""
    hang_reads_of_good_slide(monkeypatch, hook_workers)
    out = tmp_path / "f"
    # 60 s: the hung read never ends, and a good batch (the first one waits for the worker to
    # start) must not come near it on a busy machine
    report = extract(index, "tests.feature_models:tiny", out, workers=1, timeout=60)
    good = next(s.path for s in index.slides if s.path.endswith("good.svs"))
    assert [entry["slide"] for entry in report.incomplete] == [good]
    assert "no batch within timeout=60 s while reading it" in report.incomplete[0]["reason"]
    assert (out / "bad.h5").exists() and not (out / "good.h5").exists()
    summary = json.loads((out / "features.json").read_text())
    assert [entry["slide"] for entry in summary["incomplete"]] == [good]
    monkeypatch.undo()  # the share answers again
    again = extract(index, "tests.feature_models:tiny", out, workers=1, timeout=60)
    assert (again.written, again.skipped, again.incomplete) == (1, 1, [])


def test_features_timeout_needs_workers(index: SlideIndex, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="timeout needs worker processes"):
        extract(index, "tests.feature_models:tiny", tmp_path / "f", workers=0, timeout=5)
    code = main(["features", str(index.path), "--model", "tests.feature_models:tiny",
                 "--out", str(tmp_path / "g"), "--workers", "0", "--timeout", "5"])  # fmt: skip
    assert code == 2


@pytest.mark.parametrize("spec", ["torchvision:resnet18", "timm:resnet18"])
def test_a_torchvision_that_cannot_load_is_a_config_error(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, spec: str
) -> None:
    # pip's torchvision wheel on a CPU build of torch fails on import ("operator
    # torchvision::nms does not exist"), and timm imports torchvision: a RuntimeError, not an
    # ImportError, which reached the user as a traceback
    package = tmp_path / "torchvision"
    package.mkdir()
    (package / "__init__.py").write_text(
        'raise RuntimeError("operator torchvision::nms does not exist")\n'
    )
    timm = tmp_path / "timm"
    timm.mkdir()
    (timm / "__init__.py").write_text("import torchvision\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in ("torchvision", "torchvision.models", "timm"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    with pytest.raises(ConfigError, match=r"cannot be imported.*torchvision::nms does not exist"):
        load_encoder(spec)


@pytest.fixture
def two_cases(tmp_path: Path, make_slide: Callable[..., Path]) -> tuple[SlideIndex, Path]:
    """Two different slides both named ``case`` (a/case.svs, b/case.svs), labelled by path,
    with their features extracted (``case.h5`` and ``case-s1.h5``)."""
    from wsi_loader.index import build_index

    archive = tmp_path / "archive"
    for folder, seed in (("a", 41), ("b", 42)):
        (archive / folder).mkdir(parents=True)
        source = make_slide(width=1024 if folder == "a" else 1536, height=1024, seed=seed)
        (archive / folder / "case.svs").write_bytes(source.read_bytes())
    (archive / "labels.csv").write_text("path,label\na/case.svs,normal\nb/case.svs,tumour\n")
    index = build_index(
        [archive],
        tmp_path / "idx",
        tile_size=256,
        level=0,
        min_tissue=0.0,
        root=str(archive),
        labels=str(archive / "labels.csv"),
    )
    out = tmp_path / "features"
    extract(index, "tests.feature_models:tiny", out, workers=0)
    assert sorted(p.name for p in out.glob("*.h5")) == ["case-s1.h5", "case.h5"]
    return index, out


@pytest.mark.parametrize("summary", [True, False])
def test_feature_bags_of_slides_with_one_name_stay_apart(
    two_cases: tuple[SlideIndex, Path], summary: bool
) -> None:
    """Bags are per indexed slide (by path), never merged by name: with features.json, and
    without it by the names extraction gives (the second slide of a name gets its id)."""
    index, out = two_cases
    if not summary:
        (out / "features.json").unlink()
    bags = FeatureBagDataset(out, index=index)
    assert len(bags) == 2
    items = [bags[i] for i in range(2)]
    assert [item["slide"] for item in items] == ["case", "case-s1"]  # unique, as the files
    assert [len(item["features"]) for item in items] == [s.tiles for s in index.slides]
    assert [bags.label_names[item["label"]] for item in items] == ["normal", "tumour"]
    assert bags.paths == [s.path for s in index.slides]


def test_feature_bag_labels_by_a_name_two_slides_share_are_refused(
    two_cases: tuple[SlideIndex, Path],
) -> None:
    _, out = two_cases
    with pytest.raises(InputError, match=r"case-s1\.h5") as caught:
        FeatureBagDataset(out, labels={"case": "tumour"})
    assert "index=" in str(caught.value)
    # by file name, or without labels, each file is its own bag
    bags = FeatureBagDataset(out, labels={"case": "normal", "case-s1": "tumour"})
    assert {bags[i]["slide"]: bags[i]["label"] for i in range(2)} == {"case": 0, "case-s1": 1}
    assert len(FeatureBagDataset(out)) == 2


@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_feature_bag_epochs_reach_persistent_workers(
    index: SlideIndex, tmp_path: Path, context: str
) -> None:
    """set_epoch draws other subsets in workers that outlive the epoch (persistent_workers):
    they held their own copy of the epoch (1 distinct subset over 3 epochs)."""
    out = tmp_path / "bags"
    extract(index, "tests.feature_models:tiny", out, workers=0)
    bags = FeatureBagDataset(out, index=index, max_instances=10, seed=3)
    loader = DataLoader(
        bags,
        batch_size=None,
        num_workers=2,
        persistent_workers=True,
        multiprocessing_context=context,
    )
    subsets = []
    for epoch in range(3):
        bags.set_epoch(epoch)
        subsets.append(tuple(next(iter(loader))["coords"].flatten().tolist()))
        assert subsets[-1] == tuple(bags[0]["coords"].flatten().tolist())  # as in this process
    assert len(set(subsets)) == 3
