"""The slide encoder tests' helpers: seeded random weights in a published file's key layout,
per-slide features files as `wsi-loader features` writes them, and the authors' own code
imported from a checkout (``WSI_LOADER_PEERS``: a folder holding e.g. ``CHIEF/``, a checkout
of hms-dbmi/CHIEF; the comparisons skip, saying so, without it)."""

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
def peer_modules(root: Path, names: tuple[str, ...], stubs: tuple[str, ...] = ()) -> Iterator[None]:
    """Import from ``root`` (its top-level packages ``names``, e.g. CHIEF's ``models`` and
    ``utils``), with ``stubs`` (modules it imports but the tested code never uses) standing in
    when not installed; everything is removed from sys.modules afterwards."""
    saved = {k: v for k, v in sys.modules.items() if k.split(".")[0] in names}
    for key in saved:
        del sys.modules[key]
    added = []
    for stub in stubs:
        if importlib.util.find_spec(stub) is None:
            module = types.ModuleType(stub)
            module.Dict = dict  # type: ignore[attr-defined]  # (addict's one name CHIEF imports)
            sys.modules[stub] = module
            added.append(stub)
    sys.path.insert(0, str(root))
    try:
        yield
    finally:
        sys.path.remove(str(root))
        for key in [k for k in sys.modules if k.split(".")[0] in names]:
            del sys.modules[key]
        for stub in added:
            sys.modules.pop(stub, None)
        sys.modules.update(saved)


def peer_chief(root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    """CHIEF's own ``CHIEF(size_arg="small")`` as its Get_CHIEF_WSI_level_feature.py builds
    it (its constructor reads ./model_weight/Text_emdding.pth: a random one is given)."""
    (tmp_path / "model_weight").mkdir(parents=True, exist_ok=True)
    torch.save(torch.randn(19, 768), tmp_path / "model_weight" / "Text_emdding.pth")
    monkeypatch.chdir(tmp_path)
    with peer_modules(root, ("models", "utils"), stubs=("addict",)):
        module = importlib.import_module("models.CHIEF")
        return module.CHIEF(size_arg="small", dropout=True, n_classes=2).eval()
