"""The slide encoder tests' helpers: published files' key layouts (seeded random weights in
them: `tests.models.encoder_weights.seeded_like`), per-slide features files as `wsi-loader
features` writes them, and the authors' own code imported from a checkout
(``WSI_LOADER_PEERS``: a folder holding e.g. ``CHIEF/``, a checkout of hms-dbmi/CHIEF; the
comparisons skip, saying so, without it)."""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
import types
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import pytest
import torch

# CHIEF_pretraining.pth's keys and shapes, read from CHIEF's models/CHIEF.py (size "small")
CHIEF_KEYS = {
    "attention_net.0.weight": (512, 768),
    "attention_net.0.bias": (512,),
    "attention_net.3.attention_a.0.weight": (256, 512),
    "attention_net.3.attention_a.0.bias": (256,),
    "attention_net.3.attention_b.0.weight": (256, 512),
    "attention_net.3.attention_b.0.bias": (256,),
    "attention_net.3.attention_c.weight": (1, 256),
    "attention_net.3.attention_c.bias": (1,),
    "classifiers.weight": (2, 512),
    "classifiers.bias": (2,),
    "instance_classifiers.0.weight": (2, 512),
    "instance_classifiers.0.bias": (2,),
    "instance_classifiers.1.weight": (2, 512),
    "instance_classifiers.1.bias": (2,),
    "att_head.fc1.weight": (256, 512),
    "att_head.fc1.bias": (256,),
    "att_head.fc2.weight": (1, 256),
    "att_head.fc2.bias": (1,),
    "text_to_vision.0.weight": (512, 768),
    "text_to_vision.0.bias": (512,),
    "organ_embedding": (19, 768),
}


def chief_state(seed: int = 0) -> dict[str, torch.Tensor]:
    """Seeded random weights in CHIEF_pretraining.pth's layout."""
    generator = torch.Generator().manual_seed(seed)
    return {
        key: torch.randn(shape, generator=generator) / (shape[-1] ** 0.5 if len(shape) == 2 else 4)
        for key, shape in CHIEF_KEYS.items()
    }


