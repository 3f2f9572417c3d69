"""Slide encoders by name: the registry, the architectures in the published key layout,
strict loading, and the embeddings against the authors' own code."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.models.encoder_weights import seeded_like, write_safetensors
from tests.models.slide_peers import (
    CHIEF_KEYS,
    FEATHER_CONFIG,
    MADELEINE_CONFIG,
    chief_state,
    peer_chief,
    peer_feather,
    peer_gigapath,
    peer_madeleine,
    peer_root,
    peer_titan,
)
from wsi_loader.errors import ConfigError, WeightsError
from wsi_loader.models import SLIDE_ENCODERS, slide_encoder
from wsi_loader.models._slide_encoders import build_slide_encoder, slide_recipe_of


def chief_file(tmp_path: Path, state: dict[str, torch.Tensor] | None = None) -> Path:
    path = tmp_path / "CHIEF_pretraining.pth"
    torch.save(chief_state() if state is None else state, path)
    return path


def test_every_entry_describes_itself_and_the_unwired_ones_say_why() -> None:
    for name, recipe in SLIDE_ENCODERS.items():
        row = recipe.describe()
        assert row["name"] == name and row["kind"] == "slide" and row["dim"] > 0
        assert row["patch_encoder"] and row["input_dim"] > 0
        if recipe.wired:
            module = build_slide_encoder(recipe)  # on meta: no memory
            assert module.dim == recipe.dim
        else:
            with pytest.raises(ConfigError, match=f"{name}.*cannot run yet: .+"):
                build_slide_encoder(recipe)
    assert slide_recipe_of("gigapath").name == "gigapath_slide"  # TRIDENT's name
    with pytest.raises(ConfigError, match="did you mean 'chief'"):
        slide_recipe_of("chef")


def test_chief_has_the_published_keys_and_shapes() -> None:
    net = build_slide_encoder(slide_recipe_of("chief")).net
    assert {k: tuple(v.shape) for k, v in net.state_dict().items()} == CHIEF_KEYS


def test_chief_embedding_is_its_attention_weighted_mean(tmp_path: Path) -> None:
    state = chief_state(3)
    model = slide_encoder("chief", weights=chief_file(tmp_path, state))
    features = torch.randn(37, 768, generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        out = model(features, torch.zeros(37, 2, dtype=torch.int64), None)
    # CHIEF's forward written out from its models/CHIEF.py, from the state dict alone
    s = state
    h = torch.relu(features @ s["attention_net.0.weight"].T + s["attention_net.0.bias"])
    a = torch.tanh(
        h @ s["attention_net.3.attention_a.0.weight"].T + s["attention_net.3.attention_a.0.bias"]
    )
    b = torch.sigmoid(
        h @ s["attention_net.3.attention_b.0.weight"].T + s["attention_net.3.attention_b.0.bias"]
    )
    scores = (a * b) @ s["attention_net.3.attention_c.weight"].T + s[
        "attention_net.3.attention_c.bias"
    ]
    expected = torch.softmax(scores[:, 0], dim=0) @ features
    assert out.shape == (768,)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    ("change", "named"),
    [
        (lambda s: s.update({"extra.weight": torch.zeros(1)}), "the file has 'extra.weight'"),
        (lambda s: s.pop("attention_net.0.weight"), "the file lacks 'attention_net.0.weight'"),
        (
            lambda s: s.update({"classifiers.weight": torch.zeros(3, 512)}),
            r"'classifiers.weight' is \(3, 512\) in the file but \(2, 512\)",
        ),
    ],
)
def test_a_file_that_does_not_fit_is_refused_naming_the_first_key(
    tmp_path: Path, change: object, named: str
) -> None:
    state = chief_state()
    change(state)  # type: ignore[operator]
    with pytest.raises(WeightsError, match=named) as caught:
        slide_encoder("chief", weights=chief_file(tmp_path, state))
    assert caught.value.encoder == "chief"


def test_missing_and_unreadable_weights_are_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(WeightsError, match=r"not on the Hugging Face hub.*drive\.google\.com"):
        slide_encoder("chief")
    with pytest.raises(WeightsError, match="no such weight file"):
        slide_encoder("chief", weights=tmp_path / "absent.pth")
    junk = tmp_path / "junk.pth"
    junk.write_bytes(b"not a checkpoint")
    with pytest.raises(WeightsError, match="not a readable weight file"):
        slide_encoder("chief", weights=junk)


def test_chief_equals_chiefs_own_code(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = peer_root("CHIEF")
    torch.manual_seed(0)
    peer = peer_chief(root, tmp_path, monkeypatch)
    # the peer's random init saved as CHIEF_pretraining.pth and loaded strictly by both
    path = tmp_path / "CHIEF_pretraining.pth"
    torch.save(peer.state_dict(), path)
    peer.load_state_dict(torch.load(path, weights_only=True), strict=True)
    ours = slide_encoder("chief", weights=path)
    generator = torch.Generator().manual_seed(2)
    for tiles in (1, 5, 300):
        features = torch.randn(tiles, 768, generator=generator)
        with torch.inference_mode():
            theirs = peer(features, torch.tensor([0]))["WSI_feature"]  # as TRIDENT calls it
            mine = ours(features, torch.zeros(tiles, 2, dtype=torch.int64), None)
        assert theirs.shape == (1, 768)
        torch.testing.assert_close(mine, theirs[0], atol=1e-5, rtol=0)


# ---------------------------------------------------------------------------------- TITAN


def titan_file(tmp_path: Path, state: dict[str, torch.Tensor]) -> Path:
    """``state`` as TITAN's model.safetensors holds it: under vision_encoder., beside the
    text tower's tensors (left out by design)."""
    path = tmp_path / "model.safetensors"
    full = {f"vision_encoder.{k}": v.contiguous() for k, v in state.items()}
    full["text_encoder.token_embedding.weight"] = torch.zeros(4, 8)
    write_safetensors(path, full)
    return path


