"""Model specs: what `features` and `predict` load, and the input each model expects.

A spec is one of

- a registry encoder's name (``uni_v2``, ``encoder:uni_v2``: `_encoders`, weights from the
  Hugging Face cache or hub);
- ``torchvision:NAME``: weights from the local torch hub cache only (nothing is downloaded);
- ``timm:NAME``: when timm is installed (its own weight cache);
- ``package.module:callable``: the callable returns an ``nn.Module``, or ``(module, options)`` /
  a dict with ``model`` and option keys (`OPTION_KEYS`);
- a TorchScript file (``model.pt``, as WSInfer and QuPath extensions ship models), with an
  optional JSON config beside it (``<stem>.json``, else ``config.json`` in its folder): class
  names, input size, mean/std, MPP and patch size, in WSInfer's schema or with our option keys.

``head="remove"`` (features) replaces torchvision's classification head by an identity and asks
timm for no classifier; ``head="keep"`` (predict) keeps the model whole.
"""

from __future__ import annotations

import difflib
import hashlib
import importlib
import json
import math
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlparse

import torch
from torch import nn

from wsi_loader.errors import ConfigError

Head = Literal["remove", "keep"]
HEADS = ("fc", "classifier", "heads", "head")  # torchvision's classification heads
OPTION_KEYS = ("mean", "std", "size", "classes", "mpp", "patch_size")
TORCHSCRIPT_SUFFIXES = (".pt", ".pth", ".ts", ".torchscript", ".jit")
MAX_CONFIG_BYTES = 1 << 20  # a model config is a few hundred bytes; more is not one
# WSInfer's config keys (wsinfer/schemas/model-config.schema.json) besides ours; the first two
# are informative only
_WSINFER_KEYS = (
    "spec_version",
    "architecture",
    "num_classes",
    "class_names",
    "patch_size_pixels",
    "spacing_um_px",
    "transform",
)
_WSINFER_TRANSFORMS = ("Resize", "ToTensor", "Normalize")


@dataclass
class Model:
    """A model and the input it expects.

    ``mean``/``std`` in [0, 1] units (None: plain /255); ``size``: the input edge tiles are
    resized to on the device (None: as read); ``classes``: the names of its outputs, when its
    config gives them; ``mpp`` and ``patch_size``: the resolution and tile size it was trained
    at, when known (checked against the index by predict).
    """

    model: nn.Module
    spec: str
    mean: tuple[float, float, float] | None = None
    std: tuple[float, float, float] | None = None
    size: int | None = None
    classes: tuple[str, ...] | None = None
    mpp: float | None = None
    patch_size: int | None = None


def load_model(spec: str, head: Head = "keep") -> Model:
    """The `Model` of a spec (see the module's docstring); a `ConfigError` says what is wrong."""
    if _is_torchscript(spec):
        return load_torchscript(Path(spec), spec)
    from wsi_loader.models._encoders import encoder_model, is_encoder_name

    if is_encoder_name(spec):  # a registry encoder (uni_v2, encoder:uni_v2): its own weights
        return encoder_model(spec)
    kind, sep, name = spec.partition(":")
    if not sep or not name:
        raise ConfigError(
            "a model is an encoder name (wsi-loader encoders), torchvision:NAME, timm:NAME, "
            f"package.module:callable or a TorchScript file ({', '.join(TORCHSCRIPT_SUFFIXES)})",
            key="model",
            value=spec,
        )
    if kind == "torchvision":
        return _torchvision(name, spec, head)
    if kind == "timm":
        return _timm(name, spec, head)
    return _callable(kind, name, spec)


def as_model(model: str | nn.Module | Model, head: Head = "keep") -> Model:
    """A spec loaded, a module wrapped, a `Model` as it is."""
    if isinstance(model, Model):
        return model
    if isinstance(model, str):
        return load_model(model, head)
    return model_from(model)


def _is_torchscript(spec: str) -> bool:
    path = Path(spec)
    return path.suffix.lower() in TORCHSCRIPT_SUFFIXES or (":" not in spec and path.is_file())


