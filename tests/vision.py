"""torchvision for the tests marked ``vision``: skipped where it does not import (the pinned CPU
torch has no torchvision that imports beside it), a failure where ``WSI_LOADER_REQUIRE_VISION=1``
(set by ``make test-vision``, which runs these tests in a venv where it imports)."""

import importlib
import os
from types import ModuleType

import pytest


def require(module: str = "torchvision") -> ModuleType:
    """Import ``module`` (torchvision, timm), skipping the test where it cannot be imported."""
    if os.environ.get("WSI_LOADER_REQUIRE_VISION") == "1":
        return importlib.import_module(module)
    return pytest.importorskip(module)
