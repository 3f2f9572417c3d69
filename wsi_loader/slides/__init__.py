"""Slide readers: one protocol, an OpenSlide backend, a tifffile backend, a per-process pool.

This layer never imports torch.
"""

from wsi_loader.slides._base import SlideMeta, SlideReader
from wsi_loader.slides._open import BACKENDS, open_slide
from wsi_loader.slides._pool import HandlePool

__all__ = ["BACKENDS", "HandlePool", "SlideMeta", "SlideReader", "open_slide"]
