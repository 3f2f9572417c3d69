"""Patch encoders by name: the registry, building on the meta device, weights offline first
(given file or folder, the Hugging Face cache; never a download here), refusals that name the
repo or the first mismatching key, and features equal to an independent computation."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import openslide
import pytest
import torch

from tests.conftest import REPO, SlideFactory
from tests.models.encoder_weights import resnet50_layer3_pooled, resnet50_state, write_safetensors
from wsi_loader.errors import ConfigError, WeightsError
from wsi_loader.index import SlideIndex, build_index
from wsi_loader.models import ENCODERS, encoder
from wsi_loader.models._encoder_recipes import RECIPES, Recipe
from wsi_loader.models._encoder_weights import read_safetensors
from wsi_loader.models._encoders import build

ISSUE_NAMES = {
    "uni_v1", "uni_v2", "conch_v1", "conch_v15", "virchow", "virchow2", "hoptimus0",
    "hoptimus1", "h0_mini", "gigapath", "phikon", "phikon_v2", "hibou_b", "hibou_l",
    "midnight", "ctranspath", "musk", "lunit_vits8", "resnet50_trunc",
}  # fmt: skip
IMAGENET_MEAN = torch.tensor([0.485, 0.456, 0.406]).view(1, 3, 1, 1)
IMAGENET_STD = torch.tensor([0.229, 0.224, 0.225]).view(1, 3, 1, 1)


def cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """The command in a fresh process, with an empty Hugging Face cache and the hub off
    unless ``env`` says otherwise (nothing is ever downloaded by a test)."""
    full = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "wsi_loader.cli", *args],
        check=False,
        capture_output=True,
        text=True,
        env=full,
        cwd=REPO,
        timeout=600,
    )


def test_the_registry_has_every_encoder_of_the_issue_with_its_card_fields() -> None:
    assert set(ENCODERS) >= ISSUE_NAMES
    assert {n for n in ENCODERS if n.startswith("kaiko_vit")} == {
        "kaiko_vits16", "kaiko_vits8", "kaiko_vitb16", "kaiko_vitb8", "kaiko_vitl14",
    }  # fmt: skip
    for recipe in RECIPES:
        described = recipe.describe()
        json.dumps(described)  # plain values only
        assert recipe.dim > 0 and recipe.patch_size > 0 and 0.1 < recipe.mpp < 4
        assert len(recipe.mean) == len(recipe.std) == 3 and min(recipe.std) > 0
        assert recipe.repo and recipe.files and recipe.licence
        assert recipe.precision in ("float32", "float16", "bfloat16")
    # the widths and pooling the cards give (Virchow: class token + mean of patch tokens)
    widths = {"uni_v1": 1024, "uni_v2": 1536, "virchow": 2560, "virchow2": 2560, "conch_v1": 512}
    assert {n: ENCODERS[n].dim for n in widths} == widths
    assert ENCODERS["virchow2"].pooling == "cls+mean" and ENCODERS["virchow2"].prefix_tokens == 5
    assert ENCODERS["hoptimus0"].mean == (0.707223, 0.578729, 0.703617)


@pytest.mark.vision
@pytest.mark.parametrize("recipe", RECIPES, ids=[r.name for r in RECIPES])
def test_every_entry_builds_on_the_meta_device_with_its_cards_width(recipe: Recipe) -> None:
    try:
        module = build(recipe, device="meta")
    except ConfigError as exc:  # its architecture's package is not installed here
        if os.environ.get("WSI_LOADER_REQUIRE_VISION") == "1" and "timm" in str(exc):
            raise  # make test-vision installs timm: a timm entry must build there
        pytest.skip(str(exc))
    assert all(p.is_meta for p in module.backbone.parameters())
    size = recipe.size or recipe.patch_size
    out = module(torch.empty(2, 3, size, size, device="meta"))
    assert tuple(out.shape) == (2, recipe.dim)


def test_safetensors_reader_reads_the_specified_layout(tmp_path: Path) -> None:
    state = {
        "a": torch.randn(3, 4),
        "b": torch.randn(5).to(torch.bfloat16),
        "c": torch.arange(6).reshape(2, 3),
        "d": torch.randn(2, 2).half(),
    }
    write_safetensors(tmp_path / "w.safetensors", state)
    back = read_safetensors(tmp_path / "w.safetensors")
    assert list(back) == list(state)
    for k, v in state.items():
        assert back[k].dtype == v.dtype and torch.equal(back[k], v)


@pytest.fixture
def small_index(make_slide: SlideFactory, tmp_path: Path) -> SlideIndex:
    folder = tmp_path / "slides"
    folder.mkdir()
    (folder / "a.svs").symlink_to(make_slide(width=768, height=512, seed=5))
    return build_index([folder], tmp_path / "idx", tile_size=256, mpp=0.5, min_tissue=0.0)


def openslide_tile(index: SlideIndex, x: int, y: int, size: int) -> torch.Tensor:
    with openslide.OpenSlide(index.slide_path(0)) as slide:
        rgba = slide.read_region((x, y), 0, (size, size))
    pixels = torch.from_numpy(np.asarray(rgba)[..., :3].copy())
    return pixels.permute(2, 0, 1)[None].float() / 255


@pytest.mark.parametrize("layout", ["model.safetensors", "pytorch_model.bin", "snapshot"])
def test_resnet50_trunc_features_through_weights_equal_clams_computation(
    small_index: SlideIndex, tmp_path: Path, layout: str
) -> None:
    state = resnet50_state(seed=3)
    folder = tmp_path / "weights"
    folder.mkdir()
    if layout == "pytorch_model.bin":
        weights = folder / layout
        torch.save(state, weights)
    else:
        weights = folder / "model.safetensors"
        write_safetensors(weights, state)
        if layout == "snapshot":
            weights = folder  # the snapshot folder: the file is found in it
    out = tmp_path / "features"
    done = cli(
        "features", str(small_index.path), "--model", "resnet50_trunc", "--weights",
        str(weights), "--out", str(out), "--workers", "0", "--no-progress",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    with h5py.File(out / "a.h5", "r") as h5:
        features, coords = h5["features"][:], h5["coords"][:]
    assert features.shape == (len(small_index), 1024)
    for i in range(len(coords)):
        tile = openslide_tile(small_index, int(coords[i, 0]), int(coords[i, 1]), 256)
        with torch.inference_mode():
            expected = resnet50_layer3_pooled(state, (tile - IMAGENET_MEAN) / IMAGENET_STD)
        np.testing.assert_allclose(features[i], expected[0].numpy(), rtol=0, atol=1e-4)


def test_weights_that_do_not_fit_are_refused_naming_the_first_mismatch(tmp_path: Path) -> None:
    state = resnet50_state()
    cases = {
        "lacks": ({k: v for k, v in state.items() if k != "layer2.1.bn2.weight"}, "lacks"),
        "extra": ({**state, "layer3.9.conv1.weight": torch.zeros(1)}, "layer3.9.conv1.weight"),
        "shape": ({**state, "bn1.bias": torch.zeros(65)}, "bn1.bias"),
    }
    for name, (bad, named) in cases.items():
        path = tmp_path / f"{name}.safetensors"
        write_safetensors(path, bad)
        with pytest.raises(WeightsError, match=named) as info:
            encoder("resnet50_trunc", path)
        assert info.value.repo == "timm/resnet50.tv_in1k"
    with pytest.raises(WeightsError, match=r"layer2\.1\.bn2\.weight"):
        encoder("resnet50_trunc", tmp_path / "lacks.safetensors")
    garbage = tmp_path / "pytorch_model.bin"
    garbage.write_bytes(b"not a checkpoint")
    with pytest.raises(WeightsError, match="not a readable weight file"):
        encoder("resnet50_trunc", garbage)


def test_missing_weights_exit_2_with_the_repo_id(small_index: SlideIndex, tmp_path: Path) -> None:
    done = cli(
        "features", str(small_index.path), "--model", "uni_v2", "--weights",
        str(tmp_path / "nowhere.bin"), "--out", str(tmp_path / "f"),
    )  # fmt: skip
    assert done.returncode == 2
    assert "MahmoodLab/UNI2-h" in done.stderr and "Traceback" not in done.stderr
    # none given, none cached, hub off: the repo, the licence, how to get access
    done = cli(
        "features", str(small_index.path), "--model", "virchow2", "--out", str(tmp_path / "f"),
        env={"HF_HOME": str(tmp_path / "hf")},
    )  # fmt: skip
    assert done.returncode == 2 and "Traceback" not in done.stderr
    for part in ("paige-ai/Virchow2", "CC-BY-NC-ND-4.0", "huggingface-cli login", "--weights"):
        assert part in done.stderr, done.stderr
    # --weights is for registry encoders only
    done = cli(
        "features", str(small_index.path), "--model", "tests.feature_models:tiny",
        "--weights", str(tmp_path), "--out", str(tmp_path / "f"),
    )  # fmt: skip
    assert done.returncode == 2 and "--weights goes with --model NAME" in done.stderr


def fake_hub_cache(home: Path, repo: str, file: str, state: dict[str, torch.Tensor]) -> Path:
    """The Hugging Face cache's layout (models--org--name/snapshots/REV, refs/main)."""
    root = home / "hub" / f"models--{repo.replace('/', '--')}"
    snapshot = root / "snapshots" / "0123abcd"
    snapshot.mkdir(parents=True)
    (root / "refs").mkdir()
    (root / "refs" / "main").write_text("0123abcd")
    write_safetensors(snapshot / file, state)
    return snapshot / file


