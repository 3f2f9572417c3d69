"""wsi_loader: stream tiles out of whole-slide images into PyTorch.

Data flow, one package per step, each importing only earlier ones: ``slides`` (readers) ->
``index`` (the SlideIndex on disk) -> ``stain`` (transforms) -> ``dataset`` (Datasets,
samplers, batches) -> ``device`` (batches on the GPU) -> ``models`` (one pass over an index)
-> ``features``, ``predict``, ``export``, ``ray`` (tiles as a Ray Data dataset; an optional
extra) -> ``view`` -> ``cli``; the foundations ``errors``, ``config``, ``files``, ``parallel``
and ``permutation`` serve them all; ``synthetic`` makes slides for tests, the demo and
benchmarks. The slides and index layers never import torch,
and importing this package does not either until a torch-based name is used. This module is
the public API.
"""

import sys as _sys
import types as _types
import typing as _typing

if _sys.platform == "win32":  # before any import that would fail with less to say
    raise ImportError(
        "wsi_loader needs Linux or macOS: its index builds, quarantine and local copies of "
        "remote slides share files between processes with POSIX file locks (fcntl). On "
        "Windows, run it in WSL2 (Windows Subsystem for Linux)"
    )

from wsi_loader.config import Config, DatasetConfig, IndexConfig, load_config
from wsi_loader.errors import (
    AnnotationError,
    ConfigError,
    IndexFormatError,
    InputError,
    LoaderTimeoutError,
    LoaderWorkerDiedError,
    ResolutionError,
    SlideChangedError,
    SlideError,
    SlideNotFoundError,
    SlideOpenError,
    TileReadError,
    UnitsNotDoneError,
    UnitTimeoutError,
    WeightsError,
    WorkerDiedError,
    WsiLoaderError,
)
from wsi_loader.index import Quarantine, SlideIndex, SlideRecord
from wsi_loader.slides import HandlePool, SlideMeta, open_slide

__version__ = "0.1.0"

__all__ = [
    "AnnotationError",
    "BalancedTileSampler",
    "Config",
    "ConfigError",
    "DatasetConfig",
    "DeviceLoader",
    "DistributedTileSampler",
    "FeatureBagDataset",
    "HandlePool",
    "IndexConfig",
    "IndexFormatError",
    "InputError",
    "LoaderTimeoutError",
    "LoaderWorkerDiedError",
    "Quarantine",
    "ResolutionError",
    "SlideBagDataset",
    "SlideChangedError",
    "SlideError",
    "SlideIndex",
    "SlideMeta",
    "SlideNotFoundError",
    "SlideOpenError",
    "SlideRecord",
    "TileBatch",
    "TileDataset",
    "TileReadError",
    "UnitTimeoutError",
    "UnitsNotDoneError",
    "WeightsError",
    "WorkerDiedError",
    "WsiLoaderError",
    "build_index",
    "embed_slides",
    "encoder",
    "extract_features",
    "load_config",
    "make_loader",
    "open_slide",
    "pad_bags",
    "predict",
    "qc_filter",
    "serve",
    "show",
    "slide_encoder",
]

# torch-based names (and the viewer), imported on first use so `import wsi_loader` stays
# torch-free and quick.
_LAZY: dict[str, str] = {
    # the index builder (scipy behind QC): not needed to read an index
    "build_index": "wsi_loader.index",
    "qc_filter": "wsi_loader.index",
    "TileDataset": "wsi_loader.dataset",
    "SlideBagDataset": "wsi_loader.dataset",
    "DistributedTileSampler": "wsi_loader.dataset",
    "BalancedTileSampler": "wsi_loader.dataset",
    "TileBatch": "wsi_loader.dataset",
    "make_loader": "wsi_loader.dataset",
    "DeviceLoader": "wsi_loader.device._loader",
    "FeatureBagDataset": "wsi_loader.dataset",
    "pad_bags": "wsi_loader.dataset",
    "extract_features": "wsi_loader.features",
    "encoder": "wsi_loader.models._encoders",
    "slide_encoder": "wsi_loader.models._slide_encoders",
    "embed_slides": "wsi_loader.features._slide_embeddings",
    "predict": "wsi_loader.predict._run",
    # the browser viewer (starlette, uvicorn), imported when first used
    "serve": "wsi_loader.view.browser",
    "show": "wsi_loader.view.browser",
}

if _typing.TYPE_CHECKING:
    from wsi_loader.dataset import (
        BalancedTileSampler,
        DistributedTileSampler,
        FeatureBagDataset,
        SlideBagDataset,
        TileBatch,
        TileDataset,
        make_loader,
        pad_bags,
    )
    from wsi_loader.device._loader import DeviceLoader
    from wsi_loader.features._extract import extract_features
    from wsi_loader.features._slide_embeddings import embed_slides
    from wsi_loader.index import build_index, qc_filter
    from wsi_loader.models._encoders import encoder
    from wsi_loader.models._slide_encoders import slide_encoder
    from wsi_loader.predict._run import predict
    from wsi_loader.view.browser import serve, show


def __dir__() -> list[str]:
    """Module attributes plus the lazy names, so ``dir()`` and completion show them."""
    return sorted({*globals(), *__all__})


def __getattr__(name: str) -> _typing.Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'wsi_loader' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)


# `predict` is a public function and also the name of the `predict/` package. Importing a
# subpackage makes the import system bind it on its parent (``wsi_loader.predict = <module>``),
# which would hide the function from every later ``wl.predict(...)``; the package stays
# reachable as ``sys.modules["wsi_loader.predict"]``, which is what ``from
# wsi_loader.predict import ...`` uses.
_FUNCTIONS_NAMED_LIKE_PACKAGES = frozenset({"predict"})


class _Package(_types.ModuleType):
    def __setattr__(self, name: str, value: _typing.Any) -> None:
        if name in _FUNCTIONS_NAMED_LIKE_PACKAGES and isinstance(value, _types.ModuleType):
            return
        super().__setattr__(name, value)


_sys.modules[__name__].__class__ = _Package
