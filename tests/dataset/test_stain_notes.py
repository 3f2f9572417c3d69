"""What a dataset says about the stain of the slides it reads: slides without a stain estimate
are named once, and only those the dataset reads."""

from __future__ import annotations

import pytest

from wsi_loader.dataset import TileDataset, make_loader
from wsi_loader.index import SlideIndex, build_index
from wsi_loader.stain import Normalize
from wsi_loader.synthetic import SlideSpec, write_svs


@pytest.fixture(scope="module")
def split_index(tmp_path_factory: pytest.TempPathFactory) -> SlideIndex:
    """Two stained slides in train, and two blank ones (tiles, no stain estimate) in val."""
    folder = tmp_path_factory.mktemp("splits")
    rows = ["path,label,split"]
    for name, seed, tissue, split in (
        ("a.svs", 1, 0.6, "train"),
        ("b.svs", 2, 0.6, "train"),
        ("c.svs", 3, 0.0, "val"),
        ("d.svs", 4, 0.0, "val"),
    ):
        write_svs(str(folder / name), SlideSpec(1024, 1024, seed=seed, tissue=tissue))
        rows.append(f"{name},x,{split}")
    manifest = folder / "slides.csv"
    manifest.write_text("\n".join(rows) + "\n")
    index = build_index([manifest], folder / "idx", tile_size=256, level=0, min_tissue=0.0)
    assert [s.stain is None for s in index.slides] == [False, False, True, True]
    return index


def _said(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "no stain estimate" in r.getMessage()]


def test_slides_without_a_stain_estimate_are_named_only_where_read(
    split_index: SlideIndex, caplog: pytest.LogCaptureFixture
) -> None:
    """A train loader holds neither blank slide: it says nothing (it used to say "2 slides
    have no stain estimate"); a val loader names them, once."""
    with caplog.at_level("WARNING"):
        make_loader(split_index, split="train", stain=Normalize("macenko"), num_workers=0)
        TileDataset(split_index, split="train", stain=Normalize("reinhard"))
    assert _said(caplog) == []
    with caplog.at_level("WARNING"):
        loader = make_loader(split_index, split="val", stain=Normalize("macenko"), num_workers=0)
        sum(len(batch.ok) for batch in loader)
    said = _said(caplog)
    assert len(said) == 1, said
    assert said[0].startswith("2 slides have no stain estimate (")
    assert "c.svs" in said[0] and "d.svs" in said[0] and "a.svs" not in said[0]
