"""The options of one model pass (`wsi_loader.models.PassOptions`): what a pass would not do is
refused, never silently ignored."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from wsi_loader.errors import ConfigError
from wsi_loader.features import extract
from wsi_loader.index import SlideIndex


def runner(run: Any, todo: list[int], bar: Any) -> Iterator[int]:
    """A runner (what `wsi_loader.ray.RayPass` is) that must not be reached."""
    raise AssertionError("the pass ran")
    yield 0  # pragma: no cover


@pytest.mark.parametrize(
    ("given", "named"), [({"workers": 2}, "workers"), ({"timeout": 5.0}, "timeout")]
)
def test_local_reading_options_with_a_runner_are_refused(
    given: dict[str, Any], named: str, index: SlideIndex, tmp_path: Path
) -> None:
    """A runner (--ray) reads the tiles on its cluster: the local loader's workers and its
    timeout were silently ignored."""
    with pytest.raises(ConfigError, match=named) as caught:
        extract(index, "tests.feature_models:tiny", tmp_path / "f", runner=runner, **given)
    assert "--ray" in str(caught.value)
    assert not (tmp_path / "f").exists()
