"""Registry encoders built with timm give the features of the cards' own usage code (timm's
model, the card's torchvision transforms, its pooling) on OpenSlide's pixels of the same
tiles, with seeded random weights saved in the hub file's layout and passed as --weights.

Needs timm (and the torchvision it imports) built for the installed torch: skipped otherwise;
``make test-vision`` runs them in a second venv where they import.
"""

from __future__ import annotations

import re
from pathlib import Path

import h5py
import numpy as np
import openslide
import pytest
import torch

from tests.conftest import SlideFactory
from tests.models.encoder_weights import resnet50_state, seeded_like, write_safetensors
from tests.vision import require
from wsi_loader.errors import WeightsError
from wsi_loader.features import extract
from wsi_loader.index import SlideIndex, build_index
from wsi_loader.models import ENCODERS, encoder, encoder_model
from wsi_loader.models._encoders import build

pytestmark = pytest.mark.vision
timm = require("timm")
transforms = require("torchvision.transforms")

HOPTIMUS = ((0.707223, 0.578729, 0.703617), (0.211883, 0.230117, 0.177517))
IMAGENET = ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))
IMAGENET_MEAN = torch.tensor(IMAGENET[0]).view(1, 3, 1, 1)
IMAGENET_STD = torch.tensor(IMAGENET[1]).view(1, 3, 1, 1)


@pytest.fixture
def index224(make_slide: SlideFactory, tmp_path: Path) -> SlideIndex:
    folder = tmp_path / "slides"
    folder.mkdir()
    (folder / "a.svs").symlink_to(make_slide(width=448, height=448, seed=8))
    return build_index([folder], tmp_path / "idx", tile_size=224, mpp=0.5, min_tissue=0.0)


def tiles_as_pil(index: SlideIndex, coords: np.ndarray, size: int) -> list:  # type: ignore[type-arg]
    with openslide.OpenSlide(index.slide_path(0)) as slide:
        return [
            slide.read_region((int(x), int(y)), 0, (size, size)).convert("RGB") for x, y in coords
        ]


def our_features(index: SlideIndex, name: str, weights: Path, out: Path) -> tuple:  # type: ignore[type-arg]
    extract(index, encoder_model(name, weights, download=False), out, batch_size=4, workers=0)
    with h5py.File(out / "a.h5", "r") as h5:
        return h5["features"][:], h5["coords"][:]


def test_h0_mini_class_token_and_mean_of_patch_tokens_as_its_card(
    index224: SlideIndex, tmp_path: Path
) -> None:
    # the card: timm.create_model("hf-hub:bioptimus/H0-mini", mlp_layer=SwiGLUPacked,
    # act_layer=SiLU) with its config's model args; create_transform of its data config;
    # [output[:, 0], output[:, model.num_prefix_tokens:].mean(1)]
    card = timm.create_model(
        "vit_base_patch14_reg4_dinov2",
        pretrained=False,
        num_classes=0,
        img_size=224,
        global_pool="",
        init_values=1e-5,
        reg_tokens=4,
        mlp_ratio=5.33334,  # its config.json's model_args: 85.7M parameters
        mlp_layer=timm.layers.SwiGLUPacked,
        act_layer=torch.nn.SiLU,
    ).eval()
    assert round(sum(p.numel() for p in card.parameters()) / 1e5) == 857  # H0-mini's 85.7M
    state = seeded_like(card.state_dict(), 1)
    card.load_state_dict(state)
    snapshot = tmp_path / "snapshot"
    snapshot.mkdir()
    write_safetensors(snapshot / "model.safetensors", state)
    features, coords = our_features(index224, "h0_mini", snapshot, tmp_path / "f")
    assert features.shape == (len(index224), 1536)
    transform = transforms.Compose(
        [
            transforms.Resize(224, interpolation=transforms.InterpolationMode.BICUBIC),
            transforms.CenterCrop(224),
            transforms.ToTensor(),
            transforms.Normalize(*HOPTIMUS),
        ]
    )
    batch = torch.stack([transform(t) for t in tiles_as_pil(index224, coords, 224)])
    with torch.inference_mode():
        output = card(batch)
        expected = torch.cat([output[:, 0], output[:, card.num_prefix_tokens :].mean(1)], -1)
    np.testing.assert_allclose(features, expected.numpy(), rtol=0, atol=1e-4)


def test_kaiko_vits16_class_token_as_its_card(index224: SlideIndex, tmp_path: Path) -> None:
    card = timm.create_model(
        "vit_small_patch16_224", pretrained=False, num_classes=0, dynamic_img_size=True
    ).eval()
    state = seeded_like(card.state_dict(), 2)
    card.load_state_dict(state)
    weights = tmp_path / "model.safetensors"
    write_safetensors(weights, state)
    features, coords = our_features(index224, "kaiko_vits16", weights, tmp_path / "f")
    assert features.shape == (len(index224), 384)
    transform = transforms.Compose(
        [
            transforms.Resize(224),
            transforms.CenterCrop(224),
            transforms.ToTensor(),
            transforms.Normalize((0.5, 0.5, 0.5), (0.5, 0.5, 0.5)),
        ]
    )
    batch = torch.stack([transform(t) for t in tiles_as_pil(index224, coords, 224)])
    with torch.inference_mode():
        expected = card(batch)
    np.testing.assert_allclose(features, expected.numpy(), rtol=0, atol=1e-4)


