"""A second artefact painter, independent of `_artefacts`' pixel model: quality control's rules
were tuned on `_artefacts`' pictures, and are validated on these too
(``SlideSpec(artefact_painter="other")``; benchmarks/validate_qc.py reports both).

The geometry (where a stroke or a fold lies, so the truth of `truth_shares`) is the same;
what the pixels become is drawn another way:

- **pen**: opaque-ish marker paint laid *over* the stain (alpha blending towards the ink's
  own colour at `OPACITY`, hard-edged), not a filter multiplying it: translucent green,
  black, blue or red at 75%.
- **fold**: a second layer of tissue, the section from `FOLD_SHIFT` of the fold's width
  away, lying on the first: the transmittances multiply, so the optical density is the sum
  of two different tissues' (about twice the tissue's), with the second layer's texture.

Blur and bubbles are optics, not paint: `_artefacts` draws them.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from wsi_loader.synthetic._artefacts import (
    Artefact,
    Fold,
    Painter,
    PenStroke,
    coverage,
    paint_artefacts,
    touches,
)

OPACITY = 0.75
INK_COLOURS: dict[str, tuple[float, float, float]] = {
    "green": (40.0, 150.0, 70.0),
    "black": (30.0, 30.0, 32.0),
    "blue": (40.0, 70.0, 180.0),
    "red": (200.0, 40.0, 50.0),
}
FOLD_SHIFT = 0.75  # the second layer is the tissue this many fold widths across (the flap)
_LIGHT = 245.0  # the synthetic slides' transmitted light


def paint_other_artefacts(
    tile: npt.NDArray[np.uint8],
    artefacts: Sequence[Artefact],
    l0_x: int,
    l0_y: int,
    ds: float,
    tissue: npt.NDArray[np.bool_],
    neighbour: Painter,
) -> npt.NDArray[np.uint8]:
    """`_artefacts.paint_artefacts`' arguments, painted this module's way (blur and bubbles
    by `_artefacts`)."""
    optics = [a for a in artefacts if not isinstance(a, PenStroke | Fold)]
    if optics:
        tile = paint_artefacts(tile, optics, l0_x, l0_y, ds, tissue, neighbour)
    size = tile.shape[0]
    span = size * ds
    mine = [
        a
        for a in artefacts
        if isinstance(a, PenStroke | Fold) and touches(a, l0_x, l0_y, span, span)
    ]
    if not mine:
        return tile
    out = tile.astype(np.float32)
    for artefact in sorted(mine, key=lambda a: a.kind != "fold"):  # the section, then ink
        alpha = coverage(artefact, l0_x, l0_y, ds, size, size)
        if isinstance(artefact, Fold):
            shift = round(FOLD_SHIFT * artefact.width)
            below = neighbour(l0_x + shift, l0_y + shift).astype(np.float32)
            second = np.where(below < _LIGHT, below / _LIGHT, 1.0)  # glass adds nothing
            alpha = (alpha * tissue)[..., None]
            out = out * (1.0 - alpha + alpha * second)
        else:
            ink = np.array(INK_COLOURS[artefact.ink], dtype=np.float32)
            a = (OPACITY * alpha)[..., None]
            out = out * (1.0 - a) + ink * a
    painted: npt.NDArray[np.uint8] = np.clip(out + 0.5, 0, 255).astype(np.uint8)
    return painted
