"""Slide encoders by name: the registry, the architectures in the published key layout,
strict loading, and the embeddings against the authors' own code."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.models.slide_peers import CHIEF_KEYS, chief_state, peer_chief, peer_root
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
