"""The curated public API (names other code and our checks rely on), guarded like httpx's
``tests/test_exported_members.py``: the exact ``__all__``, every name importable, every public
attribute exported, and lazy (torch-based) names visible to ``dir()``."""

from __future__ import annotations

import pickle
import subprocess
import sys

import wsi_loader
from tests.conftest import REPO
from wsi_loader import errors

EXPORTED = [
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


def test_all_is_exactly_the_curated_list() -> None:
    assert wsi_loader.__all__ == EXPORTED  # sorted, no accidental additions or removals


def test_exported_members_exist_and_come_from_the_package() -> None:
    for name in wsi_loader.__all__:
        member = getattr(wsi_loader, name)
        assert member.__module__.startswith("wsi_loader."), name


def test_every_public_attribute_is_exported() -> None:
    public = {
        name
        for name, value in vars(wsi_loader).items()
        if not name.startswith("_") and not isinstance(value, type(sys))  # not submodules
    }
    assert public <= set(wsi_loader.__all__), public - set(wsi_loader.__all__)


def test_dir_lists_lazy_names() -> None:
    listed = dir(wsi_loader)
    for name in ("TileDataset", "make_loader", "DeviceLoader", "SlideBagDataset", "pad_bags"):
        assert name in listed
    assert set(wsi_loader.__all__) <= set(listed)


def test_error_tree() -> None:
    classes = [getattr(errors, n) for n in errors.__all__ if isinstance(getattr(errors, n), type)]
    assert len(classes) == len(errors.__all__) - 1  # and the is_transient helper
    for cls in classes:
        assert issubclass(cls, errors.WsiLoaderError)
    assert issubclass(errors.SlideNotFoundError, FileNotFoundError)
    assert issubclass(errors.ConfigError, ValueError)
    assert issubclass(errors.TileReadError, errors.SlideError)


def test_every_error_pickles_with_its_fields() -> None:
    # an error raised in a worker process comes back pickled; OutputError (required keyword
    # fields) failed to unpickle, and the pool reported its workers as dead (issue 36, item 14)
    examples = [
        errors.WsiLoaderError("m"),
        errors.ConfigError("m", path="c.yaml", key="export.format", value=3),
        errors.InputError("m", path="labels.csv", line=3),
        errors.AnnotationError("m", path="a.geojson", element="feature 1"),
        errors.IndexFormatError("m", path="idx"),
        errors.OutputError("No space left on device", path="out/x.png", code=28),
        errors.ForkUnsafeError("m"),
        errors.ModelOutputError("m", model="pkg.mod:net", slides=["a.svs"]),
        errors.LoaderTimeoutError("m", seconds=5.0, slide_ids=[1], paths=["a.svs"]),
        errors.LoaderWorkerDiedError("m", worker_id=1, pid=42, exitcode=-9),
        errors.UnitsNotDoneError("m", units=[1, 2], reasons={1: "x"}),
        errors.WorkerDiedError("m", units=[3], reasons={3: "killed"}),
        errors.UnitTimeoutError("m", units=[4]),
        errors.WeightsError("m", encoder="uni_v2", repo="MahmoodLab/UNI2-h", path="w.bin"),
        errors.SlideError("m", path="a.svs"),
        errors.SlideNotFoundError("m", path="a.svs"),
        errors.SlideChangedError("m", path="a.svs"),
        errors.TransientReadError("m", path="a.svs"),
        errors.SlideOpenError("m", path="a.svs"),
        errors.ResolutionError("m", path="a.svs"),
        errors.TileReadError("m", path="a.svs", l0_x=1, l0_y=2, level=0, cause="bad"),
    ]
    named = {n for n in errors.__all__ if isinstance(getattr(errors, n), type)}
    assert {type(e).__name__ for e in examples} == named  # a new error needs an example here
    for error in examples:
        back = pickle.loads(pickle.dumps(error))
        assert type(back) is type(error) and str(back) == str(error)
        assert vars(back) == vars(error) and back.args == error.args
        if isinstance(error, OSError):
            assert (back.errno, back.strerror, back.filename) == (
                error.errno,
                error.strerror,
                error.filename,
            )


def test_slides_and_index_layers_do_not_import_torch() -> None:
    code = (
        "import sys, wsi_loader, wsi_loader.index, wsi_loader.slides, wsi_loader.synthetic;"
        "import wsi_loader.index._health, wsi_loader.dataset._reading;"
        "import wsi_loader.dataset._quarantine;"
        "import wsi_loader.view.browser;"
        "sys.exit(1 if 'torch' in sys.modules else 0)"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_reading_an_index_imports_no_builder() -> None:
    """A spawned DataLoader worker imports what unpickling its dataset needs: the builder and
    scipy's image filters behind QC (a large share of its start) are not among them."""
    code = (
        "import sys, wsi_loader, wsi_loader.dataset._tiles, wsi_loader.dataset._loader;"
        "from wsi_loader.index import SlideIndex;"
        "gone = [m for m in ('scipy', 'wsi_loader.index._builder') if m in sys.modules];"
        "sys.exit(f'imported {gone}' if gone else 0)"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
    code = (
        "import wsi_loader as wl, wsi_loader.index as wi; print(wl.build_index is wi.build_index)"
    )
    run = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
    assert run.stdout.strip() == "True"


def test_windows_is_told_it_is_not_supported() -> None:
    # file locks (index builds, quarantine, local copies) use fcntl: on Windows the import
    # failed with "No module named 'fcntl'", saying nothing of the platform
    code = "import sys; sys.platform = 'win32'; import wsi_loader"
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=False
    )
    assert done.returncode == 1
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError: wsi_loader needs Linux or macOS"), done.stderr
    assert "WSL" in last


def test_predict_stays_the_function_when_the_predict_package_is_imported() -> None:
    # `predict` names a public function and the predict/ package: importing the package binds
    # it on `wsi_loader` unless the package root keeps the function there
    code = (
        "import inspect, wsi_loader as wl;"
        "import wsi_loader.predict._outputs, wsi_loader.predict._heatmaps;"
        "from wsi_loader.predict import read_run;"
        "from wsi_loader import predict;"
        "assert inspect.isfunction(wl.predict) and predict is wl.predict, wl.predict;"
        "assert wl.predict.__module__ == 'wsi_loader.predict._run';"
        "import sys; assert sys.modules['wsi_loader.predict'].read_run is read_run"
    )
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True)