def _import_failed(package: str, spec: str, exc: BaseException) -> ConfigError:
    """A ConfigError for a model package that is missing or does not load: pip's torchvision
    wheel on a CPU build of torch (or another torch version) fails on import with a
    RuntimeError, and timm imports torchvision."""
    missing = (exc.name or "").partition(".")[0] if isinstance(exc, ModuleNotFoundError) else None
    if missing in (package, "torchvision"):
        # torchvision is the vision extra (its name was gpu, yet it runs on CPUs too); a plain
        # pip install may fetch a CUDA build, or one made for another torch
        wanted = f"{package} and torchvision" if package == "timm" else package
        extra = "'wsi_loader[vision]' timm" if package == "timm" else "'wsi_loader[vision]'"
        return ConfigError(
            f"{spec} needs {wanted}: pip install {extra}. {torchvision_recipe()}",
            key="model",
            value=spec,
        )
    return ConfigError(
        f"{spec}: {package} cannot be imported ({type(exc).__name__}: {exc}); a torchvision "
        f"built for another torch than this one ({torch.__version__}) fails this way. "
        + torchvision_recipe(),
        key="model",
        value=spec,
    )


def torchvision_recipe(version: str | None = None) -> str:
    """How to install the torchvision made for this torch (``version``, torch's by default):
    torch 2.M.P pairs with torchvision 0.(M+15).P, and a CPU build of torch with the CPU
    build of torchvision, from PyTorch's CPU index."""
    version = version or torch.__version__
    release, _, local = version.partition("+")
    parts = release.split(".")
    if len(parts) < 2 or parts[0] != "2" or not all(p.isdigit() for p in parts[:3]):
        return (
            "Install the torchvision release made for this torch "
            f"({version}), from the index torch came from"
        )
    pin = f"torchvision==0.{int(parts[1]) + 15}.{parts[2] if len(parts) > 2 else 0}"
    cpu = local == "cpu" or not torch.cuda.is_available()
    where = " --index-url https://download.pytorch.org/whl/cpu" if cpu else ""
    machine = "on this machine without CUDA" if cpu else "for this torch"
    return f"The pair that imports together {machine}: pip install torch=={release} {pin}{where}"


def _torchvision(name: str, spec: str, head: Head) -> Model:
    try:
        from torchvision.models import get_model, get_model_weights
    except Exception as exc:  # missing, or built for another torch (a RuntimeError)
        raise _import_failed("torchvision", spec, exc) from exc
    try:
        weights = get_model_weights(name).DEFAULT
    except (ValueError, KeyError, AttributeError) as exc:
        raise ConfigError(f"torchvision has no model {name!r}", key="model", value=spec) from exc
    file = Path(torch.hub.get_dir()) / "checkpoints" / Path(urlparse(weights.url).path).name
    if not file.is_file():
        raise ConfigError(
            f"the weights of {name} are not in the torch hub cache ({file}); download them "
            f"once on a machine with network access (torchvision.models.get_model({name!r}, "
            f"weights='DEFAULT')) and copy the file there, or point TORCH_HOME at a cache "
            "that has them, or pass package.module:callable returning your own model",
            key="model",
            value=spec,
        )
    model = get_model(name, weights=weights)
    classes = None
    if head == "remove":
        for attribute in HEADS:
            if isinstance(getattr(model, attribute, None), nn.Module):
                setattr(model, attribute, nn.Identity())
                break
    else:
        categories = weights.meta.get("categories")
        classes = tuple(str(c) for c in categories) if categories else None
    transform = weights.transforms()
    return Model(
        model,
        spec,
        tuple(transform.mean),
        tuple(transform.std),
        int(transform.crop_size[0]),
        classes,
    )


def _timm(name: str, spec: str, head: Head) -> Model:
    try:
        import timm  # type: ignore[import-not-found]
    except Exception as exc:  # missing, or its torchvision built for another torch
        raise _import_failed("timm", spec, exc) from exc
    try:
        options = {"num_classes": 0} if head == "remove" else {}
        model = timm.create_model(name, pretrained=True, **options)
    except Exception as exc:  # unknown name, no network for the weights...
        raise ConfigError(f"timm cannot load {name!r}: {exc}", key="model", value=spec) from exc
    config = timm.data.resolve_data_config({}, model=model)
    return Model(model, spec, tuple(config["mean"]), tuple(config["std"]), config["input_size"][1])


