"""Finding a slide of an index from what a user types: an id, a stored path, a file name or a
stem (commands' ``--slide``, the quarantine's selection, the viewers)."""

from __future__ import annotations

import os

from wsi_loader.index._table import SlideIndex


def resolve_slide(index: SlideIndex, slide: str | int | None) -> int:
    """A slide id from an id, a stored path, a file name or a stem; the first ok slide if None."""
    if slide is None:
        for i, record in enumerate(index.slides):
            if record.status == "ok" and record.tiles:
                return i
        raise ValueError("the index has no slide with tiles")
    if isinstance(slide, int) or (isinstance(slide, str) and slide.isdigit()):
        sid = int(slide)
        if not 0 <= sid < len(index.slides):
            raise ValueError(f"slide id {sid} out of range 0..{len(index.slides) - 1}")
        return sid
    for i, record in enumerate(index.slides):
        name = os.path.basename(record.path)
        if slide in (record.path, index.slide_path(i), name, os.path.splitext(name)[0]):
            return i
    raise ValueError(f"no slide {slide!r} in the index")
