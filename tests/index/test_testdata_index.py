"""Every third-party slide is indexed, or rejected with the reason the testdata README gives."""

from __future__ import annotations

from pathlib import Path

import pytest

from wsi_loader.index import build_index

pytestmark = pytest.mark.testdata

# at 0.5 um/px: file -> (status, substring of error or warning, tiles > 0)
AT_MPP = {
    "CMU-1-Small-Region.svs": ("ok", None, True),
    "small.svs": ("ok", "smaller than one tile", False),
    "unreadable.svs": ("ok", "smaller than one tile", False),
    "dicom-boxes/boxes_0.dcm": ("ok", "smaller than one tile", False),
    "test3-DAPI-2-(387).ndpi": ("ok", "8.7% from the target", True),
    # a fluorescence TMA core: found by intensity (dark field), not by colour
    "small_vectra.qptiff": ("ok", "3 channels (CYX); only channel 0 is read, as grey", True),
    "tcga-cr-7395-01a-01-ts1.svs": ("failed", "no MPP", False),
    "kidney-48-5.tif": ("failed", "no MPP", False),
    "boxes.tiff": ("failed", "not a microscope resolution", False),
    "boxes_noicc.tiff": ("failed", "not a microscope resolution", False),
    "yb10kx5k.zstd.tiff": ("failed", "not a microscope resolution", False),
    "small_la.tiff": ("failed", "not a microscope resolution", False),
    "broken.svs": ("failed", "Unsupported or missing image file", False),
    "unopenable.tiff": ("failed", "Unsupported TIFF compression: 52479", False),
    "dicom-no-imagetype/small_dicom.dcm": ("failed", "Couldn't get image flavor", False),
}


@pytest.fixture(scope="module")
def index_at_mpp(testdata: Path, tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    return build_index(
        [testdata],
        tmp_path_factory.mktemp("idx"),
        tile_size=256,
        mpp=0.5,
        min_tissue=0.25,
        root=str(testdata),
    )


def test_every_file_is_accounted_for(index_at_mpp, testdata: Path) -> None:  # type: ignore[no-untyped-def]
    assert {s.path for s in index_at_mpp.slides} == set(AT_MPP)


@pytest.mark.parametrize("name", sorted(AT_MPP))
def test_indexed_or_rejected_with_reason(index_at_mpp, name: str) -> None:  # type: ignore[no-untyped-def]
    status, text, has_tiles = AT_MPP[name]
    record = next(s for s in index_at_mpp.slides if s.path == name)
    assert record.status == status
    if text:
        assert text in (record.error or record.warning or ""), record
    assert (record.tiles > 0) == has_tiles


def test_info_text_shows_each_slides_warning(
    index_at_mpp, capsys: pytest.CaptureFixture[str]
) -> None:  # type: ignore[no-untyped-def]
    from wsi_loader.cli import main

    assert main(["info", str(index_at_mpp.path)]) == 0
    text = capsys.readouterr().out
    for needle in (
        "warning: the slide is smaller than one tile",
        "8.7% from the target",
        "only channel 0 is read",
        "error: OpenSlide: Unsupported TIFF compression: 52479",
    ):
        assert needle in text


def test_info_piped_into_head_ends_quietly(index_at_mpp) -> None:  # type: ignore[no-untyped-def]
    import subprocess
    import sys

    done = subprocess.run(
        f"{sys.executable} -m wsi_loader.cli info {index_at_mpp.path} --json | head -1",
        shell=True,
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0 and done.stdout.strip() == "{"
    assert done.stderr == "", done.stderr


def test_level_mode_indexes_slides_without_usable_mpp(testdata: Path, tmp_path: Path) -> None:
    names = ["tcga-cr-7395-01a-01-ts1.svs", "kidney-48-5.tif", "boxes.tiff", "yb10kx5k.zstd.tiff"]
    index = build_index(
        [testdata / n for n in names], tmp_path / "idx", level=0, tile_size=64, min_tissue=0.1
    )
    assert all(s.status == "ok" and s.tiles > 0 for s in index.slides), index.slides
    kidney = next(s for s in index.slides if s.path.endswith("kidney-48-5.tif"))
    assert kidney.backend == "tiff"
    jp2k = next(s for s in index.slides if s.path.endswith(".svs"))
    assert jp2k.level_count == 2 and jp2k.mpp is None
    too_deep = build_index([testdata / "boxes.tiff"], tmp_path / "idx2", level=4)
    assert "level 4 requested but the slide has 4 level(s)" in (too_deep.slides[0].error or "")


# --mag X on the third-party slides: the level a pathologist would read (the table in
# docs/journeys/magnification-and-context.md). file -> {mag: (level, window px for 64 px
# tiles, tile mag)}; None: refused (the scan is coarser than asked, or the slide states
# neither objective nor MPP)
AT_MAG = {
    # Aperio 20x, 0.499 um/px, one level: 20x as stored; 10x and 5x shrink level 0
    "CMU-1-Small-Region.svs": {40: None, 20: (0, 64, 20), 10: (0, 128, 10), 5: (0, 256, 5)},
    # Hamamatsu 40x at 0.228 um/px, downsamples 1..64: every magnification is a stored level
    "test3-DAPI-2-(387).ndpi": {40: (0, 64, 40), 20: (1, 64, 20), 10: (2, 64, 10), 5: (3, 64, 5)},
    # Vectra: no objective power, 0.4965 um/px: 20x = 0.5 um/px by 10 / mag
    "small_vectra.qptiff": {40: None, 20: (0, 64, 20.1), 10: (0, 129, 9.99), 5: (0, 258, 5.0)},
    # JPEG 2000 TCGA cut-out: neither MPP nor objective power
    "tcga-cr-7395-01a-01-ts1.svs": {40: None, 20: None, 10: None, 5: None},
}


@pytest.mark.parametrize("mag", [40, 20, 10, 5])
def test_mag_picks_the_level_a_pathologist_would(testdata: Path, tmp_path: Path, mag: int) -> None:
    index = build_index(
        [testdata / n for n in AT_MAG], tmp_path / "idx", tile_size=64, mag=mag, min_tissue=0.0
    )
    assert index.params["mag"] == mag and index.params["mpp"] is None
    for record in index.slides:
        expected = AT_MAG[Path(record.path).name][mag]
        if expected is None:
            assert record.status == "failed", record
            continue
        level, window, tile_mag = expected
        assert (record.status, record.read_level, record.read_size) == ("ok", level, window)
        assert record.tile_mag == pytest.approx(tile_mag, rel=0.01)
        assert record.tile_mpp is not None  # both are recorded
    failed = {Path(s.path).name: s.error or "" for s in index.slides if s.status == "failed"}
    assert (
        "states no objective power, and the slide has no MPP"
        in failed["tcga-cr-7395-01a-01-ts1.svs"]
    )
    if mag == 40:
        assert "resolution 20x is coarser than the target 40x" in failed["CMU-1-Small-Region.svs"]
