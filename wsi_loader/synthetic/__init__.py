"""Synthetic pyramidal slides for tests, the demo and benchmarks.

- `_slides`: `write_svs` (Aperio SVS as scanners write it), `write_tiff` (a generic tiled TIFF
  pyramid), H&E-like texture so compressed tile sizes are realistic, fluorescence slides, tiles
  corrupted as openslide-python's ``unreadable.svs`` is
- `_artefacts`: pen strokes, blurred regions, folds and bubbles painted with known masks
- `_other_artefacts`: a second, independent painter of pen and folds (ink blended over the
  stain, a second tissue layer), to validate QC on pictures its rules were not tuned on

Imports only the foundation modules; of the package, only ``wsi-loader demo`` uses it.
"""

from wsi_loader.synthetic._slides import (
    SlideSpec,
    tissue_of,
    with_qc_artefacts,
    write_svs,
    write_tiff,
)

__all__ = [
    "SlideSpec",
    "tissue_of",
    "with_qc_artefacts",
    "write_svs",
    "write_tiff",
]