def _callable(module_name: str, attribute: str, spec: str) -> Model:
    try:
        target: Any = importlib.import_module(module_name)
        for part in attribute.split("."):
            target = getattr(target, part)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(
            f"cannot import {spec}: {exc} (the module must be importable: on PYTHONPATH, or "
            "in the current folder for the wsi-loader command)",
            key="model",
            value=spec,
        ) from exc
    if not callable(target):
        raise ConfigError(f"{spec} is not callable", key="model", value=spec)
    return model_from(target(), spec)


def model_from(made: Any, spec: str = "module") -> Model:
    """A `Model` from a module, a ``(module, options)`` pair or a dict with ``model``."""
    options: dict[str, Any] = {}
    if isinstance(made, tuple) and len(made) == 2:
        made, options = made
    elif isinstance(made, dict):
        options = dict(made)
        made = options.pop("model", None)
    if not isinstance(made, nn.Module):
        raise ConfigError(
            f"{spec} must give an nn.Module (or (module, options), or a dict with 'model'), "
            f"got {type(made).__name__}",
            key="model",
            value=spec,
        )
    if not isinstance(options, dict):
        raise ConfigError(f"{spec}: options must be a dict, got {type(options).__name__}")
    unknown = sorted(set(options) - set(OPTION_KEYS))
    if unknown:
        raise ConfigError(
            f"{spec}: unknown option keys {unknown} ({', '.join(OPTION_KEYS)})", key="model"
        )
    return Model(made, spec, **_checked_options(options, spec))


def _checked_options(options: dict[str, Any], where: str) -> dict[str, Any]:
    """`Model` fields from option keys, each checked (a bad value names the key)."""

    def bad(key: str, what: str) -> ConfigError:
        return ConfigError(f"{key} must be {what}, got {options[key]!r}", path=where, key=key)

    fields: dict[str, Any] = {}
    for key in ("mean", "std"):
        if options.get(key) is not None:
            value = options[key]
            if not isinstance(value, list | tuple) or len(value) != 3:
                raise bad(key, "3 numbers (R, G, B in [0, 1] units)")
            if not all(_finite(v) for v in value) or (key == "std" and min(value) <= 0):
                raise bad(key, "3 finite numbers" + (" above 0" if key == "std" else ""))
            fields[key] = tuple(float(v) for v in value)
    if (fields.get("mean") is None) != (fields.get("std") is None):
        raise ConfigError("give both mean and std, or neither", path=where, key="mean")
    for key in ("size", "patch_size"):
        if options.get(key):
            value = options[key]
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 8192:
                raise bad(key, "a whole number of pixels from 1 to 8192")
            fields[key] = value
    if options.get("mpp") is not None:
        if not _finite(options["mpp"]) or options["mpp"] <= 0:
            raise bad("mpp", "a positive number of micrometres per pixel")
        fields["mpp"] = float(options["mpp"])
    if options.get("classes") is not None:
        fields["classes"] = class_names_of(options["classes"], where)
    return fields


def class_names_of(value: Any, where: str) -> tuple[str, ...]:
    """Class names checked: a non-empty list of distinct, non-empty strings."""
    if (
        not isinstance(value, list | tuple)
        or not value
        or not all(isinstance(v, str) and v.strip() for v in value)
    ):
        raise ConfigError(
            f"classes must be a list of names, got {value!r}", path=where, key="classes"
        )
    names = tuple(v.strip() for v in value)
    if len(set(names)) != len(names):
        raise ConfigError(f"class names repeat: {list(names)}", path=where, key="classes")
    return names


