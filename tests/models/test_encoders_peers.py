"""Registry encoders against the peers' own construction code with the same seeded random
weights: CONCH v1 as CONCH's package builds it (open_clip's CoCa, ``encode_image(
proj_contrast=False, normalize=False)`` as TRIDENT calls it) and CONCH v1.5 as TRIDENT builds
it (its conchv1_5 module, ``create_model_from_pretrained`` on a local file).

The peers are no dependency of ours: these tests skip where they do not import and run in
the peers' venv (``make test-encoder-peers``, beside TRIDENT's and CONCH's sources).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.models.encoder_weights import seeded_like
from wsi_loader.models import encoder

pytestmark = pytest.mark.vision
IMAGENET = ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))
OPENAI_CLIP = ((0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711))


def tiles(n: int, size: int, seed: int) -> torch.Tensor:
    """Tiles in [0, 1] on the 1/255 grid (as read from a slide)."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n, 3, size, size), generator=generator).float() / 255


def normalized(x: torch.Tensor, stats: tuple[tuple[float, ...], tuple[float, ...]]) -> torch.Tensor:
    mean, std = (torch.tensor(s).view(1, 3, 1, 1) for s in stats)
    return (x - mean) / std


def test_conch_v15_equals_tridents_construction(tmp_path: Path) -> None:
    trident = pytest.importorskip("trident.patch_encoder_models.model_zoo.conchv1_5.conchv1_5")
    # the published file's layout: TRIDENT's tower as built (224 px positions, 14 x 14)
    state = seeded_like(trident.CONCHVisionTower().state_dict(), seed=11)
    assert state["trunk.pos_embed"].shape == (1, 197, 1024)
    weights = tmp_path / "pytorch_model_vision.bin"
    torch.save(state, weights)
    theirs, _ = trident.create_model_from_pretrained(str(weights), img_size=448)
    ours = encoder("conch_v15", weights, download=False)
    x = tiles(2, 448, seed=1)  # at 448 px the card's resize and crop change nothing
    with torch.inference_mode():
        expected = theirs.eval()(normalized(x, IMAGENET))
        got = ours(x)
    assert got.shape == (2, 768) and not torch.allclose(got[0], got[1], atol=1e-3)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)


def test_conch_v1_equals_conchs_coca_encode_image(tmp_path: Path) -> None:
    factory = pytest.importorskip("conch.open_clip_custom.factory")
    config = json.loads((factory.CFG_DIR / "conch_ViT-B-16.json").read_text())
    config.pop("custom_text")
    coca = factory.CoCa(**config)  # as create_model builds it, before the file is read
    # the released pytorch_model.bin's layout: the whole CoCa (text towers included)
    state = seeded_like(coca.state_dict(), seed=12)
    weights = tmp_path / "pytorch_model.bin"
    torch.save(state, weights)
    theirs, _ = factory.create_model_from_pretrained("conch_ViT-B-16", checkpoint_path=str(weights))
    ours = encoder("conch_v1", weights, download=False)
    x = tiles(2, 448, seed=2)
    with torch.inference_mode():
        expected = theirs.eval().encode_image(
            normalized(x, OPENAI_CLIP), proj_contrast=False, normalize=False
        )
        got = ours(x)
    assert got.shape == (2, 512) and not torch.allclose(got[0], got[1], atol=1e-3)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)
