"""Shared fixtures: synthetic slides (generated with tifffile) and the third-party test data.

Real slides are found through ``WSI_LOADER_TEST_DATA`` (default: ``../shared/testdata`` next to
the repository). Tests that need them are skipped when absent, unless
``WSI_LOADER_REQUIRE_TEST_DATA=1`` (set by .ci/run) turns the skip into a failure.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from wsi_loader.index import SlideIndex, build_index
from wsi_loader.synthetic import SlideSpec, write_svs, write_tiff

REPO = Path(__file__).resolve().parent.parent


def testdata_dir() -> Path | None:
    env = os.environ.get("WSI_LOADER_TEST_DATA")
    path = Path(env) if env else REPO.parent / "shared" / "testdata"
    return path if path.is_dir() else None


@pytest.fixture(scope="session")
def testdata() -> Path:
    path = testdata_dir()
    if path is None:
        if os.environ.get("WSI_LOADER_REQUIRE_TEST_DATA") == "1":
            pytest.fail("WSI_LOADER_TEST_DATA is required but not found")
        pytest.skip("third-party slides not found (set WSI_LOADER_TEST_DATA)")
    return path


SlideFactory = Callable[..., Path]


@pytest.fixture(scope="session")
def make_slide(tmp_path_factory: pytest.TempPathFactory) -> SlideFactory:
    """Write (and cache per session) a synthetic slide: ``make_slide(kind="svs", **spec)``."""
    cache: dict[tuple[object, ...], Path] = {}
    folder = tmp_path_factory.mktemp("synthetic")

    def factory(
        kind: str = "svs",
        corrupt: Iterable[tuple[int, int]] = (),
        compression: str = "jpeg",
        **spec: object,
    ) -> Path:
        corrupt = tuple(sorted(corrupt))
        key = (kind, corrupt, compression, tuple(sorted(spec.items())))
        if key not in cache:
            path = folder / f"slide{len(cache)}.{'svs' if kind == 'svs' else 'tiff'}"
            s = SlideSpec(**spec)  # type: ignore[arg-type]
            if kind == "svs":
                write_svs(str(path), s, corrupt_tiles=corrupt)
            else:
                write_tiff(str(path), s, compression=compression, corrupt_tiles=corrupt)
            cache[key] = path
        return cache[key]

    return factory


@pytest.fixture
def small_svs(make_slide: SlideFactory) -> Path:
    return make_slide(width=3000, height=2000, seed=1)


# level-0 storage tiles (column, row) broken in the "bad" slide: a 2x2 block in its tissue
CORRUPT = [(c, r) for c in range(3, 5) for r in range(3, 5)]


@pytest.fixture
def archive(tmp_path: Path, make_slide: SlideFactory) -> Path:
    folder = tmp_path / "slides"
    folder.mkdir()
    shutil.copy(make_slide(width=2560, height=2048, seed=31), folder / "good.svs")
    shutil.copy(make_slide(width=2048, height=2048, seed=32, corrupt=CORRUPT), folder / "bad.svs")
    (folder / "labels.csv").write_text("slide,label\ngood,normal\nbad,tumour\n")
    return folder


@pytest.fixture
def index(archive: Path, tmp_path: Path) -> SlideIndex:
    return build_index(
        [archive],
        tmp_path / "idx",
        tile_size=256,
        level=0,
        min_tissue=0.0,
        labels=str(archive / "labels.csv"),
    )


@pytest.fixture
def hook_workers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Callable[[str], None]:
    """Run code in every Python process started from then on (spawned workers, which no
    monkeypatch reaches), as a ``sitecustomize`` module on ``PYTHONPATH``."""

    def install(code: str) -> None:
        hooks = tmp_path / "hooks"
        hooks.mkdir()
        (hooks / "sitecustomize.py").write_text(code)
        path = os.pathsep.join([str(hooks), os.environ.get("PYTHONPATH", "")])
        monkeypatch.setenv("PYTHONPATH", path)

    return install


def corrupt_rows(index: SlideIndex) -> np.ndarray:
    """Rows whose window is exactly one of the corrupt storage tiles."""
    cols = index.columns
    bad_id = next(i for i, s in enumerate(index.slides) if s.path.endswith("bad.svs"))
    hits = np.zeros(len(index), dtype=bool)
    for c, r in CORRUPT:
        hits |= (cols["slide_id"] == bad_id) & (cols["l0_x"] == c * 256) & (cols["l0_y"] == r * 256)
    return np.flatnonzero(hits)


# -- object storage (tests/servers.py) -----------------------------------------------------------
S3_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}


@pytest.fixture(scope="session")
def s3_endpoint() -> Iterator[str]:
    """moto's S3 server on 127.0.0.1, reached through the standard AWS environment variables
    (as a user's bucket is); a bucket ``slides`` exists."""
    from tests.servers import moto_s3

    with moto_s3() as server:
        saved = {k: os.environ.get(k) for k in [*S3_ENV, "AWS_ENDPOINT_URL"]}
        os.environ.update(S3_ENV, AWS_ENDPOINT_URL=server.url)
        try:
            s3_fs().mkdir("slides")
            yield server.url
        finally:
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value


def s3_fs() -> Any:
    import fsspec

    return fsspec.filesystem("s3", skip_instance_cache=False)


def upload(local: Path | str, url: str) -> str:
    """Put a local file at an ``s3://`` URL; returns the URL."""
    s3_fs().put_file(str(local), url.removeprefix("s3://"))
    s3_fs().invalidate_cache()
    return url