def test_encoders_json_lists_the_registry_and_which_weights_are_cached(
    small_index: SlideIndex, tmp_path: Path
) -> None:
    home = tmp_path / "hf"
    done = cli("encoders", "--json", env={"HF_HOME": str(home)})
    assert done.returncode == 0, done.stderr
    listed = {row["name"]: row for row in json.loads(done.stdout)}
    assert set(listed) == set(ENCODERS)
    for row in listed.values():
        assert {"name", "dim", "size", "mean", "std", "mpp", "repo"} <= set(row)
        assert row["weights_present"] is False
    assert listed["virchow"]["dim"] == 2560 and listed["uni_v2"]["repo"] == "MahmoodLab/UNI2-h"
    state = resnet50_state(seed=4)
    fake_hub_cache(home, "timm/resnet50.tv_in1k", "model.safetensors", state)
    done = cli("encoders", "--json", env={"HF_HOME": str(home)})
    present = {r["name"] for r in json.loads(done.stdout) if r["weights_present"]}
    assert present == {"resnet50_trunc"}
    # and the cached file is what --model NAME loads without --weights, the hub off
    out = tmp_path / "features"
    done = cli(
        "features", str(small_index.path), "--model", "resnet50_trunc", "--out", str(out),
        "--workers", "0", "--no-progress", env={"HF_HOME": str(home)},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    with h5py.File(out / "a.h5", "r") as h5:
        first, xy = h5["features"][0], h5["coords"][0]
    tile = openslide_tile(small_index, int(xy[0]), int(xy[1]), 256)
    with torch.inference_mode():
        expected = resnet50_layer3_pooled(state, (tile - IMAGENET_MEAN) / IMAGENET_STD)[0]
    np.testing.assert_allclose(first, expected.numpy(), rtol=0, atol=1e-4)


def test_an_index_at_another_resolution_warns_and_strict_refuses(
    make_slide: SlideFactory, tmp_path: Path
) -> None:
    folder = tmp_path / "slides"
    folder.mkdir()
    (folder / "a.svs").symlink_to(make_slide(width=768, height=512, seed=5))
    index = build_index([folder], tmp_path / "idx", tile_size=128, mpp=1.0, min_tissue=0.0)
    weights = tmp_path / "model.safetensors"
    write_safetensors(weights, resnet50_state())
    common = ("--model", "resnet50_trunc", "--weights", str(weights), "--workers", "0")
    done = cli(
        "features", str(index.path), *common, "--batch-size", "auto", "--out",
        str(tmp_path / "f"),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr  # (auto: 64 on the CPU)
    assert "trained at 0.5 um/px (20x) but the index's tiles are at 1 um/px (10x)" in done.stderr
    assert "trained on 256 px patches but the index's tiles are 128 px" in done.stderr
    done = cli("features", str(index.path), *common, "--strict", "--out", str(tmp_path / "g"))
    assert done.returncode == 2 and "--for-encoder resnet50_trunc" in done.stderr
    assert not (tmp_path / "g").exists()


def test_index_for_encoder_takes_its_resolution_and_patch_size(
    make_slide: SlideFactory, tmp_path: Path
) -> None:
    slide = make_slide(width=1024, height=1024, seed=6, mpp=0.25)
    done = cli(
        "index", str(slide), "--out", str(tmp_path / "idx"), "--for-encoder", "ctranspath",
        "--min-tissue", "0",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    params = SlideIndex.open(tmp_path / "idx").params
    assert (params["mpp"], params["tile_size"]) == (1.0, 256)
    done = cli("index", str(slide), "--out", str(tmp_path / "x"), "--for-encoder", "nope")
    assert done.returncode == 2 and "no encoder 'nope'" in done.stderr


def test_wl_encoder_returns_the_module_with_its_recipe(tmp_path: Path) -> None:
    import wsi_loader as wl

    weights = tmp_path / "model.safetensors"
    state = resnet50_state(seed=7)
    write_safetensors(weights, state)
    module = wl.encoder("resnet50_trunc", weights, download=False)
    assert (module.name, module.dim, module.size, module.mpp, module.patch_size) == (
        "resnet50_trunc", 1024, None, 0.5, 256,
    )  # fmt: skip
    assert module.mean == (0.485, 0.456, 0.406) and module.std == (0.229, 0.224, 0.225)
    assert not module.training
    x = torch.rand(2, 3, 96, 96)
    with torch.inference_mode():
        expected = resnet50_layer3_pooled(state, (x - IMAGENET_MEAN) / IMAGENET_STD)
        np.testing.assert_allclose(module(x).numpy(), expected.numpy(), rtol=0, atol=1e-4)
    with pytest.raises(ConfigError, match="did you mean 'uni_v2'"):
        wl.encoder("uni_v3", weights)


def test_predict_with_a_linear_head_on_an_encoder(small_index: SlideIndex, tmp_path: Path) -> None:
    import csv

    state = resnet50_state(seed=8)
    weights = tmp_path / "model.safetensors"
    write_safetensors(weights, state)
    generator = torch.Generator().manual_seed(1)
    head = {
        "weight": torch.randn(2, 1024, generator=generator) * 0.1,
        "bias": torch.tensor([0.1, -0.1]),
        "classes": ["normal", "tumour"],
    }
    torch.save(head, tmp_path / "head.pt")
    out = tmp_path / "predict"
    done = cli(
        "predict", str(small_index.path), "--model", "resnet50_trunc", "--weights", str(weights),
        "--head", str(tmp_path / "head.pt"), "--out", str(out), "--workers", "0",
        "--no-progress", "--no-heatmaps",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    with open(out / "model-outputs-csv" / "a.csv", newline="") as fh:
        rows = list(csv.DictReader(fh))
    assert len(rows) == len(small_index)
    for row in rows:
        tile = openslide_tile(small_index, int(float(row["minx"])), int(float(row["miny"])), 256)
        with torch.inference_mode():
            features = resnet50_layer3_pooled(state, (tile - IMAGENET_MEAN) / IMAGENET_STD)
            expected = torch.softmax(features @ head["weight"].T + head["bias"], dim=1)[0]
        written = [float(row["prob_normal"]), float(row["prob_tumour"])]
        np.testing.assert_allclose(written, expected.numpy(), rtol=0, atol=1e-4)
    torch.save({"weight": torch.zeros(2, 512)}, tmp_path / "narrow.pt")
    done = cli(
        "predict", str(small_index.path), "--model", "resnet50_trunc", "--weights", str(weights),
        "--head", str(tmp_path / "narrow.pt"), "--out", str(tmp_path / "p2"),
    )  # fmt: skip
    assert done.returncode == 2 and "the head takes 512 features but" in done.stderr
