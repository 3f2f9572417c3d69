"""Patch encoders by name: a registry recipe (`_encoder_recipes`) built into a module that
takes tiles as read and applies the card's preprocessing, pooling and output width.

``encoder("uni_v2")`` builds the architecture on the meta device (no memory, no random
init), finds the weights offline first (`_encoder_weights`), refuses a file whose keys or
shapes differ from the architecture (naming the first difference) and loads it in place.
"""

from __future__ import annotations

import importlib
import logging
import re
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F  # noqa: N812

from wsi_loader.errors import ConfigError, WeightsError
from wsi_loader.models._conch import conch_v1, conch_v15, conch_v15_positions
from wsi_loader.models._encoder_recipes import ALIASES, ENCODERS, Recipe, registry_key
from wsi_loader.models._encoder_weights import read_state, resolve_weights, weights_error
from wsi_loader.models._musk import MuskVision
from wsi_loader.models._specs import Model

log = logging.getLogger(__name__)


def recipe_of(name: str) -> Recipe:
    """The registry entry of a name (or of TRIDENT's / LazySlide's name for it)."""
    return ENCODERS[registry_key(name, ENCODERS, ALIASES, "encoder")]


def is_encoder_name(spec: object) -> bool:
    """Whether a model spec names a registry encoder (``uni_v2``, ``encoder:uni_v2``)."""
    if not isinstance(spec, str):
        return False
    name = spec.removeprefix("encoder:").lower()
    return name in ENCODERS or name in ALIASES


