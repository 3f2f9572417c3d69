"""The curated public API (names other code and our checks rely on)."""

from __future__ import annotations

import subprocess
import sys

import wsi_loader
from wsi_loader import errors


def test_exported_members_exist() -> None:
    for name in wsi_loader.__all__:
        assert getattr(wsi_loader, name) is not None, name


def test_error_tree() -> None:
    for name in errors.__all__:
        cls = getattr(errors, name)
        assert issubclass(cls, errors.WsiLoaderError)
    assert issubclass(errors.SlideNotFoundError, FileNotFoundError)
    assert issubclass(errors.ConfigError, ValueError)
    assert issubclass(errors.TileReadError, errors.SlideError)


def test_slides_and_index_layers_do_not_import_torch() -> None:
    code = (
        "import sys, wsi_loader, wsi_loader.index, wsi_loader.slides, wsi_loader.synthetic;"
        "sys.exit(1 if 'torch' in sys.modules else 0)"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
