"""An encoder's weights, offline first: the file or snapshot folder given, else the local
Hugging Face cache, else a download when the hub is reachable and access is granted. Read
without executing code (``torch.load(weights_only=True)``, or safetensors parsed here: the
format is a JSON header and raw little-endian tensors, no package needed)."""

from __future__ import annotations

import fnmatch
import json
import logging
import mmap
import struct
from pathlib import Path
from typing import Any

import torch

from wsi_loader.errors import WeightsError
from wsi_loader.models._encoder_recipes import Recipe

log = logging.getLogger(__name__)

_SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


def hub_name(recipe: Recipe, file: str | None = None) -> str:
    """The file's name in its repo (with the subfolder)."""
    return "/".join(p for p in (recipe.subfolder, file or recipe.files[0]) if p)


def weights_error(recipe: Recipe, message: str, path: Path | None = None) -> WeightsError:
    """A `WeightsError` naming the recipe's encoder and repo, and the path looked at."""
    return WeightsError(
        message, encoder=recipe.name, repo=recipe.repo, path=None if path is None else str(path)
    )


def _loadable(recipe: Recipe, file: Path) -> Path:
    """What loads from a weight file found in the cache: the file, or for transformers models
    its snapshot folder (config.json beside the weights)."""
    return file.parent if recipe.architecture == "transformers" else file


def _advice(recipe: Recipe) -> str:
    where = f"https://huggingface.co/{'datasets/' if recipe.repo_type == 'dataset' else ''}"
    url = f"{where}{recipe.repo}"
    gated = (
        f"access is gated: accept the licence ({recipe.licence}) at {url} and run "
        "`huggingface-cli login` (or set HF_TOKEN), or "
        if recipe.gated
        else f"licence {recipe.licence}, {url}; "
    )
    return (
        f"{gated}download {hub_name(recipe)} from {recipe.repo} on a machine with access and "
        "pass it with --weights FILE (or its snapshot folder with --weights DIR)"
    )


def resolve_weights(recipe: Recipe, weights: str | Path | None, *, download: bool) -> Path:
    """The weight file (or, for transformers models, the snapshot folder) to load."""
    if weights is not None:
        return _given(recipe, Path(weights))
    cached = cached_weights(recipe)
    if cached is not None:
        return cached
    reason = "downloads are off"
    if download:
        found, reason = _download(recipe)
        if found is not None:
            return found
    raise weights_error(
        recipe,
        f"no weights for encoder {recipe.name} (repo {recipe.repo}): none given (--weights), "
        f"none in the Hugging Face cache, and {reason}. {_advice(recipe)}",
    )


def _given(recipe: Recipe, path: Path) -> Path:
    if path.is_file():
        return path
    if path.is_dir():
        for file in recipe.files:
            for candidate in (path / hub_name(recipe, file), path / file):
                if candidate.is_file():
                    return path if recipe.architecture == "transformers" else candidate
        raise weights_error(
            recipe,
            f"{path} has none of {', '.join(recipe.files)} (the files of {recipe.repo} that "
            f"encoder {recipe.name} loads); {_advice(recipe)}",
            path,
        )
    raise weights_error(
        recipe,
        f"no such weight file or folder: {path} (encoder {recipe.name}, repo {recipe.repo}); "
        + _advice(recipe),
        path,
    )


def cached_weights(recipe: Recipe) -> Path | None:
    """The weights in the local Hugging Face cache (HF_HOME / HF_HUB_CACHE), without network."""
    if recipe.repo is None:
        return None
    from huggingface_hub import try_to_load_from_cache

    for file in recipe.files:
        found = try_to_load_from_cache(
            recipe.repo, hub_name(recipe, file), repo_type=recipe.repo_type
        )
        if isinstance(found, str):
            return _loadable(recipe, Path(found))
    return None


def _download(recipe: Recipe) -> tuple[Path | None, str]:
    """The file downloaded into the cache, or None and why not."""
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import (
        EntryNotFoundError,
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        OfflineModeIsEnabled,
        RepositoryNotFoundError,
    )

    reason = f"{recipe.repo} has none of {', '.join(recipe.files)}"
    for file in recipe.files:
        try:
            log.warning("downloading %s from %s", hub_name(recipe, file), recipe.repo)
            path = hf_hub_download(
                str(recipe.repo), file, subfolder=recipe.subfolder, repo_type=recipe.repo_type
            )
        except (OfflineModeIsEnabled, LocalEntryNotFoundError):  # (before its base class)
            return None, "the hub is unreachable or offline mode is on (HF_HUB_OFFLINE)"
        except GatedRepoError:
            return None, "this account has no access to the gated repo"
        except RepositoryNotFoundError:
            return None, "the hub does not show the repo to this account (gated or private)"
        except EntryNotFoundError:
            continue
        except (HfHubHTTPError, OSError) as exc:
            return None, f"the download failed ({type(exc).__name__}: {exc})"
        return _loadable(recipe, Path(path)), ""
    return None, reason


def weights_present(recipe: Recipe) -> bool:
    """Whether the weights are in the local Hugging Face cache (``wsi-loader encoders``)."""
    try:
        return cached_weights(recipe) is not None
    except Exception:  # a cache folder that cannot be read: not present, as far as we know
        return False


def read_state(recipe: Recipe, path: Path) -> dict[str, Any]:
    """The state dict in the file, in the hub file's key layout less the recipe's unused
    keys; a file that is not a weight file is a `WeightsError`."""
    try:
        if _is_safetensors(path):
            state: Any = read_safetensors(path)
        else:
            state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except (OSError, RuntimeError, ValueError, EOFError, struct.error) as exc:
        raise weights_error(
            recipe,
            f"{path} is not a readable weight file for encoder {recipe.name} "
            f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})",
            path,
        ) from exc
    if recipe.state_key is not None and isinstance(state, dict) and recipe.state_key in state:
        state = state[recipe.state_key]
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise weights_error(
            recipe,
            f"{path} does not hold a state dict (names -> tensors) for encoder {recipe.name}",
            path,
        )
    return {k: v for k, v in state.items() if not any(fnmatch.fnmatch(k, p) for p in recipe.unused)}


def _is_safetensors(path: Path) -> bool:
    if path.suffix == ".safetensors":
        return True
    with open(path, "rb") as f:
        head = f.read(9)
    return len(head) == 9 and head[8:9] == b"{" and struct.unpack("<Q", head[:8])[0] < 1 << 28


def read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    """A safetensors file's tensors (mapped copy-on-write: pages are read when used)."""
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        if length > 1 << 28:
            raise ValueError("safetensors header over 256 MiB")
        header = json.loads(f.read(length))
        if not isinstance(header, dict):
            raise ValueError("safetensors header is not an object")
        start = 8 + length
        buffer = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    out: dict[str, torch.Tensor] = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        dtype = _SAFETENSORS_DTYPES.get(entry.get("dtype"))
        if dtype is None:
            raise ValueError(f"{name}: unsupported dtype {entry.get('dtype')!r}")
        begin, end = (int(v) for v in entry["data_offsets"])
        shape = [int(v) for v in entry["shape"]]
        count = end - begin
        if start + end > len(buffer) or begin > end:
            raise ValueError(f"{name}: data past the end of the file")
        if count == 0:
            out[name] = torch.empty(shape, dtype=dtype)
            continue
        flat = torch.frombuffer(buffer, dtype=torch.uint8, offset=start + begin, count=count)
        out[name] = flat.view(dtype).reshape(shape)
    return out