def titan_state(seed: int = 0) -> dict[str, torch.Tensor]:
    net = build_slide_encoder(slide_recipe_of("titan"), device="cpu").net
    return seeded_like(net.state_dict(), seed, fan_in=True)


def grid_slide(tiles: int, size0: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A slide's features on a grid with gaps, offset from the origin, in a shuffled order."""
    generator = torch.Generator().manual_seed(seed)
    cells = torch.randperm(11 * 9, generator=generator)[:tiles]
    coords = torch.stack([cells // 9, cells % 9], dim=1) * size0 + torch.tensor([3000, 700])
    return torch.randn(tiles, 768, generator=generator), coords


def test_titan_has_its_vision_towers_keys() -> None:
    keys = build_slide_encoder(slide_recipe_of("titan")).net.state_dict()
    assert keys["patch_embed.0.weight"].shape == (768, 768)
    assert keys["blocks.modules_list.5.mlp.fc2.weight"].shape == (768, 3072)
    assert "blocks.modules_list.6.norm1.weight" not in keys
    assert keys["attn_pool.query"].shape == (128, 768)
    assert keys["attn_pool_contrastive.attn.in_proj_weight"].shape == (3 * 768, 768)
    assert keys["proj"].shape == (768, 768) and keys["cls_token"].shape == (1, 1, 768)


def test_titan_alibi_slopes_and_grid() -> None:
    from wsi_loader.models._slide_titan import _slopes, grid_cells

    # ALiBi for 12 heads: 8 heads' 2^-1..2^-8, then every other of 16 heads' 2^-(k/2)
    assert _slopes(12) == pytest.approx(
        [2.0**-k for k in range(1, 9)] + [2.0**-k for k in (0.5, 1.5, 2.5, 3.5)]
    )
    features = torch.tensor([[1.0, 0.0], [0.0, 0.0], [2.0, 5.0]])
    coords = torch.tensor([[1024, 512], [0, 0], [512, 1100]])
    cells, rows, cols = grid_cells(features, coords, 512)
    # rows are x // 512, columns y // 512; the all-zero tile is background
    assert rows.tolist() == [1, 2] and cols.tolist() == [2, 1]
    assert cells.tolist() == [[2.0, 5.0], [1.0, 0.0]]


def test_titan_embedding_does_not_depend_on_tile_order_or_offset(tmp_path: Path) -> None:
    model = slide_encoder("titan", weights=titan_file(tmp_path, titan_state()))
    features, coords = grid_slide(40, 512, seed=4)
    order = torch.randperm(40, generator=torch.Generator().manual_seed(5))
    with torch.inference_mode():
        out = model(features, coords, 512)
        shuffled = model(features[order], coords[order] + 512 * 7, 512)
    assert out.shape == (768,) and torch.isfinite(out).all()
    torch.testing.assert_close(out, shuffled, atol=1e-5, rtol=1e-5)
    with pytest.raises(ConfigError, match="patch_size_level0"):
        model(features, coords, None)


def test_titan_file_with_another_part_is_refused(tmp_path: Path) -> None:
    state = titan_state()
    path = titan_file(tmp_path, state)
    full = {f"vision_encoder.{k}": v for k, v in state.items()}
    full["conch.visual.trunk.cls_token"] = torch.zeros(1, 1, 768)
    write_safetensors(path, full)
    with pytest.raises(WeightsError, match=r"the file has 'conch\.visual\.trunk\.cls_token'"):
        slide_encoder("titan", weights=path)


def test_titan_equals_titans_own_code(tmp_path: Path) -> None:
    root = peer_root("TITAN")
    peer = peer_titan(root)
    state = seeded_like(peer.state_dict(), seed=7, fan_in=True)
    peer.load_state_dict(state, strict=True)
    ours = slide_encoder("titan", weights=titan_file(tmp_path, state))
    # (not one tile: TITAN's get_alibi indexes a numpy grid with a torch bool mask, which
    # numpy reads as the integer 1 when it has one element: an IndexError there)
    for tiles, size0, seed in ((2, 512, 0), (17, 512, 1), (60, 1024, 2)):
        features, coords = grid_slide(tiles, size0, seed)
        with torch.inference_mode():
            # as TRIDENT calls it: encode_slide_from_patch_features -> no_proj=True
            theirs = peer(features[None], coords[None], size0, no_proj=True)
            mine = ours(features, coords, size0)
        assert theirs.shape == (1, 768)
        torch.testing.assert_close(mine, theirs[0], atol=1e-5, rtol=0)


# ------------------------------------------------------------------------ Prov-GigaPath


def gigapath_file(tmp_path: Path, state: dict[str, torch.Tensor]) -> Path:
    """``state`` as slide_encoder.pth holds it (under ``model``)."""
    path = tmp_path / "slide_encoder.pth"
    torch.save({"model": state}, path)
    return path


def test_gigapath_positions_follow_the_authors_table() -> None:
    from wsi_loader.models._slide_gigapath import SEGMENTS, sincos

    assert SEGMENTS == (1024, 5792, 32768, 185363, 1048576)  # their get_optimal_segment_length
    # MAE's get_2d_sincos_pos_embed(768, 1000) row 1 + 1000 * 2 + 7 (written out for it)
    omega = 1 / 10000 ** (torch.arange(192, dtype=torch.float64) / 192)
    w, h = 7.0, 2.0
    expected = torch.cat(
        [torch.sin(w * omega), torch.cos(w * omega), torch.sin(h * omega), torch.cos(h * omega)]
    ).float()
    torch.testing.assert_close(sincos(torch.tensor([2 * 1000 + 7]))[0], expected)


def test_gigapath_refuses_tiles_off_its_grid(tmp_path: Path) -> None:
    net = build_slide_encoder(slide_recipe_of("gigapath_slide"), device="cpu").net
    with pytest.raises(ValueError, match="1000 x 1000 tile grid"):
        net(torch.zeros(1, 1536), torch.tensor([[256 * 1000, 0]]), 256)


@pytest.mark.parametrize("tiles", [3, 40, 1030])  # 1030: two segments of 1024
# prov-gigapath's own code imports timm.models.registry and .layers, deprecated in timm 1.0
@pytest.mark.filterwarnings("ignore:Importing from timm.models.:FutureWarning")
# and registers its model with timm again each time the checkout is imported (per parameter)
@pytest.mark.filterwarnings("ignore:Overwriting gigapath_slide_enc:UserWarning")
def test_gigapath_equals_prov_gigapaths_own_code(tmp_path: Path, tiles: int) -> None:
    root = peer_root("prov-gigapath")
    peer = peer_gigapath(root)
    state = seeded_like(peer.state_dict(), seed=tiles, fan_in=True)
    peer.load_state_dict(state, strict=True)
    ours = slide_encoder("gigapath_slide", weights=gigapath_file(tmp_path, state))
    generator = torch.Generator().manual_seed(tiles)
    cells = torch.randperm(60 * 40, generator=generator)[:tiles]
    coords = torch.stack([cells // 40, cells % 40], dim=1) * 256 + 100
    features = torch.randn(tiles, 1536, generator=generator)
    with torch.inference_mode():
        theirs = peer(features[None], coords[None].float())[0]  # (1, 768): the README's call
        mine = ours(features, coords, 256)
    assert theirs.shape == (1, 768)
    torch.testing.assert_close(mine, theirs[0], atol=1e-5, rtol=0)


# ---------------------------------------------------------------------------- MADELEINE


def madeleine_folder(tmp_path: Path, state: dict[str, torch.Tensor], config: dict) -> Path:
    """A snapshot folder as MahmoodLab/madeleine serves it: model.pt and model_config.json
    (the weights saved by DataParallel, under module.)."""
    folder = tmp_path / "madeleine"
    folder.mkdir()
    torch.save({f"module.{k}": v for k, v in state.items()}, folder / "model.pt")
    (folder / "model_config.json").write_text(json.dumps(config))
    return folder


def test_madeleine_needs_its_config_beside_the_weights(tmp_path: Path) -> None:
    net = build_slide_encoder(slide_recipe_of("madeleine"), device="cpu").net
    folder = madeleine_folder(
        tmp_path, seeded_like(net.state_dict(), fan_in=True), MADELEINE_CONFIG
    )
    (folder / "model_config.json").unlink()
    with pytest.raises(WeightsError, match=r"model_config\.json"):
        slide_encoder("madeleine", weights=folder)


@pytest.mark.parametrize(("heads", "activation"), [(4, "softmax"), (2, "sigmoid")])
def test_madeleine_equals_madeleines_own_code(tmp_path: Path, heads: int, activation: str) -> None:
    root = peer_root("MADELEINE")
    config = {**MADELEINE_CONFIG, "n_heads": heads, "activation": activation}
    peer = peer_madeleine(root, config)
    state = seeded_like(peer.state_dict(), seed=heads, fan_in=True)
    peer.load_state_dict(state, strict=True)
    ours = slide_encoder("madeleine", weights=madeleine_folder(tmp_path, state, config))
    generator = torch.Generator().manual_seed(heads)
    for tiles in (1, 9, 250):
        features = torch.randn(tiles, 512, generator=generator)
        with torch.inference_mode():
            theirs = peer.encode_he(features[None], "cpu")  # as TRIDENT calls it
            mine = ours(features, torch.zeros(tiles, 2, dtype=torch.int64), None)
        assert theirs.shape == (1, 512)
        torch.testing.assert_close(mine, theirs[0], atol=1e-5, rtol=0)


# ------------------------------------------------------------------------------ Feather


def feather_folder(tmp_path: Path, state: dict[str, torch.Tensor], config: dict) -> Path:
    """A snapshot folder as the Hugging Face repo serves it: model.safetensors (ABMILModel's
    state: ABMIL under model.) and config.json."""
    folder = tmp_path / "feather"
    folder.mkdir()
    write_safetensors(
        folder / "model.safetensors", {f"model.{k}": v.contiguous() for k, v in state.items()}
    )
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def test_feather_needs_its_config_beside_the_weights(tmp_path: Path) -> None:
    net = build_slide_encoder(slide_recipe_of("feather"), device="cpu").net
    folder = feather_folder(tmp_path, seeded_like(net.state_dict(), fan_in=True), FEATHER_CONFIG)
    (folder / "config.json").write_text("{}")
    with pytest.raises(WeightsError, match=r"config\.json"):
        slide_encoder("feather", weights=folder)


@pytest.mark.parametrize("layers", [1, 2])
def test_feather_equals_mil_labs_own_code(tmp_path: Path, layers: int) -> None:
    root = peer_root("MIL-Lab")
    config = {**FEATHER_CONFIG, "num_fc_layers": layers}
    peer = peer_feather(root, config)
    state = seeded_like(peer.state_dict(), seed=layers, fan_in=True)
    peer.load_state_dict(state, strict=True)
    ours = slide_encoder("feather", weights=feather_folder(tmp_path, state, config))
    generator = torch.Generator().manual_seed(layers)
    for tiles in (1, 9, 250):
        features = torch.randn(tiles, 768, generator=generator)
        with torch.inference_mode():
            theirs, _ = peer.forward_features(features[None])  # as TRIDENT calls it
            mine = ours(features, torch.zeros(tiles, 2, dtype=torch.int64), None)
        assert theirs.shape == (1, 512)
        torch.testing.assert_close(mine, theirs[0], atol=1e-5, rtol=0)
