"""What a model spec says when its package is missing: the extra named for what it is, and an
install that works on this machine."""

from __future__ import annotations

import sys

import pytest
import torch

from wsi_loader.errors import ConfigError
from wsi_loader.models._specs import load_model, torchvision_recipe


@pytest.mark.parametrize("spec", ["torchvision:resnet18", "timm:resnet18"])
def test_a_missing_torchvision_names_the_vision_extra_and_a_recipe(
    spec: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """It said "pip install 'wsi_loader[gpu]'" on a CPU machine."""
    for name in ("torchvision", "timm"):
        monkeypatch.setitem(sys.modules, name, None)  # as if not installed
    with pytest.raises(ConfigError) as raised:
        load_model(spec)
    said = str(raised.value)
    assert "pip install 'wsi_loader[vision]'" in said and "[gpu]" not in said
    assert torchvision_recipe() in said
    release = torch.__version__.partition("+")[0]
    assert f"torch=={release}" in said


def test_the_recipe_pairs_torchvision_with_this_torch() -> None:
    cpu = torchvision_recipe("2.14.1+cpu")
    assert "pip install torch==2.14.1 torchvision==0.29.1 " in cpu
    assert cpu.endswith("--index-url https://download.pytorch.org/whl/cpu")
    assert "torchvision==0.17.0" in torchvision_recipe("2.2+cpu")
    assert "made for this torch (3.0.0)" in torchvision_recipe("3.0.0")
