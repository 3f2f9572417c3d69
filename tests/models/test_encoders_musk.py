"""MUSK against MUSK's own code with the same seeded random weights: its BEiT-3 as TRIDENT
builds it (``timm.create_model("musk_large_patch16_384")`` after ``from musk import
modeling``), loaded by MUSK's own ``utils.load_model_and_may_interpolate`` from a local
``model.safetensors`` in the released file's layout (the whole model: text copies, text
embedding and heads included), called as MUSK's README says for linear probes and MIL.

MUSK is no dependency of ours (not on PyPI; its vendored torchscale imports fairscale and
einops): these tests skip where it does not import, like the other peer tests.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.models.encoder_weights import seeded_like, write_safetensors
from wsi_loader.errors import WeightsError
from wsi_loader.models import encoder

pytestmark = pytest.mark.vision
INCEPTION = ((0.5, 0.5, 0.5), (0.5, 0.5, 0.5))


def musk_modules() -> tuple[Any, Any, Any]:
    """MUSK's modeling and utils modules and timm, or a skip naming what is missing."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # MUSK imports timm's deprecated module paths
            import timm
            from musk import modeling, utils
    except Exception as exc:  # missing, or built for another torch
        pytest.skip(
            f"MUSK's package does not import here ({type(exc).__name__}: {exc}); it needs a "
            "lilab-stanford/MUSK checkout on the path with fairscale, einops and timm"
        )
    return modeling, utils, timm


@pytest.fixture(scope="module")
def released(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    """A ``model.safetensors`` in the released layout (MUSK's whole model, seeded) and MUSK's
    own model loaded from it by MUSK's own loader."""
    modeling, utils, timm = musk_modules()
    assert modeling is not None
    theirs = timm.create_model("musk_large_patch16_384")  # as TRIDENT builds it
    state = seeded_like(theirs.state_dict(), seed=13)
    assert state["beit3.encoder.embed_positions.A.weight"].shape == (579, 1024)
    path = tmp_path_factory.mktemp("musk") / "model.safetensors"
    write_safetensors(path, state)
    utils.load_model_and_may_interpolate(str(path), theirs, "model|module", "")
    return path, theirs.eval()


def test_musk_equals_musks_own_forward(released: tuple[Path, Any]) -> None:
    path, theirs = released
    ours = encoder("musk", path, download=False)
    generator = torch.Generator().manual_seed(3)
    x = torch.randint(0, 256, (2, 3, 384, 384), generator=generator).float() / 255
    with torch.inference_mode():
        expected = theirs(
            image=(x - 0.5) / 0.5,  # the card's transform at 384 px: mean and std 0.5
            with_head=False,
            out_norm=False,
            ms_aug=True,
            return_global=True,
        )[0]
        got = ours(x)
        single = theirs(image=(x - 0.5) / 0.5, with_head=False, out_norm=False, ms_aug=False)[0]
    assert ours.dim == 2048 and got.shape == (2, 2048)
    assert not torch.allclose(got[0], got[1], atol=1e-3)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)
    # TRIDENT's default (inference_aug=False) is the first half: the class token at 384 px
    torch.testing.assert_close(got[:, :1024], single, rtol=0, atol=1e-5)


def test_musk_refuses_a_file_without_a_vision_weight(
    released: tuple[Path, Any], tmp_path: Path
) -> None:
    theirs = released[1]
    state = {k: v for k, v in theirs.state_dict().items() if "layers.23.ffn.A.fc2" not in k}
    broken = tmp_path / "model.safetensors"
    write_safetensors(broken, state)
    with pytest.raises(WeightsError, match=r"lacks 'beit3\.encoder\.layers\.23\.ffn\.A\.fc2"):
        encoder("musk", broken, download=False)