def test_resnet50_trunc_as_clams_timm_features(make_slide: SlideFactory, tmp_path: Path) -> None:
    # CLAM / TRIDENT: timm's resnet50 with features_only, out_indices=[3] (layer 3), pooled
    folder = tmp_path / "slides"
    folder.mkdir()
    (folder / "a.svs").symlink_to(make_slide(width=512, height=512, seed=9))
    index = build_index([folder], tmp_path / "idx", tile_size=256, mpp=0.5, min_tissue=0.0)
    state = resnet50_state(seed=5)
    weights = tmp_path / "pytorch_model.bin"
    torch.save(state, weights)
    features, coords = our_features(index, "resnet50_trunc", weights, tmp_path / "f")
    card = timm.create_model("resnet50", pretrained=False, features_only=True, out_indices=[3])
    missing, unexpected = card.load_state_dict(state, strict=False)
    assert not missing and all(k.startswith(("layer4.", "fc.")) for k in unexpected)
    transform = transforms.Compose([transforms.ToTensor(), transforms.Normalize(*IMAGENET)])
    batch = torch.stack([transform(t) for t in tiles_as_pil(index, coords, 256)])
    with torch.inference_mode():
        expected = torch.nn.AdaptiveAvgPool2d(1)(card.eval()(batch)[0]).flatten(1)
    np.testing.assert_allclose(features, expected.numpy(), rtol=0, atol=1e-4)


def test_ctranspath_loads_chiefs_original_swin_layout(tmp_path: Path) -> None:
    # CHIEF_CTransPath.pth: {"model": ...} in the original Swin layout (patch merging at the
    # end of a stage, relative_position_index and attn_mask buffers saved, a head)
    reference = build(ENCODERS["ctranspath"], device="cpu").backbone
    state = seeded_like(reference.state_dict(), 3)
    reference.load_state_dict(state)
    original: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        moved = re.sub(
            r"^layers\.(\d+)\.downsample", lambda m: f"layers.{int(m[1]) - 1}.downsample", key
        )
        original[moved] = value
    original["layers.0.blocks.1.attn_mask"] = torch.zeros(64, 49, 49)
    original["layers.0.blocks.0.attn.relative_position_index"] = torch.zeros(49, 49).long()
    original["head.weight"], original["head.bias"] = torch.zeros(1000, 768), torch.zeros(1000)
    assert "layers.0.downsample.reduction.weight" in original
    weights = tmp_path / "CHIEF_CTransPath.pth"
    torch.save({"model": original}, weights)
    ours = encoder("ctranspath", weights, download=False)
    x = torch.rand(2, 3, 224, 224)
    with torch.inference_mode():
        expected = reference.eval()((x - IMAGENET_MEAN) / IMAGENET_STD)
        np.testing.assert_allclose(ours(x).numpy(), expected.numpy(), rtol=0, atol=1e-4)


def test_conch_v1_takes_the_whole_coca_file_and_refuses_one_without_its_pooler(
    tmp_path: Path,
) -> None:
    # CONCH's pytorch_model.bin is the whole CoCa: the text towers, the caption pooler and
    # the contrastive projection are in it and left out by the recipe
    tower = build(ENCODERS["conch_v1"], device="cpu").backbone
    state = seeded_like(tower.state_dict(), 4)
    extra = {
        "text.token_embedding.weight": torch.zeros(8, 4),
        "text_decoder.ln_final.weight": torch.ones(4),
        "logit_scale": torch.tensor(2.6),
        "visual.proj_contrast": torch.zeros(512, 512),
        "visual.attn_pool_caption.query": torch.zeros(256, 768),
        "visual.ln_caption.weight": torch.ones(768),
    }
    weights = tmp_path / "pytorch_model.bin"
    torch.save({**state, **extra}, weights)
    ours = encoder("conch_v1", weights, download=False)
    tower.load_state_dict(state)
    x = torch.rand(1, 3, 448, 448)
    mean = torch.tensor((0.48145466, 0.4578275, 0.40821073)).view(1, 3, 1, 1)
    std = torch.tensor((0.26862954, 0.26130258, 0.27577711)).view(1, 3, 1, 1)
    with torch.inference_mode():
        np.testing.assert_allclose(
            ours(x).numpy(), tower.eval()((x - mean) / std).numpy(), rtol=0, atol=1e-5
        )
    del state["visual.ln_contrast.weight"]
    torch.save({**state, **extra}, weights)
    with pytest.raises(WeightsError, match=r"visual\.ln_contrast\.weight"):
        encoder("conch_v1", weights, download=False)
