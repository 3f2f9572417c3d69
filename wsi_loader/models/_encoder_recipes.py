"""The registry of pathology patch encoders: each entry is its model card's recipe.

A `Recipe` says how the card builds the network (the architecture and its constructor
arguments), where the weights are (Hugging Face repo id, file, licence, gated or not), how a
tile becomes the input (resize, centre crop, mean/std), the resolution and patch size the
model was trained at, how the output tokens are pooled, the output width and the precision the
card recommends. Nothing here imports a model package: the recipes are data, read by
`_encoders` (which builds them) and by ``wsi-loader encoders``.

Where TRIDENT (trident/patch_encoder_models/load.py) or LazySlide differ from the card, the
card wins; each such place says so in the entry's ``notes``.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from wsi_loader.errors import ConfigError

# pooler: the model's own pooling (transformers' pooler_output, CONCH's attention pooler)
Pooling = Literal["cls", "cls+mean", "avg", "pooler"]
IMAGENET = ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))
OPENAI_CLIP = ((0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711))
INCEPTION = ((0.5, 0.5, 0.5), (0.5, 0.5, 0.5))
HOPTIMUS = ((0.707223, 0.578729, 0.703617), (0.211883, 0.230117, 0.177517))
HIBOU = ((0.7068, 0.5755, 0.722), (0.195, 0.2316, 0.1816))
LUNIT = ((0.70322989, 0.53606487, 0.66096631), (0.21716536, 0.26081574, 0.20723464))
SWIGLU = {"mlp_layer": "SwiGLUPacked", "act_layer": "SiLU"}  # timm layers named, not imported


@dataclass(frozen=True)
class Recipe:
    """One encoder's model card recipe.

    ``architecture``: who builds it: ``timm`` (``model`` is the timm name, ``kwargs`` its
    constructor arguments; ``mlp_layer``/``act_layer`` are timm/torch layer names),
    ``transformers`` (``model`` is the transformers class), ``resnet50_trunc`` and
    ``ctranspath`` (our own code, ``ctranspath`` on timm's Swin), ``conch`` and ``conch_v15``
    (CONCH's vision towers around a timm ViT, `_conch`) or ``musk`` (MUSK's BEiT-3 vision
    path in plain torch, `_musk`). ``files``: the weight file the hub serves, first the one the
    card loads, then alternatives in the same key layout. ``state_key``: the entry of that file
    holding the state dict (None: the file is the state dict). ``unused``: keys of the file the
    recipe leaves out by design (fnmatch patterns: a truncated network's later layers, buffers
    the architecture rebuilds). ``resize``: the
    shorter side tiles are resized to before the centre crop to ``size`` (None: no resize;
    ``size`` None: the tile as read). ``prefix_tokens``: the class and register tokens before
    the patch tokens (pooling ``cls+mean`` averages the tokens after them).
    """

    name: str
    title: str
    architecture: str
    model: str
    dim: int
    repo: str | None
    files: tuple[str, ...]
    licence: str
    gated: bool
    size: int | None
    mean: tuple[float, float, float]
    std: tuple[float, float, float]
    mpp: float
    patch_size: int
    pooling: Pooling = "cls"
    precision: str = "float16"
    kwargs: dict[str, Any] = field(default_factory=dict)
    resize: int | None = None
    interpolation: Literal["bilinear", "bicubic"] = "bilinear"
    prefix_tokens: int = 1
    repo_type: str = "model"
    subfolder: str | None = None
    state_key: str | None = None
    unused: tuple[str, ...] = ()
    packages: tuple[str, ...] = ()
    notes: str = ""

    def describe(self) -> dict[str, Any]:
        """The recipe as plain JSON values (what ``wsi-loader encoders --json`` prints)."""
        return {
            "name": self.name,
            "title": self.title,
            "dim": self.dim,
            "size": self.size,
            "resize": self.resize,
            "interpolation": self.interpolation,
            "mean": list(self.mean),
            "std": list(self.std),
            "mpp": self.mpp,
            "magnification": round(10 / self.mpp),
            "patch_size": self.patch_size,
            "pooling": self.pooling,
            "precision": self.precision,
            "architecture": self.architecture,
            "model": self.model,
            "kwargs": {k: v for k, v in self.kwargs.items()},
            "repo": self.repo,
            "repo_type": self.repo_type,
            "file": "/".join(p for p in (self.subfolder, self.files[0]) if p),
            "licence": self.licence,
            "gated": self.gated,
            "packages": list(self.packages),
            "notes": self.notes,
        }


def _vit_timm(**kwargs: Any) -> dict[str, Any]:
    return {"num_classes": 0, "dynamic_img_size": True, **kwargs}


BIN = ("pytorch_model.bin", "model.safetensors")
SAFE = ("model.safetensors", "pytorch_model.bin")
NC_ND = "CC-BY-NC-ND-4.0"
_KAIKO = {
    "kaiko_vits16": ("vit_small_patch16_224", 384, "ViT-S/16", {}),
    "kaiko_vits8": ("vit_small_patch8_224", 384, "ViT-S/8", {}),
    "kaiko_vitb16": ("vit_base_patch16_224", 768, "ViT-B/16", {}),
    "kaiko_vitb8": ("vit_base_patch8_224", 768, "ViT-B/8", {}),
    "kaiko_vitl14": ("vit_large_patch14_reg4_dinov2", 1024, "ViT-L/14", {"img_size": 518}),
}

# fmt: off
RECIPES: tuple[Recipe, ...] = (
    Recipe(
        "uni_v1", "UNI (ViT-L/16)", "timm", "vit_large_patch16_224", 1024,
        "MahmoodLab/UNI", BIN, NC_ND, True, 224, *IMAGENET, 0.5, 256,
        kwargs=_vit_timm(img_size=224, patch_size=16, init_values=1e-5),
        resize=224,
        notes="card: Resize(224), CenterCrop(224), ImageNet mean/std; 256 px tiles at 20x",
    ),
    Recipe(
        "uni_v2", "UNI2-h (ViT-H/14, 8 registers)", "timm", "vit_giant_patch14_224", 1536,
        "MahmoodLab/UNI2-h", BIN, NC_ND, True, 224, *IMAGENET, 0.5, 256,
        precision="bfloat16",
        kwargs=_vit_timm(
            img_size=224, patch_size=14, depth=24, num_heads=24, init_values=1e-5,
            embed_dim=1536, mlp_ratio=2.66667 * 2, no_embed_class=True, reg_tokens=8, **SWIGLU,
        ),
        resize=224, prefix_tokens=9,
    ),
    Recipe(
        "conch_v1", "CONCH (ViT-B/16 of a CoCa, attention pooler)", "conch",
        "vit_base_patch16_224", 512, "MahmoodLab/CONCH", ("pytorch_model.bin",), NC_ND, True,
        448, *OPENAI_CLIP, 0.5, 512,
        pooling="pooler", precision="float32", kwargs=_vit_timm(img_size=448, patch_size=16),
        resize=448, interpolation="bicubic",
        unused=("text.*", "text_decoder.*", "logit_scale", "visual.proj_contrast",
                "visual.attn_pool_caption.*", "visual.ln_caption.*"),
        notes="encode_image(proj_contrast=False, normalize=False) as TRIDENT uses it: the "
        "trunk's tokens through the contrastive attention pooler and its LayerNorm; the "
        "file's text towers and caption pooler are left out; CONCH's transform: Resize(448, "
        "bicubic), CenterCrop(448), OpenAI CLIP mean/std",
    ),
    Recipe(
        "conch_v15", "CONCH v1.5 (ViT-L/16, attention pooler)", "conch_v15",
        "vit_large_patch16_224", 768, "MahmoodLab/conchv1_5", ("pytorch_model_vision.bin",),
        NC_ND, True, 448, *IMAGENET, 0.5, 512,
        pooling="pooler",
        kwargs={"num_classes": 0, "img_size": 448, "patch_size": 16, "init_values": 1.0},
        resize=448,
        notes="as TRIDENT's and TITAN's conchv1_5 (the card's code): ViT-L/16 with layer "
        "scale 1.0 run at 448 px, its 224 px position grid stretched bicubically to 28 x 28 "
        "when loaded, pooled by the attention pooler and its LayerNorm; TRIDENT's transform: "
        "Resize(448, bilinear), CenterCrop(448), ImageNet mean/std",
    ),
    Recipe(
        "virchow", "Virchow (ViT-H/14)", "timm", "vit_huge_patch14_224", 2560,
        "paige-ai/Virchow", BIN, "Apache-2.0", True, 224, *IMAGENET, 0.5, 224,
        pooling="cls+mean",
        kwargs=_vit_timm(img_size=224, init_values=1e-5, mlp_ratio=5.3375, global_pool="",
                         **SWIGLU),
        resize=224, interpolation="bicubic",
        notes="card: timm's transform (Resize 224 bicubic, crop_pct 1); embedding = "
        "[class token, mean of the 256 patch tokens]",
    ),
    Recipe(
        "virchow2", "Virchow 2 (ViT-H/14, 4 registers)", "timm", "vit_huge_patch14_224", 2560,
        "paige-ai/Virchow2", BIN, NC_ND, True, 224, *IMAGENET, 0.5, 224,
        pooling="cls+mean",
        kwargs=_vit_timm(img_size=224, init_values=1e-5, mlp_ratio=5.3375, global_pool="",
                         reg_tokens=4, **SWIGLU),
        resize=224, interpolation="bicubic", prefix_tokens=5,
        notes="embedding = [class token, mean of the patch tokens after the 4 registers]; "
        "trained at 5x-40x, 20x recommended",
    ),
    Recipe(
        "hoptimus0", "H-optimus-0 (ViT-g/14, 4 registers)", "timm",
        "vit_giant_patch14_reg4_dinov2", 1536, "bioptimus/H-optimus-0", SAFE, "Apache-2.0",
        True, 224, *HOPTIMUS, 0.5, 224,
        kwargs={"num_classes": 0, "img_size": 224, "global_pool": "token", "init_values": 1e-5,
                "dynamic_img_size": False},
        prefix_tokens=5,
        notes="card: ToTensor + Normalize only (224 px tiles at 0.5 um/px, no resize)",
    ),
    Recipe(
        "hoptimus1", "H-optimus-1 (ViT-g/14, 4 registers)", "timm",
        "vit_giant_patch14_reg4_dinov2", 1536, "bioptimus/H-optimus-1", SAFE,
        "other (Bioptimus non-commercial)", True, 224, *HOPTIMUS, 0.5, 224,
        kwargs={"num_classes": 0, "img_size": 224, "global_pool": "token", "init_values": 1e-5,
                "dynamic_img_size": False},
        prefix_tokens=5,
    ),
    Recipe(
        "h0_mini", "H0-mini (ViT-B/14, 4 registers, distilled from H-optimus-1)", "timm",
        "vit_base_patch14_reg4_dinov2", 1536, "bioptimus/H0-mini", SAFE, NC_ND, True, 224,
        *HOPTIMUS, 0.5, 224, pooling="cls+mean",
        kwargs={"num_classes": 0, "img_size": 224, "global_pool": "", "init_values": 1e-5,
                "reg_tokens": 4, "mlp_ratio": 5.33334, "dynamic_img_size": True, **SWIGLU},
        resize=224, interpolation="bicubic", prefix_tokens=5,
        notes="card recommends [class token, mean of patch tokens] (1536) for linear probes; "
        "TRIDENT defaults to the class token alone (768); SwiGLU 4096 wide as H-optimus "
        "(mlp_ratio 5.33334: 85.7M parameters as published; timm's default 4 gives 71.6M)",
    ),
    Recipe(
        "gigapath", "Prov-GigaPath tile encoder (ViT-g/16)", "timm",
        "vit_giant_patch14_dinov2", 1536, "prov-gigapath/prov-gigapath", BIN, "Apache-2.0",
        True, 224, *IMAGENET, 0.5, 256,
        kwargs=_vit_timm(img_size=224, in_chans=3, patch_size=16, embed_dim=1536, depth=40,
                         num_heads=24, init_values=1e-5, mlp_ratio=5.33334),
        resize=256, interpolation="bicubic",
        notes="card: Resize(256, bicubic), CenterCrop(224)",
    ),
    Recipe(
        "phikon", "Phikon (iBOT ViT-B/16)", "transformers", "ViTModel", 768, "owkin/phikon",
        SAFE, "other (Owkin non-commercial)", False, 224, *IMAGENET, 0.5, 224,
        precision="float32", kwargs={"add_pooling_layer": False}, resize=224,
        packages=("transformers",), notes="last_hidden_state[:, 0] (class token)",
    ),
    Recipe(
        "phikon_v2", "Phikon-v2 (DINOv2 ViT-L/16)", "transformers", "AutoModel", 1024,
        "owkin/phikon-v2", SAFE, "other (Owkin non-commercial)", False, 224, *IMAGENET, 0.5,
        224, precision="float32", resize=224, packages=("transformers",),
        notes="last_hidden_state[:, 0] (class token)",
    ),
    Recipe(
        "hibou_b", "Hibou-B (DINOv2 ViT-B/14, 4 registers)", "transformers", "AutoModel", 768,
        "histai/hibou-b", SAFE, "Apache-2.0", False, 224, *HIBOU, 0.5, 224,
        pooling="pooler", precision="float32", resize=224, interpolation="bicubic",
        packages=("transformers",), kwargs={"trust_remote_code": True},
        notes="pooler_output; the hub's modelling code runs (trust_remote_code)",
    ),
    Recipe(
        "hibou_l", "Hibou-L (DINOv2 ViT-L/14, 4 registers)", "transformers", "AutoModel", 1024,
        "histai/hibou-L", SAFE, "Apache-2.0", False, 224, *HIBOU, 0.5, 224,
        pooling="pooler", precision="float32", resize=224, interpolation="bicubic",
        packages=("transformers",), kwargs={"trust_remote_code": True},
    ),
    Recipe(
        "midnight", "Midnight-12k (DINOv2 ViT-g/14)", "transformers", "AutoModel", 3072,
        "kaiko-ai/midnight", SAFE, "MIT", False, 224, *INCEPTION, 0.5, 224,
        pooling="cls+mean", resize=224, packages=("transformers",),
        notes="card's classification embedding = [class token, mean of patch tokens] (3072); "
        "TRIDENT defaults to the class token alone (1536)",
    ),
    *(
        Recipe(
            name, f"kaiko.ai {title}", "timm", model, dim,
            f"1aurent/{model}.kaiko_ai_towards_large_pathology_fms", SAFE,
            "other (kaiko.ai, see card)", False, 224, *INCEPTION, 0.5, 224,
            precision="float32", kwargs=_vit_timm(**extra), resize=224,
            prefix_tokens=5 if "reg4" in model else 1,
            notes="timm port of kaiko-ai/towards_large_pathology_fms (as TRIDENT loads it); "
            "class token",
        )
        for name, (model, dim, title, extra) in _KAIKO.items()
    ),
    Recipe(
        "ctranspath", "CTransPath (Swin-T + conv stem, CHIEF's weights)", "ctranspath",
        "swin_tiny_patch4_window7_224", 768, "MahmoodLab/hest-bench",
        ("CHIEF_CTransPath.pth",), "GPL-3.0", True, 224, *IMAGENET, 1.0, 256,
        precision="float32", resize=224, repo_type="dataset", subfolder="fm_v1/ctranspath",
        state_key="model", unused=("head.*", "*.attn_mask"), pooling="avg",
        notes="Swin-T with CTransPath's convolutional stem; attn_mask buffers of the file "
        "are rebuilt, not loaded; 256 px at 10x as TRIDENT recommends",
    ),
    Recipe(
        "musk", "MUSK (BEiT-3 ViT-L/16, multi-scale)", "musk", "musk_large_patch16_384", 2048,
        "xiangjx/musk", ("model.safetensors",), NC_ND, True, 384, *INCEPTION, 0.5, 384,
        resize=384, interpolation="bicubic",
        unused=("beit3.text_embed.*", "beit3.vision_embed.mask_token", "*.B.*",
                "language_head.*", "vision_head.*", "logit_scale"),
        notes="the card's features for linear probes and MIL (MUSK's README: model(image=x, "
        "with_head=False, out_norm=False, ms_aug=True, return_global=True)[0]): class token "
        "at 384 px + mean class token of the 2 x 2 quarters upscaled to 768 px, 2,048 wide; "
        "TRIDENT's default (inference_aug=False) is the first 1,024; BEiT-3's vision path in "
        "plain torch (`_musk`), the file's text copies and heads left out",
    ),
    Recipe(
        "lunit_vits8", "Lunit DINO ViT-S/8", "timm", "vit_small_patch8_224", 384,
        "1aurent/vit_small_patch8_224.lunit_dino", SAFE, "other (Lunit non-commercial)",
        False, 224, *LUNIT, 0.5, 224, precision="float32",
        kwargs=_vit_timm(img_size=224), resize=224,
    ),
    Recipe(
        "resnet50_trunc", "ResNet-50 to layer 3 + average pool (CLAM)", "resnet50_trunc",
        "resnet50", 1024, "timm/resnet50.tv_in1k", ("model.safetensors", "pytorch_model.bin"),
        "BSD-3-Clause (torchvision)", False, None, *IMAGENET, 0.5, 256, pooling="avg",
        precision="float32", unused=("layer4.*", "fc.*"),
        notes="CLAM's extract_features_fp.py: ImageNet ResNet-50 (torchvision's IMAGENET1K_V1) "
        "through layer 3, adaptive average pool; tiles as read (no resize, CLAM's default); "
        "TRIDENT resizes to 224 instead",
    ),
)

# fmt: on
ENCODERS: dict[str, Recipe] = {recipe.name: recipe for recipe in RECIPES}
# the names TRIDENT and LazySlide use, for users coming from them (not TRIDENT's "resnet50":
# a bare torchvision name stays the error that asks for torchvision:resnet50)
# fmt: off
ALIASES = {
    "uni": "uni_v1", "uni2": "uni_v2", "uni2-h": "uni_v2", "conch": "conch_v1",
    "conchv1_5": "conch_v15", "h-optimus-0": "hoptimus0", "h-optimus-1": "hoptimus1",
    "h0-mini": "h0_mini", "prov-gigapath": "gigapath", "phikon-v2": "phikon_v2",
    "midnight12k": "midnight", "lunit-vits8": "lunit_vits8", "resnet50_trunc": "resnet50_trunc",
    **{name.replace("_", "-"): name for name in _KAIKO},
}
# fmt: on


def registry_key(
    name: str, entries: Mapping[str, Any], aliases: Mapping[str, str], what: str
) -> str:
    """The registry key of ``name`` (case-insensitive, a peer's alias accepted) among
    ``entries``; else a `ConfigError` suggesting the closest name and the command that lists
    them (``what``: "encoder", "slide encoder")."""
    key = aliases.get(name.lower(), name.lower())
    if key not in entries:
        close = difflib.get_close_matches(key, [*entries, *aliases], n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        lister = "wsi-loader encoders --slide" if what == "slide encoder" else "wsi-loader encoders"
        raise ConfigError(
            f"no {what} {name!r}{hint}; `{lister}` lists them", key="model", value=name
        )
    return key