def write_features(
    folder: Path,
    name: str,
    tiles: int,
    *,
    model: str = "encoder:ctranspath",
    dim: int = 768,
    seed: int = 0,
    patch_size: int = 256,
    mpp: float = 1.0,
    patch_size_level0: int | None = 1024,
    content: str | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """A per-slide features file in the layout `wsi-loader features` writes; its arrays."""
    rng = np.random.default_rng(seed)
    features = rng.standard_normal((tiles, dim)).astype(np.float32)
    side = max(8, int(np.ceil(np.sqrt(tiles))) + 1)
    grid = rng.permutation(side * side)[:tiles]
    coords = np.stack([grid % side, grid // side], axis=1).astype(np.int64) * (
        patch_size_level0 or 256
    )
    folder.mkdir(parents=True, exist_ok=True)
    with h5py.File(folder / f"{name}.h5", "w") as h5:
        h5.create_dataset("features", data=features.reshape(tiles, dim))
        ds = h5.create_dataset("coords", data=coords.reshape(tiles, 2))
        attrs: dict[str, Any] = {
            "patch_size": patch_size,
            "patch_level": 0,
            "tile_size": patch_size,
            "mpp": mpp,
            "model": model,
            "content": content or f"{name}-{seed}-{tiles}",
        }
        if patch_size_level0 is not None:
            attrs["patch_size_level0"] = patch_size_level0
        h5.attrs.update(attrs)
        ds.attrs.update({k: attrs[k] for k in ("patch_size", "patch_level")})
    return features.reshape(tiles, dim), coords.reshape(tiles, 2)


def peer_root(name: str) -> Path:
    """The authors' checkout ``name`` under ``WSI_LOADER_PEERS``, or the test skips."""
    base = os.environ.get("WSI_LOADER_PEERS")
    if not base:
        pytest.skip(f"WSI_LOADER_PEERS is not set (a folder holding a {name} checkout)")
    root = Path(base) / name
    if not root.is_dir():
        pytest.skip(f"no {name} checkout in WSI_LOADER_PEERS ({root})")
    return root


@contextmanager
def peer_modules(
    root: Path, names: tuple[str, ...], stubs: dict[str, types.ModuleType] | None = None
) -> Iterator[None]:
    """Import from ``root`` (its top-level packages ``names``, e.g. CHIEF's ``models`` and
    ``utils``), with ``stubs`` (modules it imports, by name) standing in where their package
    is not installed; everything is removed from sys.modules afterwards."""
    saved = {k: v for k, v in sys.modules.items() if k.split(".")[0] in names}
    for key in saved:
        del sys.modules[key]
    stubs = stubs or {}
    missing = {n.split(".")[0] for n in stubs if importlib.util.find_spec(n.split(".")[0]) is None}
    added = [name for name in stubs if name.split(".")[0] in missing]
    sys.modules.update({name: stubs[name] for name in added})
    sys.path.insert(0, str(root))
    try:
        yield
    finally:
        sys.path.remove(str(root))
        for key in [k for k in sys.modules if k.split(".")[0] in names]:
            del sys.modules[key]
        for name in added:
            sys.modules.pop(name, None)
        sys.modules.update(saved)


def _module(name: str, **members: Any) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__dict__.update(members)
    return module


class _TimmMlp(torch.nn.Module):
    """timm.layers.Mlp as timm defines it (fc1, act, drop1, norm, fc2, drop2), for a peer
    that imports it where timm is not installed."""

    def __init__(
        self, in_features: int, hidden_features: int, act_layer: Any, drop: float = 0.0
    ) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(in_features, hidden_features)
        self.act = act_layer()
        self.drop1 = torch.nn.Dropout(drop)
        self.norm = torch.nn.Identity()
        self.fc2 = torch.nn.Linear(hidden_features, in_features)
        self.drop2 = torch.nn.Dropout(drop)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop2(self.fc2(self.norm(self.drop1(self.act(self.fc1(x))))))


def _unused(*args: Any, **kwargs: Any) -> Any:
    raise AssertionError("a stand-in the compared code path does not call")


def titan_stubs() -> dict[str, types.ModuleType]:
    """What TITAN's vision_transformer.py imports from timm and einops, for where they are
    not installed: timm's Mlp as timm writes it; weight init (no-ops: both sides get the
    same loaded weights); DropPath, checkpointing and einops.repeat are not reached in eval
    with one slide."""
    return {
        "timm": _module("timm"),
        "timm.layers": _module(
            "timm.layers", Mlp=_TimmMlp, DropPath=_unused, trunc_normal_=lambda *a, **k: None
        ),
        "timm.models": _module("timm.models"),
        "timm.models._manipulate": _module(
            "timm.models._manipulate", checkpoint_seq=_unused, named_apply=lambda *a, **k: None
        ),
        "timm.models.vision_transformer": _module(
            "timm.models.vision_transformer", get_init_weights_vit=lambda *a, **k: None
        ),
        "einops": _module("einops", repeat=_unused),
    }


def peer_titan(root: Path) -> Any:
    """TITAN's own vision tower (``vision_transformer.py`` of its Hugging Face repo, in a
    package ``titan_hf``), built with TitanVisionConfig's defaults and TitanConfig's
    attentional_pool="parallel"."""
    with peer_modules(root, ("titan_hf",), titan_stubs()):
        module = importlib.import_module("titan_hf.vision_transformer")
        return module.VisionTransformer(
            grid_size=14,
            global_pool="token",
            embed_dim=768,
            depth=6,
            num_heads=12,
            mlp_ratio=4.0,
            qkv_bias=True,
            mlp_patch_embed_dim=768,
            pos_encode_type="alibi",
            attentional_pool="parallel",
            attn_pooler_queries=128,
            attn_pooler_heads=8,
        ).eval()


def peer_chief(root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    """CHIEF's own ``CHIEF(size_arg="small")`` as its Get_CHIEF_WSI_level_feature.py builds
    it (its constructor reads ./model_weight/Text_emdding.pth: a random one is given)."""
    (tmp_path / "model_weight").mkdir(parents=True, exist_ok=True)
    torch.save(torch.randn(19, 768), tmp_path / "model_weight" / "Text_emdding.pth")
    monkeypatch.chdir(tmp_path)
    with peer_modules(root, ("models", "utils"), {"addict": _module("addict", Dict=dict)}):
        module = importlib.import_module("models.CHIEF")
        return module.CHIEF(size_arg="small", dropout=True, n_classes=2).eval()


def _flash_attn_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dropout: float = 0.0,
    bias: Any = None,
    softmax_scale: float | None = None,
    is_causal: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """flash-attn's outputs from their definition, for CPUs (where prov-gigapath's
    flash_attention.py leaves flash_attn_func None): softmax(q k^T / sqrt(d)) v per head,
    (b, l, h, d), and the log-sum-exp of each query's scores, (b, h, l)."""
    assert bias is None and not is_causal and dropout == 0.0
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
    scores = torch.einsum("bqhd,bkhd->bhqk", q.float(), k.float()) * scale
    out = torch.einsum("bhqk,bkhd->bqhd", torch.softmax(scores, dim=-1), v.float())
    return out.type_as(q), torch.logsumexp(scores, dim=-1)


def gigapath_stubs() -> dict[str, types.ModuleType]:
    """What prov-gigapath's slide encoder imports but does not run in eval (timm's model
    registry and drop_path, fairscale's wrappers), for where they are not installed."""

    def drop_path(x: torch.Tensor, p: float = 0.0, training: bool = False) -> torch.Tensor:
        assert not training
        return x

    return {
        "timm": _module("timm", create_model=_unused),
        "timm.models": _module("timm.models"),
        "timm.models.registry": _module("timm.models.registry", register_model=lambda f: f),
        "timm.models.layers": _module("timm.models.layers", drop_path=drop_path),
        "fairscale": _module("fairscale"),
        "fairscale.nn": _module("fairscale.nn", checkpoint_wrapper=_unused, wrap=_unused),
    }


def peer_gigapath(root: Path) -> Any:
    """prov-gigapath's own ``gigapath_slide_enc12l768d`` (its README's
    ``create_model(..., "gigapath_slide_enc12l768d", 1536)``, global_pool False), with the
    reference flash_attn_func above on CPUs; needs einops."""
    pytest.importorskip("einops", reason="prov-gigapath's dilated attention needs einops")
    path = list(sys.path)
    try:
        with peer_modules(root, ("gigapath", "torchscale"), gigapath_stubs()):
            module = importlib.import_module("gigapath.slide_encoder")
            attention = sys.modules["torchscale.component.multihead_attention"]
            if attention.flash_attn_func is None:
                attention.flash_attn_func = _flash_attn_func
            # under numpy 2 the segment lengths it builds print as "np.int64(1024)", which
            # its EncoderConfig eval()s in a module without np: give it np
            sys.modules["torchscale.architecture.config"].np = np
            model = module.gigapath_slide_enc12l768d(in_chans=1536, global_pool=False)
            return model.eval()
    finally:
        sys.path[:] = path  # (LongNet.py appends gigapath/ to sys.path)


MADELEINE_CONFIG = {  # model_config.json's fields MADELEINE's Model.py reads
    "MODALITIES": ["HE"],
    "wsi_encoder": "abmil",
    "patch_embedding_dim": 512,
    "wsi_encoder_hidden_dim": 512,
    "n_heads": 4,
    "activation": "softmax",
}


def peer_madeleine(root: Path, config: dict[str, Any]) -> Any:
    """MADELEINE's own model (``madeleine/models/Model.py``'s create_model, on the CPU);
    needs einops."""
    pytest.importorskip("einops", reason="MADELEINE's Model.py needs einops")
    from argparse import Namespace

    with peer_modules(root, ("madeleine",)):
        module = importlib.import_module("madeleine.models.Model")
        return module.create_model(Namespace(**config), device="cpu").eval()


FEATHER_CONFIG = {  # config.json's fields (MIL-Lab's abmil base.yaml, CONCH v1.5's width)
    "model_type": "abmil",
    "gate": True,
    "embed_dim": 512,
    "attn_dim": 384,
    "num_fc_layers": 1,
    "dropout": 0.25,
    "in_dim": 768,
    "num_classes": 2,
}


def peer_feather(root: Path, config: dict[str, Any]) -> Any:
    """MIL-Lab's own ABMIL (``src/models/abmil.py``, what the Hugging Face repo's ABMILModel
    wraps as ``model``); its transformers registration stood in where transformers is not
    installed."""

    class _Config:
        def __init__(self, **kwargs: Any) -> None:
            pass

    class _Auto:
        @staticmethod
        def register(*args: Any) -> None:
            pass

    stubs = {
        "transformers": _module(
            "transformers",
            PretrainedConfig=_Config,
            PreTrainedModel=torch.nn.Module,
            AutoConfig=_Auto,
            AutoModel=_Auto,
        )
    }
    keys = ("in_dim", "embed_dim", "num_fc_layers", "dropout", "attn_dim", "gate")
    with peer_modules(root, ("src",), stubs):
        module = importlib.import_module("src.models.abmil")
        return module.ABMIL(
            **{k: config[k] for k in keys}, num_classes=config["num_classes"]
        ).eval()
