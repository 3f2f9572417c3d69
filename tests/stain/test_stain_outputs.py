"""The stain options of the commands and outputs: stain, export, features, mosaic."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from tests.conftest import SlideFactory
from wsi_loader.cli.main import main
from wsi_loader.dataset import TileDataset
from wsi_loader.errors import InputError
from wsi_loader.export import export_index
from wsi_loader.index import SlideIndex, build_index
from wsi_loader.index._stain_estimates import read_reference
from wsi_loader.stain import Normalize, resolve_target
from wsi_loader.view import Mosaic

STAINS = (
    ((0.5626, 0.7201, 0.4062), (0.2159, 0.8012, 0.5581)),
    ((0.65, 0.7, 0.29), (0.3, 0.8, 0.45)),
)


@pytest.fixture(scope="module")
def two_stains(tmp_path_factory: pytest.TempPathFactory) -> SlideIndex:
    from wsi_loader.synthetic import SlideSpec, write_svs

    folder = tmp_path_factory.mktemp("two")
    for i, stain in enumerate(STAINS):
        write_svs(str(folder / f"s{i}.svs"), SlideSpec(2560, 2048, seed=10 + i, stain=stain))
    (folder / "labels.csv").write_text("slide,label\ns0,lab-a\ns1,lab-b\n")  # image folders
    labels = str(folder / "labels.csv")
    return build_index([folder], folder / "idx", tile_size=256, level=0, min_tissue=0.5,
                       labels=labels)  # fmt: skip


def test_stain_command_lists_and_writes_the_reference(
    two_stains: SlideIndex, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["stain", str(two_stains.path)]) == 0
    listed = capsys.readouterr().out
    assert listed.count(" H (") == 2
    out = tmp_path / "ref.json"
    assert main(["stain", str(two_stains.path), "--reference", "--out", str(out), "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    written, median = read_reference(out), resolve_target(two_stains)
    assert np.allclose(written.matrix(), median.matrix(), atol=1e-5)  # rounded to 6 places
    assert np.allclose(written.lab_mean, median.lab_mean, atol=1e-3)
    assert resolve_target(out) == written
    assert printed["H"] == json.loads(out.read_text())["H"]
    assert main(["stain", str(two_stains.path), "--json"]) == 0
    assert [s["stain"] is not None for s in json.loads(capsys.readouterr().out)] == [True, True]


def test_export_writes_normalised_tiles_and_records_the_target(
    two_stains: SlideIndex, tmp_path: Path
) -> None:
    target = resolve_target(two_stains.slide_path(1))
    report = export_index(two_stains, tmp_path / "out", stain=Normalize("macenko", target=target))
    assert report.tiles == len(two_stains)
    with (tmp_path / "out" / "manifest.csv").open() as fh:
        first = next(csv.DictReader(fh))
    row = int(first["row"])
    with Image.open(tmp_path / "out" / first["file"]) as png:
        exported = np.asarray(png)
    tile = TileDataset(two_stains).reader.read(np.array([row])).pixels.copy()
    op = Normalize("macenko", target=target).bind(two_stains)
    op.apply_numpy(tile, two_stains.columns["slide_id"][[row]], [row])
    # the export's target went through its JSON settings (6 decimals): +-1 grey level
    assert np.abs(exported.astype(int) - tile[0]).max() <= 1
    settings = json.loads((tmp_path / "out" / "export.json").read_text())["settings"]
    assert settings["stain"][0]["target"]["H"] == target.as_json()["H"]
    plain = export_index(two_stains, tmp_path / "plain")
    with (tmp_path / "plain" / "manifest.csv").open() as fh:
        assert next(csv.DictReader(fh))["sha256"] != first["sha256"]
    assert plain.tiles == report.tiles


def test_export_command_options(two_stains: SlideIndex, tmp_path: Path) -> None:
    ref = tmp_path / "ref.json"
    assert main(["stain", str(two_stains.path), "--reference", "--out", str(ref)]) == 0
    out = tmp_path / "out"
    args = ["export", str(two_stains.path), "--out", str(out), "--stain", "reinhard"]
    assert main([*args, "--stain-target", str(ref), "--no-progress"]) == 0
    assert (
        json.loads((out / "export.json").read_text())["settings"]["stain"][0]["method"]
        == "reinhard"
    )
    with pytest.raises(SystemExit):
        main(["export", str(two_stains.path), "--out", str(out), "--stain", "vahadane"])
    assert main(["export", str(two_stains.path), "--out", str(tmp_path / "x"),
                 "--stain-target", str(ref)]) == 2  # fmt: skip


def test_features_with_stain_differ_and_are_recomputed(
    two_stains: SlideIndex, tmp_path: Path
) -> None:
    pytest.importorskip("h5py")
    from wsi_loader.features import extract

    out = tmp_path / "features"
    extract(two_stains, "tests.feature_models:tiny", out, batch_size=16, workers=0)
    import h5py

    name = Path(two_stains.slides[0].path).stem + ".h5"
    with h5py.File(out / name) as h5:
        plain = h5["features"][:]
    target = resolve_target(two_stains.slide_path(1))
    report = extract(
        two_stains, "tests.feature_models:tiny", out, batch_size=16, workers=0,
        stain=Normalize("macenko", target=target), overwrite=True,
    )  # fmt: skip
    assert report.written == 2 and report.skipped == 0  # the stain is part of the content
    with h5py.File(out / name) as h5:
        normalised = h5["features"][:]
    assert plain.shape == normalised.shape and not np.allclose(plain, normalised)


def test_mosaic_shows_each_tile_before_and_after(
    two_stains: SlideIndex, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    mosaic = Mosaic(two_stains, 3, stain=Normalize("reinhard"))
    assert len(mosaic.rows) == 6 and list(mosaic.after) == [False, True] * 3
    assert mosaic.columns % 2 == 0
    out = tmp_path / "m.png"
    assert main(["mosaic", str(two_stains.path), "--out", str(out), "--n", "2",
                 "--stain", "macenko"]) == 0  # fmt: skip
    with Image.open(out) as image:
        assert image.size[0] > 0
    # the tiles, not the panels (each tile shows twice, before and after)
    assert f"{out}: 2 tiles, each before and after the stain transforms (0 failed to read)" in (
        capsys.readouterr().err
    )


def _manifest_hashes(folder: Path) -> list[str]:
    with (folder / "manifest.csv").open() as fh:
        return [row["sha256"] for row in csv.DictReader(fh)]


def test_the_config_files_stain_section(
    two_stains: SlideIndex, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ref = tmp_path / "ref.json"
    assert main(["stain", str(two_stains.path), "--reference", "--out", str(ref)]) == 0
    idx = str(two_stains.path)
    flags = tmp_path / "flags"
    assert main(["export", idx, "--out", str(flags), "--stain", "macenko", "--stain-target",
                 str(ref), "--no-progress"]) == 0  # fmt: skip
    config = tmp_path / "c.yaml"
    config.write_text(f"stain:\n  normalize: macenko\n  target: {ref}\n")
    from_file = tmp_path / "file"
    assert main(["export", idx, "--out", str(from_file), "--config", str(config),
                 "--no-progress"]) == 0  # fmt: skip
    assert _manifest_hashes(from_file) == _manifest_hashes(flags)
    # the flags override the file's normalize and target
    config.write_text("stain:\n  normalize: reinhard\n  target: elsewhere.png\n")
    both = tmp_path / "both"
    assert main(["export", idx, "--out", str(both), "--config", str(config), "--stain",
                 "macenko", "--stain-target", str(ref), "--no-progress"]) == 0  # fmt: skip
    assert _manifest_hashes(both) == _manifest_hashes(flags)
    # mosaic and features read it too (--config): normalisation, then the augmentations
    config.write_text(f"stain:\n  normalize: macenko\n  target: {ref}\n  augment:\n"
                      "  - hed_jitter: {sigma: 0.2, bias: 0.1}\n  seed: 3\n")  # fmt: skip
    pictures = {}
    for name, extra in (("flags", ["--stain", "macenko", "--stain-target", str(ref)]),
                        ("file", ["--config", str(config)])):  # fmt: skip
        out = tmp_path / f"{name}.png"
        assert main(["mosaic", idx, "--out", str(out), "--n", "2", *extra]) == 0
        with Image.open(out) as image:
            pictures[name] = np.asarray(image).astype(int)
    assert pictures["flags"].shape == pictures["file"].shape
    assert np.abs(pictures["flags"] - pictures["file"]).max() > 10  # jittered after
    # a bad section is refused naming the file and the key
    config.write_text("stain:\n  normalise: macenko\n")
    for command in (["mosaic", idx, "--out", str(tmp_path / "m.png")],
                    ["features", idx, "--model", "tests.feature_models:tiny", "--out",
                     str(tmp_path / "f")]):  # fmt: skip
        capsys.readouterr()
        assert main([*command, "--config", str(config)]) == 2
        said = capsys.readouterr().err
        assert "unknown key 'stain.normalise' (did you mean 'normalize'?)" in said


def test_stain_from_config_builds_the_transforms_in_order() -> None:
    from tests.conftest import REPO
    from wsi_loader.config import load_config
    from wsi_loader.stain import HEDJitter, StainJitter, stain_from_config

    config = load_config(REPO / "configs" / "stain.yaml").stain
    steps = stain_from_config(config)
    assert steps is not None and [type(s) for s in steps] == [Normalize, HEDJitter, StainJitter]
    normalize, hed, jitter = steps
    assert isinstance(normalize, Normalize) and normalize.target == "ref.json"
    assert isinstance(hed, HEDJitter) and (hed.sigma, hed.bias, hed.seed) == (0.03, 0.03, 7)
    assert isinstance(jitter, StainJitter) and (jitter.sigma, jitter.seed) == (0.05, 8)
    overridden = stain_from_config(config, "reinhard", "other.json")
    assert overridden is not None and isinstance(overridden[0], Normalize)
    assert (overridden[0].method, overridden[0].target) == ("reinhard", "other.json")
    assert stain_from_config(type(config)()) is None


def test_predict_features_and_export_record_the_stain_as_a_json_object(
    two_stains: SlideIndex, tmp_path: Path
) -> None:
    from wsi_loader.features import extract
    from wsi_loader.predict._run import predict

    pytest.importorskip("h5py")
    target = resolve_target(two_stains.slide_path(1))
    stain = Normalize("macenko", target=target)
    wanted = [{"transform": "normalize", "method": "macenko", "per_tile": False,
               "target": stain.bind(two_stains).spec()["target"]}]  # fmt: skip
    predict(two_stains, "tests.feature_models:classifier", tmp_path / "p", workers=0,
            heatmaps=False, stain=stain)  # fmt: skip
    extract(two_stains, "tests.feature_models:tiny", tmp_path / "f", workers=0, stain=stain)
    export_index(two_stains, tmp_path / "e", stain=stain)
    assert json.loads((tmp_path / "p" / "predict.json").read_text())["stain"] == wanted
    assert json.loads((tmp_path / "f" / "features.json").read_text())["stain"] == wanted
    export = json.loads((tmp_path / "e" / "export.json").read_text())["settings"]["stain"]
    assert export[0]["method"] == "macenko"
    assert np.allclose(export[0]["target"]["H"], wanted[0]["target"]["H"], atol=1e-6)
    # without a stain: null, in all three
    predict(two_stains, "tests.feature_models:classifier", tmp_path / "p0", workers=0,
            heatmaps=False)  # fmt: skip
    assert json.loads((tmp_path / "p0" / "predict.json").read_text())["stain"] is None


def test_an_export_begun_when_the_stain_was_a_json_string_resumes(
    two_stains: SlideIndex, tmp_path: Path
) -> None:
    from wsi_loader.export._folder import SETTINGS_FILE, read_settings

    out = tmp_path / "e"
    first = export_index(two_stains, out, stain=Normalize("reinhard"))
    settings = json.loads((out / SETTINGS_FILE).read_text())
    older = {**settings, "stain": json.dumps(settings["stain"], sort_keys=True)}
    (out / SETTINGS_FILE).write_text(json.dumps(older, sort_keys=True))  # as older versions did
    assert read_settings(out) == settings
    again = export_index(two_stains, out, stain=Normalize("reinhard"))
    assert again.tiles == first.tiles and again.units_skipped == again.units


@pytest.fixture(scope="module")
def one_unestimated(tmp_path_factory: pytest.TempPathFactory) -> SlideIndex:
    """A stained slide and a blank one (tiles, but no stain estimate)."""
    from wsi_loader.synthetic import SlideSpec, write_svs

    folder = tmp_path_factory.mktemp("blank")
    write_svs(str(folder / "a.svs"), SlideSpec(1024, 1024, seed=1, stain=STAINS[0]))
    write_svs(str(folder / "b.svs"), SlideSpec(1024, 1024, seed=2, tissue=0.0))
    index = build_index([folder], folder / "idx", tile_size=256, level=0, min_tissue=0.0)
    assert [s.stain is None for s in index.slides] == [False, True]
    return index


@pytest.mark.parametrize("command", ["predict", "features", "export"])
def test_the_slides_without_a_stain_estimate_are_named_once_a_run(
    one_unestimated: SlideIndex, tmp_path: Path, caplog: pytest.LogCaptureFixture, command: str
) -> None:
    if command == "features":
        pytest.importorskip("h5py")
    args = {
        "predict": ["--model", "tests.feature_models:classifier", "--workers", "0"],
        "features": ["--model", "tests.feature_models:tiny", "--workers", "0"],
        "export": ["--format", "webdataset", "--shard-size", "4", "--workers", "1"],
    }[command]
    out = str(tmp_path / "out")
    code = main([command, str(one_unestimated.path), "--out", out, "--no-progress",
                 "--stain", "macenko", *args])  # fmt: skip
    assert code == 0
    said = [r.getMessage() for r in caplog.records if "no stain estimate" in r.getMessage()]
    assert len(said) == 1, said
    assert said[0].startswith(f"1 slides have no stain estimate ({one_unestimated.slides[1].path})")


def test_a_target_that_is_not_h_and_e_is_refused(
    make_slide: SlideFactory,
    two_stains: SlideIndex,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A fluorescence slide or an image without two H&E-like stains gives no target (the
    index flags such slides; a target from them darkened every tile, silently)."""
    dark = make_slide(width=3000, height=2000, seed=3, dark_field=True)
    with pytest.raises(InputError, match="fluorescence") as caught:
        resolve_target(str(dark))
    assert caught.value.path == str(dark)
    # two inks that are not H&E's (green and yellow pen), mixed by Beer-Lambert: most of
    # its pixels are green ink, which is no stain, and the rest are not H&E's
    rng = np.random.default_rng(0)
    inks = np.array([[0.8, 0.2, 0.8], [0.1, 0.2, 0.95]])
    inks /= np.linalg.norm(inks, axis=1, keepdims=True)
    od = rng.uniform(0, 1.2, (64 * 64, 2)) @ inks
    pens = np.clip(240 * np.exp(-od), 0, 255).astype(np.uint8).reshape(64, 64, 3)
    image = tmp_path / "pens.png"
    Image.fromarray(pens).save(image)
    refused = r"not an H&E stain|not separable|too little stained tissue"
    with pytest.raises(InputError, match=refused):
        resolve_target(str(image))
    with pytest.raises(InputError, match=refused):
        resolve_target(pens)
    out = tmp_path / "ref.json"
    code = main(["stain", str(two_stains.path), "--reference", "--target", str(dark),
                 "--out", str(out)])  # fmt: skip
    err = capsys.readouterr().err
    assert code == 2 and "fluorescence" in err and str(dark) in err
    assert not out.exists()