def _finite(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


# -- TorchScript files ------------------------------------------------------------------------
def load_torchscript(path: Path, spec: str) -> Model:
    """A TorchScript model and the JSON config beside it, if any."""
    if not path.is_file():
        raise ConfigError("no such model file", path=str(path), key="model", value=spec)
    try:
        with warnings.catch_warnings():
            # torch 2.13 deprecates TorchScript, but it is how WSInfer's and QuPath's model
            # zoos ship their models: the user has this file, not another
            warnings.simplefilter("ignore", DeprecationWarning)
            module = torch.jit.load(str(path), map_location="cpu")  # type: ignore[no-untyped-call]
    except (RuntimeError, ValueError, OSError) as exc:
        raise ConfigError(
            f"not a TorchScript model ({type(exc).__name__}: {str(exc).splitlines()[0]}); "
            "save one with torch.jit.save(torch.jit.script(model), path) or torch.jit.trace",
            path=str(path),
            key="model",
        ) from exc
    config = model_config_beside(path)
    options = read_model_config(config) if config is not None else {}
    return Model(module, spec, **options)


def model_config_beside(path: Path) -> Path | None:
    """``<stem>.json`` beside the model file, else ``config.json`` in its folder (WSInfer's
    layout), else None."""
    for candidate in (path.with_suffix(".json"), path.parent / "config.json"):
        if candidate.is_file():
            return candidate
    return None


def read_model_config(path: Path) -> dict[str, Any]:
    """`Model` fields from a JSON model config: WSInfer's schema (``class_names``,
    ``num_classes``, ``patch_size_pixels``, ``spacing_um_px``, ``transform`` with Resize and
    Normalize) or our option keys (`OPTION_KEYS`). Unknown keys are errors (a misspelt ``std``
    would silently change every output)."""
    where = str(path)
    try:
        if path.stat().st_size > MAX_CONFIG_BYTES:
            raise ConfigError("too large for a model config (over 1 MiB)", path=where)
        document = json.loads(path.read_bytes())
    except (OSError, ValueError) as exc:  # JSONDecodeError and UnicodeDecodeError are both
        raise ConfigError(f"not a readable JSON model config: {exc}", path=where) from exc
    if not isinstance(document, dict):
        raise ConfigError("a model config is a JSON object", path=where)
    known = (*OPTION_KEYS, *_WSINFER_KEYS)
    for key in document:
        if key not in known:
            close = difflib.get_close_matches(str(key), known, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigError(f"unknown key {key!r}{hint}", path=where, key=str(key))
    options = {k: v for k, v in document.items() if k in OPTION_KEYS}
    _wsinfer_options(document, options, where)
    fields = _checked_options(options, where)
    count = document.get("num_classes")
    if count is not None and fields.get("classes") is not None and count != len(fields["classes"]):
        raise ConfigError(
            f"num_classes is {count} but class_names lists {len(fields['classes'])}",
            path=where,
            key="num_classes",
        )
    return fields


def _wsinfer_options(document: dict[str, Any], options: dict[str, Any], where: str) -> None:
    """Our option keys from WSInfer's: class names, patch size, spacing, Resize, Normalize."""
    for theirs, ours in (
        ("class_names", "classes"),
        ("patch_size_pixels", "patch_size"),
        ("spacing_um_px", "mpp"),
    ):
        if theirs in document:
            options.setdefault(ours, document[theirs])
    steps = document.get("transform", [])
    if not isinstance(steps, list):
        raise ConfigError("transform must be a list", path=where, key="transform")
    for i, step in enumerate(steps):
        name = step.get("name") if isinstance(step, dict) else None
        arguments = (step.get("arguments") or {}) if isinstance(step, dict) else None
        if name not in _WSINFER_TRANSFORMS or not isinstance(arguments, dict):
            raise ConfigError(
                f"transform {i}: expected one of {list(_WSINFER_TRANSFORMS)} with 'arguments' "
                f"(an object), got {step!r}",
                path=where,
                key="transform",
            )
        if name == "Resize":
            size = arguments.get("size")
            if isinstance(size, list | tuple) and len(size) == 2 and size[0] == size[1]:
                size = size[0]
            options.setdefault("size", size)
        elif name == "Normalize":
            options.setdefault("mean", arguments.get("mean"))
            options.setdefault("std", arguments.get("std"))


def weights_digest(model: nn.Module) -> str:
    """A digest of the model's parameters and buffers: another checkpoint under the same spec
    is other content."""
    digest = hashlib.blake2b(digest_size=16)
    for name, tensor in sorted(model.state_dict().items()):
        digest.update(name.encode("utf-8", "surrogateescape"))
        digest.update(tensor.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy())
    return digest.hexdigest()
