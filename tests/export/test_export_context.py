"""Exports with context tiles: WebDataset samples get KEY.ctx1.<ext>..., read by tarfile and
Hugging Face datasets; other formats refuse them."""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from tests.conftest import SlideFactory
from wsi_loader.cli import main
from wsi_loader.dataset import TileDataset
from wsi_loader.errors import ConfigError
from wsi_loader.export import export_index
from wsi_loader.index import SlideIndex, build_index

SCALES = [(2.0, 96), (1.0, 48)]


@pytest.fixture(scope="module")
def index(tmp_path_factory: pytest.TempPathFactory, make_slide: SlideFactory) -> SlideIndex:
    out = tmp_path_factory.mktemp("export-ctx")
    slide = make_slide(width=1536, height=1024, seed=51, mpp=0.5)
    (out / "labels.csv").write_text(f"slide,label\n{slide.stem},tumour\n")
    return build_index(
        [slide],
        out / "idx",
        tile_size=128,
        mpp=0.5,
        min_tissue=0.0,
        context="2.0:96,1.0:48",
        labels=str(out / "labels.csv"),
    )


def samples(out: Path) -> dict[str, dict[str, bytes]]:
    found: dict[str, dict[str, bytes]] = {}
    for shard in sorted(out.glob("shard-*.tar")):
        with tarfile.open(shard) as tar:
            for member in tar.getmembers():
                key, field = member.name.split(".", 1)  # as webdataset splits it
                data = tar.extractfile(member)
                assert data is not None
                found.setdefault(key, {})[field] = data.read()
    return found


def test_webdataset_samples_carry_their_context_tiles(index: SlideIndex, tmp_path: Path) -> None:
    out = tmp_path / "wds"
    report = export_index(index, out, format="webdataset", image_format="png", shard_size=20)
    assert report.tiles == len(index) and report.failed == 0
    found = samples(out)
    assert len(found) == len(index)
    ds = TileDataset(index, record_failures=False)  # the index's default context
    assert ds.context == SCALES
    for fields in list(found.values())[::7]:
        assert set(fields) == {"png", "ctx1.png", "ctx2.png", "json"}
        meta = json.loads(fields["json"])
        expected = ds.read_batch([meta["row"]])
        for k, (mpp, size) in enumerate(SCALES):
            tile = np.asarray(Image.open(io.BytesIO(fields[f"ctx{k + 1}.png"])))
            assert np.array_equal(tile, expected.context[k][0].numpy())
            entry = meta["context"][k]
            ((_, x, y, level, read), box) = ds.reader.context_windows(meta["row"])[k]
            assert entry == {
                "mpp": mpp,
                "size": size,
                "x": x,
                "y": y,
                "level": level,
                "read_size": read,
                "inside": list(box),
            }
    # the same export again resumes: nothing is written twice
    again = export_index(index, out, format="webdataset", image_format="png", shard_size=20)
    assert again.units_skipped == again.units
    # other scales are another export
    with pytest.raises(ConfigError, match="different arguments"):
        export_index(index, out, format="webdataset", image_format="png", shard_size=20, context=[])


def test_the_command_line_takes_context_and_hugging_face_reads_it(
    index: SlideIndex, tmp_path: Path
) -> None:
    import datasets

    out = tmp_path / "wds"
    args = ["export", str(index.path), "--out", str(out), "--format", "webdataset"]
    assert main([*args, "--context", "4.0:32", "--image-format", "jpeg", "--no-progress"]) == 0
    assert set(next(iter(samples(out).values()))) == {"jpg", "ctx1.jpg", "json"}
    loaded = datasets.load_dataset(str(out), split="train", cache_dir=str(tmp_path / "hf"))
    assert loaded.num_rows == len(index)
    first = loaded[0]
    assert first["ctx1.jpg"].size == (32, 32) and first["jpg"].size == (128, 128)
    assert first["json"]["context"][0]["mpp"] == 4.0
    assert len(first["json"]["context"][0]["inside"]) == 4


def test_formats_without_a_place_for_context_refuse_it(index: SlideIndex, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="imagefolder export has no place for them"):
        export_index(index, tmp_path / "a", format="imagefolder", context=[(2.0, 96)])
    # the index's default context does not stop an image-folder export
    report = export_index(index, tmp_path / "b", format="imagefolder")
    assert report.tiles == len(index)
    assert not list((tmp_path / "b").rglob("*ctx*"))


def test_stain_transforms_apply_to_the_context_tiles(index: SlideIndex, tmp_path: Path) -> None:
    """The export's stain transforms give each context tile its tile's transform, as the
    dataset does."""
    from wsi_loader.stain import HEDJitter

    out = tmp_path / "stained"
    export_index(
        index, out, format="webdataset", image_format="png", stain=HEDJitter(0.1, 0.05, seed=4)
    )
    ds = TileDataset(index, record_failures=False, stain=HEDJitter(0.1, 0.05, seed=4))
    plain = TileDataset(index, record_failures=False)
    for fields in list(samples(out).values())[::9]:
        row = json.loads(fields["json"])["row"]
        expected, unstained = ds.read_batch([row]), plain.read_batch([row])
        for k in range(len(SCALES)):
            tile = np.asarray(Image.open(io.BytesIO(fields[f"ctx{k + 1}.png"])))
            assert np.array_equal(tile, expected.context[k][0].numpy())
            assert not np.array_equal(tile, unstained.context[k][0].numpy())
