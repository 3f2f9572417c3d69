"""Features of context tiles: per scale beside the tiles' own, or concatenated."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.conftest import SlideFactory
from tests.feature_models import PoolLinear
from wsi_loader.cli import main
from wsi_loader.dataset import TileDataset
from wsi_loader.features import extract
from wsi_loader.index import SlideIndex, build_index

h5py = pytest.importorskip("h5py")
SCALES = [(2.0, 64), (1.0, 48)]


@pytest.fixture(scope="module")
def index(tmp_path_factory: pytest.TempPathFactory, make_slide: SlideFactory) -> SlideIndex:
    out = tmp_path_factory.mktemp("features-ctx")
    slide = make_slide(width=1024, height=768, seed=61, mpp=0.5)
    return build_index([slide], out / "idx", tile_size=64, mpp=0.5, min_tissue=0.0)


def expected(index: SlideIndex, rows: list[int]) -> list[np.ndarray]:
    """The model (pixels / 255 at the read size) on the tiles and each scale's tiles."""
    batch = TileDataset(index, context=SCALES, record_failures=False).read_batch(rows)
    model = PoolLinear().eval()
    with torch.inference_mode():
        return [
            model(tiles.permute(0, 3, 1, 2).float() / 255).numpy()
            for tiles in [batch.images, *(batch.context or [])]
        ]


def test_separate_features_per_scale(index: SlideIndex, tmp_path: Path) -> None:
    out = tmp_path / "separate"
    report = extract(index, PoolLinear(), out, device="cpu", workers=0, context=SCALES)
    assert report.written == 1 and report.dim == 16
    with h5py.File(next(out.glob("*.h5")), "r") as h5:
        layout = json.loads(h5.attrs["context"])
        assert layout["layout"] == "separate"
        assert layout["datasets"] == ["features", "features_ctx1", "features_ctx2"]
        assert layout["scales"] == [{"mpp": 2.0, "size": 64}, {"mpp": 1.0, "size": 48}]
        stored = [h5[name][:] for name in layout["datasets"]]
        assert dict(h5["features_ctx2"].attrs) == {"mpp": 1.0, "size": 48}
        coords = h5["coords"][:]
    rows = [
        int(np.flatnonzero((index.columns["l0_x"] == x) & (index.columns["l0_y"] == y))[0])
        for x, y in coords.tolist()
    ]
    for got, want in zip(stored, expected(index, rows), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    # without context, `features` is the same: CLAM's and TRIDENT's readers see no change
    plain = tmp_path / "plain"
    extract(index, PoolLinear(), plain, device="cpu", workers=0)
    with h5py.File(next(plain.glob("*.h5")), "r") as h5:
        np.testing.assert_array_equal(h5["features"][:], stored[0])
        assert "context" not in h5.attrs and "features_ctx1" not in h5


def test_concatenated_features_and_the_command_line(index: SlideIndex, tmp_path: Path) -> None:
    out = tmp_path / "concat"
    args = ["features", str(index.path), "--model", "tests.feature_models:plain"]
    args += ["--out", str(out), "--device", "cpu", "--workers", "0", "--no-progress"]
    assert main([*args, "--context", "2.0:64,1.0:48", "--context-features", "concat"]) == 0
    with h5py.File(next(out.glob("*.h5")), "r") as h5:
        features, coords = h5["features"][:], h5["coords"][:]
        assert json.loads(h5.attrs["context"])["layout"] == "concat"
        assert "features_ctx1" not in h5
    assert features.shape == (len(index), 3 * 16)
    summary = json.loads((out / "features.json").read_text())
    assert summary["dim"] == 3 * 16  # the width of `features`, as CLAM's readers see it
    assert summary["context"]["layout"] == "concat"
    rows = [
        int(np.flatnonzero((index.columns["l0_x"] == x) & (index.columns["l0_y"] == y))[0])
        for x, y in coords.tolist()
    ]
    np.testing.assert_allclose(
        features, np.concatenate(expected(index, rows), axis=1), rtol=1e-5, atol=1e-5
    )
    # another layout is other content: written again (with --overwrite), not skipped
    assert main([*args, "--context", "2.0:64,1.0:48"]) == 2
    assert main([*args, "--context", "2.0:64,1.0:48", "--overwrite"]) == 0
    summary = json.loads((out / "features.json").read_text())
    assert summary["written"] == 1 and summary["skipped"] == 0
    assert main([*args, "--context", "2.0:64,1.0:48"]) == 0
    assert json.loads((out / "features.json").read_text())["skipped"] == 1


def test_concatenated_features_without_context_tiles_are_refused(
    index: SlideIndex, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """With no context scales (none given, none in the index), ``concat`` has nothing to
    concatenate: it was silently ignored (plain features written)."""
    from wsi_loader.errors import ConfigError

    with pytest.raises(ConfigError, match="context_features") as caught:
        extract(index, "tests.feature_models:plain", tmp_path / "lib", context_features="concat")
    assert "no context" in str(caught.value)
    assert not (tmp_path / "lib").exists()
    out = tmp_path / "cli"
    args = ["features", str(index.path), "--model", "tests.feature_models:plain"]
    args += ["--out", str(out), "--workers", "0", "--no-progress"]
    code = main([*args, "--context-features", "concat"])
    assert code == 2
    err = capsys.readouterr().err
    assert "--context-features" in err and "--context" in err and str(index.path) in err
    assert not out.exists()