class Encoder(nn.Module):
    """A registry encoder: tiles in [0, 1] (B, 3, H, W) as read -> (B, ``dim``) features.

    The card's preprocessing runs inside (resize of the shorter side, centre crop to
    ``size``, mean/std), so the module gives the card's features on tiles of any size; the
    recipe's fields (``dim``, ``size``, ``mean``, ``std``, ``mpp``, ``patch_size``,
    ``precision``) are attributes for the caller.
    """

    def __init__(self, recipe: Recipe, backbone: nn.Module) -> None:
        super().__init__()
        self.recipe = recipe
        self.backbone = backbone
        self.name = recipe.name
        self.dim = recipe.dim
        self.size = recipe.size
        self.mean = recipe.mean
        self.std = recipe.std
        self.mpp = recipe.mpp
        self.patch_size = recipe.patch_size
        self.precision = recipe.precision
        self.register_buffer("_mean", torch.tensor(recipe.mean).view(1, 3, 1, 1), False)
        self.register_buffer("_std", torch.tensor(recipe.std).view(1, 3, 1, 1), False)

    def preprocess(self, x: torch.Tensor) -> torch.Tensor:
        """The card's transform on a float batch in [0, 1]: resize, centre crop, normalize."""
        r = self.recipe
        target = r.resize or r.size
        if target is not None and min(x.shape[-2:]) != target:
            h, w = x.shape[-2:]
            scale = target / min(h, w)
            shape = (max(target, round(h * scale)), max(target, round(w * scale)))
            mode = r.interpolation
            x = F.interpolate(x, size=shape, mode=mode, antialias=True, align_corners=False)
            if mode == "bicubic":
                x = x.clamp(0, 1)  # PIL's bicubic clips overshoot to the pixel range
        if r.size is not None and tuple(x.shape[-2:]) != (r.size, r.size):
            h, w = x.shape[-2:]
            top, left = round((h - r.size) / 2.0), round((w - r.size) / 2.0)
            x = x[..., top : top + r.size, left : left + r.size]
        mean, std = self.get_buffer("_mean"), self.get_buffer("_std")
        return (x - mean.to(x.device, x.dtype)) / std.to(x.device, x.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.preprocess(x)
        run = self.__dict__.get("_compiled")
        run = self.backbone if run is None else run
        if x.device.type == "cuda" and self.precision != "float32":
            # the card's precision on the GPU; features come back float32
            with torch.autocast("cuda", dtype=getattr(torch, self.precision)):
                return self.pool(run(x)).float()
        return self.pool(run(x))

    def compile(self, *args: Any, **kwargs: Any) -> None:
        """``torch.compile`` the backbone (kept outside the module's state, so the weights'
        digest and keys stay those of the file)."""
        self.__dict__["_compiled"] = torch.compile(self.backbone, *args, **kwargs)

    def pool(self, out: Any) -> torch.Tensor:
        """The card's embedding from the backbone's output."""
        r = self.recipe
        if r.architecture == "transformers":
            if r.pooling == "pooler":
                return out.pooler_output  # type: ignore[no-any-return]
            out = out.last_hidden_state
        if isinstance(out, torch.Tensor) and out.ndim == 4:  # a CNN's feature map
            return out.mean(dim=(2, 3))
        if not isinstance(out, torch.Tensor) or out.ndim == 2:
            return out  # type: ignore[no-any-return]
        if r.pooling == "cls+mean":
            return torch.cat([out[:, 0], out[:, r.prefix_tokens :].mean(1)], dim=-1)
        if r.pooling == "avg":
            return out[:, r.prefix_tokens :].mean(1)
        return out[:, 0]


def encoder(
    name: str,
    weights: str | Path | None = None,
    *,
    download: bool = True,
    device: str | torch.device = "cpu",
    precision: str | None = None,
) -> Encoder:
    """The registry encoder ``name`` with its weights, ready for inference (eval mode).

    ``weights``: the file the hub serves, or a folder holding it (a snapshot folder); else
    the local Hugging Face cache; else (``download``) the hub. A `WeightsError` names the repo,
    the licence and what to do when none has them; a file that does not fit the architecture
    is refused with its first mismatching key. ``precision``: the autocast dtype on CUDA
    (default: the card's; ``float32`` turns it off).
    """
    recipe = recipe_of(name)
    if precision not in (None, "float32", "float16", "bfloat16"):
        raise ConfigError(
            "precision is float32, float16 or bfloat16", key="precision", value=precision
        )
    path = resolve_weights(recipe, weights, download=download)
    if recipe.architecture == "transformers":
        module = _transformers(recipe, path)
    else:
        module = build(recipe, device="meta")
        state = read_state(recipe, path)
        if recipe.architecture == "ctranspath":
            state = swin_from_original(state)
        elif recipe.architecture == "conch_v15" and recipe.size is not None:
            state = conch_v15_positions(state, recipe.size)
        load_checked(module, state, recipe, path)
    if precision is not None:
        module.precision = precision
    return module.to(device).eval()


def build(recipe: Recipe, device: str | torch.device = "meta") -> Encoder:
    """The recipe's architecture without weights (on ``meta``: no memory, no init)."""
    with torch.device(device):
        if recipe.architecture == "timm":
            backbone = _timm(recipe)
        elif recipe.architecture == "resnet50_trunc":
            from wsi_loader.models._resnet import resnet50_trunc

            backbone = resnet50_trunc()
        elif recipe.architecture == "ctranspath":
            backbone = _ctranspath(recipe)
        elif recipe.architecture == "conch":
            backbone = conch_v1(_timm(recipe), recipe.dim)
        elif recipe.architecture == "conch_v15":
            backbone = conch_v15(_timm(recipe), recipe.dim)
        elif recipe.architecture == "musk" and recipe.size is not None:
            backbone = MuskVision(recipe.size)
        elif recipe.architecture == "transformers":
            _import("transformers", recipe)
            raise ConfigError(
                f"encoder {recipe.name} is a transformers model: it is built from its snapshot "
                "folder (config.json beside the weights), so only with weights",
                key="model",
                value=recipe.name,
            )
        else:
            raise _needs(recipe)
    return Encoder(recipe, backbone)


def _import(package: str, recipe: Recipe) -> Any:
    try:
        return importlib.import_module(package)
    except Exception as exc:  # missing, or built for another torch (a RuntimeError)
        raise ConfigError(
            f"encoder {recipe.name} needs {package}, which cannot be imported here "
            f"({type(exc).__name__}: {exc}); pip install {package.partition('.')[0]}"
            + (
                f" (it needs a torchvision built for this torch, {torch.__version__})"
                if package.startswith("timm")
                else ""
            ),
            key="model",
            value=recipe.name,
        ) from exc


def _needs(recipe: Recipe) -> ConfigError:
    return ConfigError(
        f"encoder {recipe.name} is built by its own package ({', '.join(recipe.packages)}), "
        "which wsi_loader does not drive yet: " + recipe.notes,
        key="model",
        value=recipe.name,
    )


def _timm_kwargs(recipe: Recipe) -> dict[str, Any]:
    kwargs = dict(recipe.kwargs)
    if "mlp_layer" in kwargs:
        kwargs["mlp_layer"] = getattr(_import("timm.layers", recipe), kwargs["mlp_layer"])
    if "act_layer" in kwargs:
        kwargs["act_layer"] = getattr(nn, kwargs["act_layer"])
    return kwargs


def _timm(recipe: Recipe) -> nn.Module:
    timm = _import("timm", recipe)
    model: nn.Module = timm.create_model(recipe.model, pretrained=False, **_timm_kwargs(recipe))
    return model


def _ctranspath(recipe: Recipe) -> nn.Module:
    timm = _import("timm", recipe)
    from wsi_loader.models._resnet import ConvStem

    model: nn.Module = timm.create_model(
        recipe.model, pretrained=False, embed_layer=ConvStem, num_classes=0
    )
    return model


def _transformers(recipe: Recipe, path: Path) -> Encoder:
    """A transformers encoder from its snapshot folder (config.json beside the weights)."""
    transformers = _import("transformers", recipe)
    folder = path if path.is_dir() else path.parent
    cls = getattr(transformers, recipe.model)
    try:
        model = cls.from_pretrained(str(folder), local_files_only=True, **recipe.kwargs)
    except (OSError, ValueError) as exc:
        raise weights_error(
            recipe,
            f"{recipe.name}: cannot load the transformers model from {folder} ({exc}); it "
            "needs the snapshot folder (config.json beside the weights)",
            folder,
        ) from exc
    return Encoder(recipe, model)


def swin_from_original(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Swin weights in the original (and timm < 0.9) layout, as CTransPath's file has them, in
    timm's: each stage's patch merging moves from the end of stage i to the start of stage
    i + 1, and the buffers timm rebuilds (relative_position_index, attn_mask) are dropped (as
    timm's own ``checkpoint_filter_fn`` does)."""
    if "layers.0.downsample.reduction.weight" not in state:
        return state
    out = {}
    for key, value in state.items():
        if "relative_position_index" in key or "attn_mask" in key:
            continue
        moved = re.sub(
            r"^layers\.(\d+)\.downsample", lambda m: f"layers.{int(m[1]) + 1}.downsample", key
        )
        out[moved] = value
    return out


def load_checked(
    module: Encoder, state: dict[str, torch.Tensor], recipe: Recipe, path: Path
) -> None:
    """Load ``state`` into the module built on meta, refusing the first key or shape that
    differs from the architecture (no partial load)."""
    expected = module.backbone.state_dict()
    for key, value in state.items():
        if key not in expected:
            raise _mismatch(recipe, path, f"the file has {key!r}, which the architecture lacks")
        if tuple(value.shape) != tuple(expected[key].shape):
            raise _mismatch(
                recipe,
                path,
                f"{key!r} is {tuple(value.shape)} in the file but "
                f"{tuple(expected[key].shape)} in the architecture",
            )
    for key in expected:
        if key not in state:
            raise _mismatch(recipe, path, f"the file lacks {key!r}")
    state = {k: v.float() if v.is_floating_point() else v for k, v in state.items()}
    module.backbone.load_state_dict(state, strict=True, assign=True)
    # buffers outside the state dict (non-persistent) are still on meta: build them for real
    left = [n for n, t in module.backbone.named_buffers() if t.is_meta]
    if left:
        real = build(recipe, device="cpu")
        real.backbone.load_state_dict(state, strict=True)
        module.backbone = real.backbone
    module._mean = torch.tensor(recipe.mean).view(1, 3, 1, 1)
    module._std = torch.tensor(recipe.std).view(1, 3, 1, 1)


def _mismatch(recipe: Recipe, path: Path, what: str) -> WeightsError:
    return weights_error(
        recipe,
        f"the weights do not fit encoder {recipe.name} ({recipe.architecture} {recipe.model}): "
        f"{what}; the hub's file is {recipe.repo}/{recipe.files[0]}",
        path,
    )


def encoder_model(
    name: str,
    weights: str | Path | None = None,
    *,
    download: bool = True,
    precision: str | None = None,
    compile: bool = False,
) -> Model:
    """A registry encoder as the `Model` a features/predict pass runs: tiles reach it as
    read in [0, 1] (its own preprocessing runs inside); ``mpp`` and ``patch_size`` are the
    resolution it was trained at. ``precision``: the autocast dtype on CUDA (default: the
    card's); ``compile``: ``torch.compile`` the backbone."""
    name = name.removeprefix("encoder:")
    module = encoder(name, weights, download=download, precision=precision)
    if compile:
        module.compile()
    return Model(
        module,
        f"encoder:{module.name}",
        mpp=module.mpp,
        patch_size=module.patch_size,
    )
