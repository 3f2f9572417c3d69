"""The coordinates export (``coords-h5``): one HDF5 file of level-0 tile coordinates per slide,
in the layout CLAM's and TRIDENT's feature extractors read; no pixels are read.
"""

from __future__ import annotations

import hashlib
import io
from pathlib import Path
from typing import Any

import numpy as np

from wsi_loader.errors import ConfigError
from wsi_loader.export._manifest import tile_fields, tile_label
from wsi_loader.files import write_file
from wsi_loader.index._naming import file_text, h5_file_names
from wsi_loader.index._table import SlideIndex


def export_coords(full: SlideIndex, order: np.ndarray, out: Path) -> dict[str, Any]:
    """One HDF5 file per slide with a ``coords`` dataset (N x 2 level-0 x, y, int64) whose
    attributes ``patch_size`` (the window at ``patch_level``) and ``patch_level`` are what
    CLAM's and TRIDENT's feature extractors read, plus ``tile_size``, ``tile_mpp``,
    ``downsample`` and ``name``. Written under a temporary name and renamed."""
    try:
        import h5py
    except ImportError as exc:
        raise ConfigError(
            "--format coords-h5 needs h5py: pip install 'wsi_loader[h5]'", key="format"
        ) from exc
    cols = full.columns
    slide_of = np.asarray(cols["slide_id"][order], dtype=np.int64)
    slide_ids = sorted(set(slide_of.tolist()))
    names = h5_file_names(full, slide_ids)
    tiles, outputs = [], []
    for sid in slide_ids:
        rows = order[slide_of == sid]
        record = full.slides[sid]
        coords = np.stack(
            [np.asarray(cols["l0_x"][rows], np.int64), np.asarray(cols["l0_y"][rows], np.int64)],
            axis=1,
        )
        path = out / names[sid]
        buf = io.BytesIO()  # (see files.write_file)
        with h5py.File(buf, "w") as h5:
            dataset = h5.create_dataset("coords", data=coords)
            attrs = {
                "patch_size": int(cols["read_size"][rows[0]]),
                "patch_level": int(cols["level"][rows[0]]),
                "tile_size": int(full.params["tile_size"]),
                "downsample": float(record.read_downsample or 1.0),
                "name": file_text(Path(names[sid]).stem),
                "slide": file_text(record.path),
            }
            if record.tile_mpp is not None:
                attrs["tile_mpp"] = float(record.tile_mpp)
            for target in (dataset, h5):
                target.attrs.update(attrs)
        write_file(path, buf.getvalue())
        data = path.read_bytes()
        outputs.append((path.name, len(data), hashlib.sha256(data).hexdigest()))
        for member, row in enumerate(rows.tolist()):
            tiles.append(
                {
                    **tile_fields(full, row),
                    "read_size": int(cols["read_size"][row]),
                    "tile_mpp": record.tile_mpp,
                    "label": tile_label(full, row),
                    "slide_label": record.label,
                    "split": record.split,
                    "sha256": "",
                    "file": path.name,
                    "member": f"coords[{member}]",
                }
            )
    return {"unit": 0, "tiles": tiles, "failures": [], "shard": None, "outputs": outputs}
