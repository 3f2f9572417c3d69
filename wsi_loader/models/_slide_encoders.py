"""Slide encoders by name: one embedding per slide from the tile features of the patch
encoder each was trained on (the per-slide h5 files `wsi_loader.features` writes).

A `SlideRecipe` says which patch encoder's features the slide encoder takes (its registry
name, and the resolution and patch size when the slide encoder reads positions from the
coordinates), where its weights are, and the output width. Each architecture is written here
in plain torch with the module names of the authors' own code, so that the published file
loads strictly (the first missing, unexpected or misshapen key is named; nothing is loaded
partly). Weights are found as the patch encoders' are (`_encoder_weights`: ``weights=`` a file
or folder, else the local Hugging Face cache, else a download).

An entry whose architecture is not written here yet (``wired=False``) is listed with the
reason, and asking for it is a `ConfigError` saying so: never a stand-in network.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from wsi_loader.errors import ConfigError, WeightsError
from wsi_loader.models._encoder_recipes import Recipe, registry_key
from wsi_loader.models._encoder_weights import read_state, resolve_weights, weights_error

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SlideRecipe:
    """One slide encoder.

    ``patch_encoder``: the registry name of the patch encoder whose features it takes (the
    ``model`` attribute of a features file is ``encoder:<name>``), ``input_dim`` their width.
    ``mpp`` and ``patch_size``: the tile resolution and size of its training features; with
    ``positions`` (the slide encoder reads where tiles are from their coordinates) features
    at another resolution or patch size are refused, else they are a warning. ``repo`` None:
    the weights are not on the Hugging Face hub (``weights_url`` says where), so only a given
    file loads. ``state_key``: the entry of the file holding the state dict (None: the file
    is it). ``prefix``: the slide encoder's tensors in the file are those under this name
    (``vision_encoder.``), the prefix dropped; ``unused``: the file's tensors of other parts
    of the published model (a text tower: fnmatch patterns), left out by design.
    """

    name: str
    title: str
    dim: int
    patch_encoder: str
    input_dim: int
    repo: str | None
    file: str
    licence: str
    gated: bool
    mpp: float | None = None
    patch_size: int | None = None
    positions: bool = False
    precision: str = "float32"
    weights_url: str | None = None
    state_key: str | None = None
    prefix: str = ""
    unused: tuple[str, ...] = ()
    wired: bool = True
    notes: str = ""

    def weights_recipe(self) -> Recipe:
        """The fields `_encoder_weights` reads (repo, file, licence), as a patch `Recipe`:
        the input fields of a tile recipe do not apply to a slide encoder and are neutral."""
        return Recipe(
            name=self.name,
            title=self.title,
            architecture="slide",
            model=self.name,
            dim=self.dim,
            repo=self.repo,
            files=(self.file,),
            licence=self.licence,
            gated=self.gated,
            size=None,
            mean=(0.0, 0.0, 0.0),
            std=(1.0, 1.0, 1.0),
            mpp=self.mpp or 0.0,
            patch_size=self.patch_size or 0,
            state_key=self.state_key,
            unused=self.unused,
        )

    def describe(self) -> dict[str, Any]:
        """The recipe as plain JSON values (``wsi-loader encoders --slide --json``)."""
        return {
            "name": self.name,
            "title": self.title,
            "kind": "slide",
            "dim": self.dim,
            "patch_encoder": self.patch_encoder,
            "input_dim": self.input_dim,
            "mpp": self.mpp,
            "patch_size": self.patch_size,
            "positions": self.positions,
            "precision": self.precision,
            "repo": self.repo,
            "file": self.file,
            "weights_url": self.weights_url,
            "licence": self.licence,
            "gated": self.gated,
            "wired": self.wired,
            "notes": self.notes,
        }


_HF_CODE = (
    "its architecture is published only as code in its Hugging Face repo (trust_remote_code), "
    "which could not be read to write it here; not wired yet"
)

# fmt: off
SLIDE_RECIPES: tuple[SlideRecipe, ...] = (
    SlideRecipe(
        "chief", "CHIEF (gated attention MIL over CHIEF's CTransPath features)", 768,
        "ctranspath", 768, None, "CHIEF_pretraining.pth", "AGPL-3.0", True,
        weights_url="https://drive.google.com/drive/folders/1uRv9A1HuTW5m_pJoyMzdN31bE1i-tDaV",
        notes="CHIEF's WSI_feature: the attention-weighted mean of the tile features; no "
        "coordinates; weights on request from CHIEF's authors (Google Drive), so --weights FILE",
    ),
    SlideRecipe(
        "titan", "TITAN (ViT over a 2-D grid of CONCH v1.5 features)", 768, "conch_v15", 768,
        "MahmoodLab/TITAN", "model.safetensors", "CC-BY-NC-ND-4.0", True, 0.5, 512,
        positions=True, precision="float16", prefix="vision_encoder.",
        unused=("text_encoder.*",),
        notes="the vision tower's contrastive pooler output without the projection "
        "(encode_slide_from_patch_features); tiles on a grid of patch_size_level0, 2-D ALiBi",
    ),
    SlideRecipe(
        "gigapath_slide", "Prov-GigaPath slide encoder (LongNet, 12 layers)", 768, "gigapath",
        1536, "prov-gigapath/prov-gigapath", "slide_encoder.pth", "Apache-2.0", True, 0.5, 256,
        positions=True, precision="float16", state_key="model",
        notes="the README's usage: class token after the last layer and the norms "
        "(TRIDENT takes layer 11's mean token instead); tiles on a 1000 x 1000 grid of "
        "patch_size_level0; LongNet dilated attention",
    ),
    SlideRecipe(
        "madeleine", "MADELEINE (multi-head gated attention over CONCH v1 features)", 512,
        "conch_v1", 512, "MahmoodLab/madeleine", "model.pt", "CC-BY-NC-ND-4.0", True, 1.0, 256,
        prefix="module.",
        notes="its H&E embedding (encode_he); the architecture from model_config.json beside "
        "model.pt (pass the snapshot folder); trained on 10x breast slides",
    ),
    SlideRecipe(
        "feather", "Feather (MIL-Lab's ABMIL pretrained on 108 tasks, CONCH v1.5 features)",
        512, "conch_v15", 768, "MahmoodLab/abmil.base.conch_v15.pc108-24k",
        "model.safetensors", "CC-BY-NC-ND-4.0", True, prefix="model.",
        notes="ABMIL's forward_features (as TRIDENT calls it); the widths from config.json "
        "beside model.safetensors (pass the snapshot folder)",
    ),
    SlideRecipe(
        "prism", "PRISM (Perceiver over Virchow features)", 1280, "virchow", 2560,
        "paige-ai/Prism",
        "model.safetensors", "CC-BY-NC-ND-4.0", True, precision="float16", wired=False,
        notes=_HF_CODE,
    ),
)
# fmt: on
SLIDE_ENCODERS = {r.name: r for r in SLIDE_RECIPES}
# TRIDENT's names where ours differ (its "gigapath" is the patch encoder's name here)
SLIDE_ALIASES = {"gigapath": "gigapath_slide", "prov_gigapath_slide": "gigapath_slide"}


def slide_recipe_of(name: str) -> SlideRecipe:
    """The registry entry of a slide encoder name (or TRIDENT's name for it)."""
    return SLIDE_ENCODERS[registry_key(name, SLIDE_ENCODERS, SLIDE_ALIASES, "slide encoder")]


class SlideEncoder(nn.Module):
    """A registry slide encoder: a slide's tile features (N, D) with their level-0
    coordinates (N, 2) and the level-0 patch size -> its embedding (``dim``,)."""

    def __init__(self, recipe: SlideRecipe, net: nn.Module) -> None:
        super().__init__()
        self.recipe = recipe
        self.name = recipe.name
        self.dim = recipe.dim
        self.net = net

    def forward(
        self, features: torch.Tensor, coords: torch.Tensor, patch_size_level0: int | None
    ) -> torch.Tensor:
        if not self.recipe.positions:  # (CHIEF: attention over the bag, no positions)
            return self._run(features)
        if patch_size_level0 is None or patch_size_level0 <= 0:
            raise ConfigError(
                f"slide encoder {self.name} places tiles by their coordinates: it needs the "
                "tiles' edge in level-0 pixels (patch_size_level0)",
                key="patch_size_level0",
                value=patch_size_level0,
            )
        return self._run(features, coords, int(patch_size_level0))

    def _run(self, *inputs: Any) -> torch.Tensor:
        device = inputs[0].device
        if device.type == "cuda" and self.recipe.precision != "float32":
            # the precision the authors run it in (TRIDENT's); embeddings come back float32
            with torch.autocast("cuda", dtype=getattr(torch, self.recipe.precision)):
                return self.net(*inputs).float()  # type: ignore[no-any-return]
        return self.net(*inputs)  # type: ignore[no-any-return]


def build_slide_encoder(recipe: SlideRecipe, device: str | torch.device = "meta") -> SlideEncoder:
    """The recipe's architecture without weights (on ``meta``: no memory, no init)."""
    if not recipe.wired:
        raise ConfigError(
            f"slide encoder {recipe.name} ({recipe.title}) is listed but cannot run yet: "
            f"{recipe.notes}",
            key="model",
            value=recipe.name,
        )
    with torch.device(device):
        if recipe.name == "chief":
            from wsi_loader.models._slide_chief import Chief

            net: nn.Module = Chief()
        elif recipe.name == "titan":
            from wsi_loader.models._slide_titan import Titan

            net = Titan()
        elif recipe.name == "madeleine":
            from wsi_loader.models._slide_madeleine import Madeleine

            net = Madeleine()  # (the released widths; the config beside the weights decides)
        elif recipe.name == "feather":
            from wsi_loader.models._slide_feather import Feather

            net = Feather()  # (the released widths; the config beside the weights decides)
        elif recipe.name == "gigapath_slide":
            from wsi_loader.models._slide_gigapath import GigaPathSlide

            net = GigaPathSlide()
        else:  # a wired recipe without a builder is a bug here, not the user's
            raise AssertionError(f"no builder for slide encoder {recipe.name}")
    return SlideEncoder(recipe, net)


def slide_encoder(
    name: str,
    weights: str | Path | None = None,
    *,
    download: bool = True,
    device: str | torch.device = "cpu",
) -> SlideEncoder:
    """The registry slide encoder ``name`` with its weights, in eval mode.

    ``weights``: the published file, or a folder holding it; else the local Hugging Face
    cache; else (``download``) the hub. A file that does not fit the architecture is refused
    naming its first mismatching key.
    """
    recipe = slide_recipe_of(name)
    module = build_slide_encoder(recipe)
    path = _weights_path(recipe, weights, download)
    if recipe.name in ("madeleine", "feather"):  # their widths: the config beside the weights
        from wsi_loader.models._slide_feather import feather_from_config
        from wsi_loader.models._slide_madeleine import madeleine_from_config

        configured = madeleine_from_config if recipe.name == "madeleine" else feather_from_config
        try:
            module.net = configured(path)
        except ValueError as exc:
            raise weights_error(recipe.weights_recipe(), str(exc), path) from exc
    state = read_state(recipe.weights_recipe(), path)
    if recipe.prefix and any(k.startswith(recipe.prefix) for k in state):
        state = {k.removeprefix(recipe.prefix): v for k, v in state.items()}
    load_strict(module.net, state, recipe, path)
    return module.to(device).eval()


def _weights_path(recipe: SlideRecipe, weights: str | Path | None, download: bool) -> Path:
    wrecipe = recipe.weights_recipe()
    if weights is None and recipe.repo is None:
        raise WeightsError(
            f"no weights for slide encoder {recipe.name}: they are not on the Hugging Face hub; "
            f"download {recipe.file} from {recipe.weights_url} (licence {recipe.licence}) and "
            "pass it with --weights FILE",
            encoder=recipe.name,
            repo=None,
        )
    return resolve_weights(wrecipe, weights, download=download and recipe.repo is not None)


def load_strict(
    net: nn.Module, state: dict[str, torch.Tensor], recipe: SlideRecipe, path: Path
) -> None:
    """Load ``state`` into ``net`` (built on meta), refusing the first key or shape that
    differs from the architecture: no partial load."""
    expected = net.state_dict()
    what = None
    for key, value in state.items():
        if key not in expected:
            what = f"the file has {key!r}, which the architecture lacks"
        elif tuple(value.shape) != tuple(expected[key].shape):
            what = (
                f"{key!r} is {tuple(value.shape)} in the file but "
                f"{tuple(expected[key].shape)} in the architecture"
            )
        if what:
            break
    else:
        missing = [key for key in expected if key not in state]
        if missing:
            what = f"the file lacks {missing[0]!r}"
    if what:
        raise weights_error(
            recipe.weights_recipe(),
            f"the weights do not fit slide encoder {recipe.name}: {what}; the published file "
            f"is {recipe.file}" + (f" of {recipe.repo}" if recipe.repo else ""),
            path,
        )
    state = {k: v.float() if v.is_floating_point() else v for k, v in state.items()}
    net.load_state_dict(state, strict=True, assign=True)
