"""The registry's transformers entries built from a snapshot folder (the card's config.json
beside seeded random weights, as ``save_pretrained`` writes them): the recipe loads through
--weights and pools as the card's usage code does, at the card's width.

Needs transformers (the ``transformers`` extra, installed by ``make test-vision``). Hibou-B/L
are not here: their config.json points at modelling code on the hub (``trust_remote_code``),
which a test cannot fetch. Phikon-v2's and Midnight's configs are cut to one block (their
width does not depend on the depth) to keep a ViT-L and a ViT-g out of a test's memory.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.vision import require
from wsi_loader.models import ENCODERS, encoder

pytestmark = pytest.mark.vision
transformers = require("transformers")

# the cards' config.json (owkin/phikon, owkin/phikon-v2, kaiko-ai/midnight)
PHIKON = {
    "architectures": ["ViTModel"], "model_type": "vit", "hidden_size": 768,
    "num_hidden_layers": 12, "num_attention_heads": 12, "intermediate_size": 3072,
    "hidden_act": "gelu", "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0,
    "image_size": 224, "patch_size": 16, "num_channels": 3, "qkv_bias": True,
    "layer_norm_eps": 1e-12, "encoder_stride": 16,
}  # fmt: skip
PHIKON_V2 = {
    "architectures": ["Dinov2Model"], "model_type": "dinov2", "hidden_size": 1024,
    "num_hidden_layers": 24, "num_attention_heads": 16, "mlp_ratio": 4, "hidden_act": "gelu",
    "image_size": 224, "patch_size": 16, "num_channels": 3, "qkv_bias": True,
    "layer_norm_eps": 1e-6, "layerscale_value": 1.0, "use_swiglu_ffn": False,
    "drop_path_rate": 0.0,
}  # fmt: skip
MIDNIGHT = {
    "architectures": ["Dinov2Model"], "model_type": "dinov2", "hidden_size": 1536,
    "num_hidden_layers": 40, "num_attention_heads": 24, "mlp_ratio": 4, "hidden_act": "gelu",
    "image_size": 224, "patch_size": 14, "num_channels": 3, "qkv_bias": True,
    "layer_norm_eps": 1e-6, "layerscale_value": 1e-5, "use_swiglu_ffn": True,
    "drop_path_rate": 0.0,
}  # fmt: skip


def snapshot(folder: Path, card: dict[str, Any], name: str, seed: int) -> Any:
    """A snapshot folder as the hub serves it: config.json and model.safetensors with
    seeded random weights; the model it holds (eval mode)."""
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(card))
    config = transformers.AutoConfig.from_pretrained(str(folder))
    torch.manual_seed(seed)
    if name == "phikon":  # the card: ViTModel without its pooling layer
        model = transformers.ViTModel(config, add_pooling_layer=False)
    else:
        model = transformers.AutoModel.from_config(config)
    model.save_pretrained(str(folder))
    return model.eval()


def normalized(x: torch.Tensor, name: str) -> torch.Tensor:
    recipe = ENCODERS[name]
    mean, std = (torch.tensor(s).view(1, 3, 1, 1) for s in (recipe.mean, recipe.std))
    return (x - mean) / std


@pytest.mark.parametrize(
    ("name", "card", "depth"),
    [("phikon", PHIKON, None), ("phikon_v2", PHIKON_V2, 1), ("midnight", MIDNIGHT, 1)],
)
def test_transformers_entry_loads_its_snapshot_and_pools_as_its_card(
    tmp_path: Path, name: str, card: dict[str, Any], depth: int | None
) -> None:
    card = {**card, **({"num_hidden_layers": depth} if depth else {})}
    model = snapshot(tmp_path / "snapshot", card, name, seed=7)
    ours = encoder(name, tmp_path / "snapshot", download=False)
    x = torch.randint(0, 256, (2, 3, 224, 224)).float() / 255  # no resize at 224 px
    with torch.inference_mode():
        tokens = model(pixel_values=normalized(x, name)).last_hidden_state
        if name == "midnight":  # the card: [class token, mean of the patch tokens]
            expected = torch.cat([tokens[:, 0], tokens[:, 1:].mean(1)], dim=-1)
        else:  # the cards: last_hidden_state[:, 0]
            expected = tokens[:, 0]
        got = ours(x)
    assert got.shape == (2, ENCODERS[name].dim)
    assert ENCODERS[name].dim == {"phikon": 768, "phikon_v2": 1024, "midnight": 3072}[name]
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)
