"""The synthetic slides: what the spec asks for is what is drawn."""

from __future__ import annotations

import numpy as np

from tests.conftest import SlideFactory
from wsi_loader.slides import open_slide


def _nucleus_share(path: object) -> float:
    with open_slide(str(path)) as slide:
        width, height = slide.meta.dimensions
        pixels = slide.read_region(0, 0, 0, width, height).astype(np.int16)
    purple = (pixels[..., 0] < 150) & (pixels[..., 2] - pixels[..., 1] > 40)
    return float(purple.mean())


def test_nuclei_draws_more_nuclei_and_its_default_draws_what_it_did(
    make_slide: SlideFactory,
) -> None:
    default = make_slide(width=1024, height=768, seed=7, tissue=0.6)
    same = make_slide(width=1024, height=768, seed=7, tissue=0.6, nuclei=1.0)
    dense = make_slide(width=1024, height=768, seed=7, tissue=0.6, nuclei=4.0)
    assert default.read_bytes() == same.read_bytes()
    assert _nucleus_share(dense) > 2.5 * _nucleus_share(default) > 0
