"""Model specs shared by features and predict (`wsi_loader.models`): TorchScript files with the
JSON config beside them (WSInfer's schema or our keys), and their errors."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch

from tests.feature_models import PoolLinear
from wsi_loader.errors import ConfigError
from wsi_loader.models._specs import load_model, model_from, weights_digest

WSINFER_CONFIG = {
    "spec_version": "1.0",
    "architecture": "resnet34",
    "num_classes": 2,
    "class_names": ["Other", "Tumor"],
    "patch_size_pixels": 350,
    "spacing_um_px": 0.25,
    "transform": [
        {"name": "Resize", "arguments": {"size": 224}},
        {"name": "ToTensor"},
        {"name": "Normalize", "arguments": {"mean": [0.7, 0.5, 0.6], "std": [0.2, 0.2, 0.2]}},
    ],
}


def scripted(path: Path, model: torch.nn.Module | None = None) -> Path:
    """A TorchScript file of ``model`` (default: a 2-output `PoolLinear`), as WSInfer ships."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # TorchScript, since torch 2.13
        traced = torch.jit.trace((model or PoolLinear(dim=2)).eval(), torch.rand(2, 3, 32, 32))
        torch.jit.save(traced, str(path))
    return path


def test_a_torchscript_file_with_wsinfer_config_beside_it(tmp_path: Path) -> None:
    model_file = scripted(tmp_path / "torchscript_model.pt")
    (tmp_path / "config.json").write_text(json.dumps(WSINFER_CONFIG))
    model = load_model(str(model_file))
    assert model.classes == ("Other", "Tumor")
    assert (model.size, model.patch_size, model.mpp) == (224, 350, 0.25)
    assert model.mean == (0.7, 0.5, 0.6) and model.std == (0.2, 0.2, 0.2)
    x = torch.rand(2, 3, 32, 32)
    with torch.inference_mode():
        assert torch.allclose(model.model(x), PoolLinear(dim=2).eval()(x))
    assert weights_digest(model.model) == weights_digest(PoolLinear(dim=2))


def test_our_config_keys_and_stem_json_first(tmp_path: Path) -> None:
    model_file = scripted(tmp_path / "m.pt")
    (tmp_path / "m.json").write_text(json.dumps({"classes": ["a", "b"], "size": 64, "mpp": 0.5}))
    (tmp_path / "config.json").write_text("not read: m.json comes first")
    model = load_model(str(model_file))
    assert model.classes == ("a", "b") and model.size == 64 and model.mean is None
    (tmp_path / "alone").mkdir()
    assert load_model(str(scripted(tmp_path / "alone" / "x.pt"))).classes is None  # no config


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"calsses": ["a"]}, "unknown key 'calsses' \\(did you mean 'classes'\\?\\)"),
        ({**WSINFER_CONFIG, "num_classes": 3}, "num_classes is 3 but class_names lists 2"),
        ({"classes": ["a", "a"]}, "class names repeat"),
        ({"mean": [0.5, 0.5, 0.5]}, "give both mean and std"),
        ({"mean": [0.5, 0.5, 0.5], "std": [1, 0, 1]}, "std must be 3 finite numbers above 0"),
        ({"size": "big"}, "size must be a whole number of pixels"),
        ({"transform": [{"name": "RandomCrop"}]}, "transform 0: expected one of"),
        ([1, 2], "a model config is a JSON object"),
    ],
)
def test_a_bad_config_names_the_file_and_the_key(
    tmp_path: Path, config: object, message: str
) -> None:
    model_file = scripted(tmp_path / "m.pt")
    (tmp_path / "m.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=message) as caught:
        load_model(str(model_file))
    assert str(tmp_path / "m.json") in str(caught.value)


def test_files_that_are_not_models(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no such model file"):
        load_model(str(tmp_path / "missing.pt"))
    (tmp_path / "junk.pt").write_bytes(b"not a zip archive")
    with pytest.raises(ConfigError, match="not a TorchScript model"):
        load_model(str(tmp_path / "junk.pt"))
    scripted(tmp_path / "m.pt")
    (tmp_path / "m.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not a readable JSON model config"):
        load_model(str(tmp_path / "m.pt"))


def test_callable_options_are_checked() -> None:
    model = model_from((PoolLinear(), {"classes": ["x", "y"], "mpp": 0.5, "patch_size": 224}))
    assert model.classes == ("x", "y") and model.mpp == 0.5 and model.patch_size == 224
    with pytest.raises(ConfigError, match="unknown option keys \\['colour'\\]"):
        model_from((PoolLinear(), {"colour": "red"}))
    with pytest.raises(ConfigError, match="classes must be a list of names"):
        model_from((PoolLinear(), {"classes": "ab"}))
