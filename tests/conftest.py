"""Shared fixtures: synthetic slides (generated with tifffile) and the third-party test data.

Real slides are found through ``WSI_LOADER_TEST_DATA`` (default: ``../shared/testdata`` next to
the repository). Tests that need them are skipped when absent, unless
``WSI_LOADER_REQUIRE_TEST_DATA=1`` (set by .ci/run) turns the skip into a failure.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from pathlib import Path

import pytest

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
