"""Set-up shared by the benchmark scripts (imported as ``common``: they run as scripts)."""

from __future__ import annotations

import tempfile
from pathlib import Path

from wsi_loader.synthetic import SlideSpec, write_svs


def scratch_folder(path: str | None, prefix: str) -> Path:
    """``--scratch`` (kept between runs, so slides are written once) or a new temporary folder."""
    folder = Path(path or tempfile.mkdtemp(prefix=prefix))
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def synthetic_slide(path: Path, width: int = 20_000, seed: int = 0, mpp: float = 0.5) -> Path:
    """A synthetic 4:3 Aperio SVS at ``path``, written only when it is not there yet."""
    if not path.exists():
        write_svs(str(path), SlideSpec(width=width, height=width * 3 // 4, seed=seed, mpp=mpp))
    return path
