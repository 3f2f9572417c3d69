"""Synthetic pyramidal slides for tests, the demo and benchmarks.

`write_svs` writes an Aperio-compatible SVS that OpenSlide opens as vendor ``aperio``: tiled JPEG
levels at downsamples 1/4/16/64 (as many as fit), abbreviated JPEG tiles sharing one JPEGTables
tag (as real scanners write them), MPP and AppMag in the ImageDescription. `write_tiff` writes a
generic tiled TIFF pyramid (reduced-resolution pages, resolution tags in centimetres).

The picture is H&E-like: a near-white background, irregular tissue regions (a smoothed random
field), pink stroma texture and purple nuclei, so compressed tile sizes are realistic. Tiles
are generated one at a time, so a 40k x 30k slide never needs its full raster in memory.
``corrupt_tiles`` breaks chosen level-0 tiles exactly the way openslide-python's
``unreadable.svs`` is broken (the JPEG SOS marker 0xFFDA becomes 0xFFDB).

``SlideSpec(artefacts=...)`` paints pen strokes, blurred regions, folds and bubbles with known
masks (`wsi_loader.synthetic_artefacts`); ``dark_field=True`` draws a fluorescence (DAPI-like)
slide instead: black glass, dim tissue, bright blue nuclei.
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
