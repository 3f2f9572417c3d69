"""One embedding per slide from a features folder (`wsi-loader slide-embeddings`)."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch

from tests.models.slide_peers import chief_state, peer_chief, peer_root, write_features
from wsi_loader.cli import main
from wsi_loader.errors import ConfigError
from wsi_loader.features import EMBEDDINGS_CSV, EMBEDDINGS_H5, embed_slides, extract
from wsi_loader.index import SlideIndex
from wsi_loader.models import slide_encoder


@pytest.fixture
def weights(tmp_path: Path) -> Path:
    path = tmp_path / "CHIEF_pretraining.pth"
    torch.save(chief_state(), path)
    return path


def read_back(out: Path) -> tuple[dict[str, np.ndarray], list[dict[str, str]], dict[str, object]]:
    with h5py.File(out / EMBEDDINGS_H5, "r") as h5:
        slides = [s.decode() for s in h5["slides"][()]]
        embeddings = dict(zip(slides, h5["embeddings"][()], strict=True))
        attrs = dict(h5.attrs)
    with open(out / EMBEDDINGS_CSV, newline="") as f:
        rows = list(csv.DictReader(f))
    return embeddings, rows, attrs


def test_features_folder_in_embeddings_and_index_out(tmp_path: Path, weights: Path) -> None:
    features = tmp_path / "features"
    bags = {
        name: write_features(features, name, n, seed=k)
        for k, (name, n) in enumerate([("a", 12), ("b", 40), ("c", 1)])
    }
    write_features(features, "empty", 0)
    out = tmp_path / "out"
    report = embed_slides(features, "chief", out, weights=weights, device="cpu")
    assert (report.written, report.skipped, report.empty, report.failures) == (3, 0, 1, [])
    embeddings, rows, attrs = read_back(out)
    assert attrs["slide_encoder"] == "chief" and attrs["patch_encoder"] == "ctranspath"
    assert attrs["dim"] == 768
    model = slide_encoder("chief", weights=weights)
    for name, (feats, coords) in bags.items():
        with torch.inference_mode():
            expected = model(torch.from_numpy(feats), torch.from_numpy(coords), 1024).numpy()
        assert embeddings[name].dtype == np.float32 and embeddings[name].shape == (768,)
        np.testing.assert_allclose(embeddings[name], expected, atol=1e-6)
    assert [r["slide"] for r in rows] == ["a", "b", "c", "empty"]
    by_name = {r["slide"]: r for r in rows}
    assert by_name["b"] == {
        "slide": "b",
        "row": "1",
        "width": "768",
        "tiles": "40",
        "patch_encoder": "ctranspath",
        "slide_encoder": "chief",
        "status": "ok",
        "features_file": str(features / "b.h5"),
    }
    # the slide without tiles is recorded, without a row
    assert by_name["empty"]["status"] == "no tiles" and by_name["empty"]["row"] == ""
    assert by_name["empty"]["tiles"] == "0" and "empty" not in embeddings


def test_a_rerun_keeps_unchanged_slides_and_redoes_changed_ones(
    tmp_path: Path, weights: Path
) -> None:
    features, out = tmp_path / "features", tmp_path / "out"
    for k, name in enumerate("abc"):
        write_features(features, name, 10 + k, seed=k)
    embed_slides(features, "chief", out, weights=weights, device="cpu")
    before, _, _ = read_back(out)
    report = embed_slides(features, "chief", out, weights=weights, device="cpu")
    assert (report.written, report.skipped) == (0, 3)
    write_features(features, "b", 20, seed=9)  # new features for b (another content)
    report = embed_slides(features, "chief", out, weights=weights, device="cpu")
    assert (report.written, report.skipped) == (1, 2)
    after, rows, _ = read_back(out)
    np.testing.assert_array_equal(after["a"], before["a"])
    assert not np.allclose(after["b"], before["b"])
    assert {r["slide"]: r["tiles"] for r in rows} == {"a": "10", "b": "20", "c": "12"}
    # other weights: every slide again
    other = tmp_path / "other.pth"
    torch.save(chief_state(5), other)
    report = embed_slides(features, "chief", out, weights=other, device="cpu")
    assert (report.written, report.skipped) == (3, 0)


def test_features_of_another_patch_encoder_are_refused_before_anything_runs(
    tmp_path: Path, weights: Path
) -> None:
    features, out = tmp_path / "features", tmp_path / "out"
    write_features(features, "a", 5)
    write_features(features, "b", 5, model="encoder:uni_v2", dim=1024)
    with pytest.raises(
        ConfigError,
        match=r"b\.h5 holds features of encoder:uni_v2, but slide "
        "encoder chief takes those of patch encoder ctranspath",
    ):
        embed_slides(features, "chief", out, weights=weights, device="cpu")
    assert not (out / EMBEDDINGS_H5).exists()
    # checked before the weights are looked for
    with pytest.raises(ConfigError, match="encoder:uni_v2"):
        embed_slides(features, "chief", out, device="cpu")


def test_an_unreadable_file_is_a_failed_slide_and_the_others_are_written(
    tmp_path: Path, weights: Path
) -> None:
    features, out = tmp_path / "features", tmp_path / "out"
    write_features(features, "a", 5)
    (features / "broken.h5").write_bytes(b"\x89HDF\r\n\x1a\n truncated")
    code = main(
        [
            "slide-embeddings",
            str(features),
            "--model",
            "chief",
            "--weights",
            str(weights),
            "--out",
            str(out),
            "--device",
            "cpu",
        ]
    )
    assert code == 1  # some slide failed: see the CSV
    embeddings, rows, _ = read_back(out)
    assert list(embeddings) == ["a"]
    broken = next(r for r in rows if r["slide"] == "broken")
    assert broken["status"].startswith("failed: unreadable") and broken["row"] == ""


def test_another_slide_encoders_output_is_kept_unless_overwrite(
    tmp_path: Path, weights: Path
) -> None:
    features, out = tmp_path / "features", tmp_path / "out"
    write_features(features, "a", 5)
    out.mkdir()
    with h5py.File(out / EMBEDDINGS_H5, "w") as h5:
        h5.attrs["slide_encoder"] = "titan"
        h5.create_dataset("slides", data=np.array(["a"], dtype=object), dtype=h5py.string_dtype())
        h5.create_dataset("content", data=np.array(["x"], dtype=object), dtype=h5py.string_dtype())
        h5.create_dataset("embeddings", data=np.zeros((1, 768), np.float32))
    with pytest.raises(ConfigError, match="embeddings of slide encoder titan, not chief"):
        embed_slides(features, "chief", out, weights=weights, device="cpu")
    report = embed_slides(features, "chief", out, weights=weights, device="cpu", overwrite=True)
    assert report.written == 1 and read_back(out)[2]["slide_encoder"] == "chief"


def test_cli_lists_slide_encoders_and_refuses_one_not_wired(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["encoders", "--slide", "--json"]) == 0
    listed = {r["name"]: r for r in json.loads(capsys.readouterr().out)}
    assert listed["chief"]["wired"] and listed["chief"]["patch_encoder"] == "ctranspath"
    assert listed["titan"]["wired"] and listed["titan"]["mpp"] == 0.5
    assert listed["titan"]["patch_size"] == 512 and listed["prism"]["patch_encoder"] == "virchow"
    assert not listed["prism"]["wired"]
    assert main(["encoders", "--slide"]) == 0
    assert "not yet" in capsys.readouterr().out
    features = tmp_path / "features"
    write_features(features, "a", 5, model="encoder:virchow", dim=2560)
    code = main(["slide-embeddings", str(features), "--model", "prism", "--out", str(tmp_path)])
    assert code == 2
    assert "slide encoder prism" in capsys.readouterr().err


def titan_weights(tmp_path: Path) -> Path:
    from tests.models.test_slide_encoders import titan_file, titan_state

    return titan_file(tmp_path, titan_state())


def test_titan_takes_conch_v15_features_of_512_px_tiles_at_20x(tmp_path: Path) -> None:
    weights, out = titan_weights(tmp_path), tmp_path / "out"
    at_10x = tmp_path / "at_10x"
    write_features(at_10x, "a", 5, model="encoder:conch_v15", patch_size=512, mpp=1.0)
    with pytest.raises(ConfigError, match=r"tiles at 1 um/px, not 0\.5.*titan"):
        embed_slides(at_10x, "titan", out, weights=weights, device="cpu")
    small = tmp_path / "small"
    write_features(small, "a", 5, model="encoder:conch_v15", patch_size=256, mpp=0.5)
    with pytest.raises(ConfigError, match="256 px tiles, not 512"):
        embed_slides(small, "titan", out, weights=weights, device="cpu")
    unsized = tmp_path / "unsized"
    write_features(
        unsized, "a", 5, model="encoder:conch_v15", patch_size=512, mpp=0.5, patch_size_level0=None
    )
    with pytest.raises(ConfigError, match="no patch_size_level0"):
        embed_slides(unsized, "titan", out, weights=weights, device="cpu")
    # the level-0 size given for files that lack it; a slide of one tile
    write_features(
        unsized,
        "one",
        1,
        model="encoder:conch_v15",
        patch_size=512,
        mpp=0.5,
        patch_size_level0=None,
    )
    report = embed_slides(
        unsized, "titan", out, weights=weights, device="cpu", patch_size_level0=1024
    )
    assert report.written == 2
    embeddings, rows, attrs = read_back(out)
    assert attrs["patch_encoder"] == "conch_v15" and embeddings["one"].shape == (768,)
    assert {r["status"] for r in rows} == {"ok"}


def test_embeddings_equal_chiefs_own_code(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = peer_root("CHIEF")
    torch.manual_seed(1)
    peer = peer_chief(root, tmp_path / "peer", monkeypatch)
    path = tmp_path / "CHIEF_pretraining.pth"
    torch.save(peer.state_dict(), path)
    features = tmp_path / "features"
    bags = {name: write_features(features, name, n, seed=n) for name, n in [("x", 3), ("y", 90)]}
    embed_slides(features, "chief", tmp_path / "out", weights=path, device="cpu")
    embeddings, _, _ = read_back(tmp_path / "out")
    for name, (feats, _) in bags.items():
        with torch.inference_mode():
            theirs = peer(torch.from_numpy(feats), torch.tensor([0]))["WSI_feature"][0].numpy()
        np.testing.assert_allclose(embeddings[name], theirs, atol=1e-5, rtol=0)


def test_features_files_say_the_level0_patch_size(index: SlideIndex, tmp_path: Path) -> None:
    extract(index, "tests.feature_models:tiny", tmp_path / "f", batch_size=16)
    for record in index.slides:
        with h5py.File(tmp_path / "f" / f"{Path(record.path).stem}.h5", "r") as h5:
            expected = round(record.read_size * record.read_downsample)
            assert h5.attrs["patch_size_level0"] == expected
            assert h5["coords"].attrs["patch_size_level0"] == expected


def test_a_slide_off_the_encoders_grid_is_a_failed_slide(tmp_path: Path) -> None:
    from tests.models.encoder_weights import seeded_like
    from tests.models.test_slide_encoders import gigapath_file
    from wsi_loader.models._slide_encoders import build_slide_encoder, slide_recipe_of

    net = build_slide_encoder(slide_recipe_of("gigapath_slide"), device="cpu").net
    weights = gigapath_file(tmp_path, seeded_like(net.state_dict(), fan_in=True))
    features, out = tmp_path / "features", tmp_path / "out"
    for name in ("small", "huge"):
        write_features(
            features, name, 3, model="encoder:gigapath", dim=1536, mpp=0.5, patch_size_level0=256
        )
    # Prov-GigaPath's grid is 1000 tiles a side: a slide reaching past it is refused
    with h5py.File(features / "huge.h5", "r+") as h5:
        h5["coords"][:, 0] += 256 * 1000
    report = embed_slides(features, "gigapath", out, weights=weights, device="cpu")
    assert report.written == 1 and [f["slide"] for f in report.failures] == ["huge"]
    _, rows, _ = read_back(out)
    assert "1000 x 1000 tile grid" in next(r for r in rows if r["slide"] == "huge")["status"]


def test_a_level0_patch_size_that_would_be_ignored_is_refused(
    tmp_path: Path, weights: Path
) -> None:
    """patch_size_level0 (--patch-size-level0) is for files that do not say it: one that says
    another was read and the option silently ignored, as it was for a slide encoder that
    reads no positions (CHIEF)."""
    sized = tmp_path / "sized"
    write_features(sized, "a", 5, model="encoder:conch_v15", patch_size=512, mpp=0.5)
    out = tmp_path / "out"
    with pytest.raises(ConfigError, match="patch_size_level0") as caught:
        embed_slides(sized, "titan", out, weights=titan_weights(tmp_path), patch_size_level0=2048)
    assert str(sized / "a.h5") in str(caught.value) and "1024" in str(caught.value)
    chief = tmp_path / "chief"
    write_features(chief, "a", 5)
    with pytest.raises(ConfigError, match="patch_size_level0") as caught:
        embed_slides(chief, "chief", out, weights=weights, patch_size_level0=1024)
    assert "positions" in str(caught.value)
    assert not out.exists()
