"""What a model pass's outputs are made of: each slide's content digest (`slide_content`: the
slide known by its content, `same_slide`, its tiles, the model and the writer's settings) and
the options a run's outputs depend on (`bind_pass`), which `claim_folder` compares."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from wsi_loader.index._fingerprints import slide_version
from wsi_loader.index._table import SlideIndex
from wsi_loader.index._table_files import SlideRecord
from wsi_loader.models._specs import Model, weights_digest
from wsi_loader.stain._build import as_stain

if TYPE_CHECKING:
    from wsi_loader.models._pass import PassOptions, Writer


@dataclass
class BoundPass:
    """What every slide's content shares (`slide_content`'s ``header``: the model, its
    weights and preprocessing, the precision, the writer's settings) and the stain transforms
    bound to the index (with their spec, targets resolved)."""

    header: list[Any]
    stain: Any
    stain_spec: Any

    def options(self) -> dict[str, Any]:
        """What a run's outputs depend on, as JSON values (`claim_folder` compares them)."""
        spec, weights, dtype, *preprocessing = self.header[:6]
        value = {
            "model": spec,
            "weights": weights,
            "dtype": dtype,
            "preprocessing": preprocessing,
            "settings": self.header[6:],  # the writer's
            "stain": self.stain_spec,
        }
        loaded: dict[str, Any] = json.loads(json.dumps(value, default=str))
        return loaded


def bind_pass(view: SlideIndex, model: Model, writer: Writer, options: PassOptions) -> BoundPass:
    steps = as_stain(options.stain)
    stain = None if steps is None else steps.bind(view)
    stain_spec = None if stain is None else stain.spec()
    # (this order keeps the digests of feature files written before the pass was shared)
    header = [
        model.spec,
        weights_digest(model.model),
        options.dtype,
        model.size,
        model.mean,
        model.std,
        *writer.settings,
    ]
    return BoundPass(header, stain, stain_spec)


def slide_content(
    view: SlideIndex,
    starts: npt.NDArray[np.int64],
    sid: int,
    header: list[Any],
    stain: Any = None,
    *,
    legacy: bool = False,
) -> str:
    """What a slide's outputs hold: the slide (`same_slide`), its tiles (rows
    ``starts[sid]:starts[sid + 1]``: the view's `SlideIndex.slide_starts`, found once by the
    caller, since a pass digests every slide), ``header`` (the model, its weights and
    preprocessing, the precision, the writer's settings) and the stain transforms (their
    spec), when there are. ``legacy``: the digest of outputs written before the slide was
    known by its content, with its fingerprint (mtime in it) instead."""
    rows = slice(int(starts[sid]), int(starts[sid + 1]))
    cols = view.columns
    record = view.slides[sid]
    digest = hashlib.blake2b(digest_size=16)
    version = record.fingerprint if legacy else same_slide(record)
    digest.update(json.dumps([record.path, version, *header]).encode())
    if stain is not None:  # absent: the digest of files written before stain options
        digest.update(json.dumps(stain, sort_keys=True).encode())
    for name in ("l0_x", "l0_y", "level", "read_size"):
        digest.update(np.ascontiguousarray(cols[name][rows]).tobytes())
    return digest.hexdigest()


def same_slide(record: SlideRecord) -> str | None:
    """What decides that outputs were computed from this slide: its content, not its mtime (a
    ``touch``, or an archive copied without its timestamps, must not recompute features), as
    `slide_version` says (a TIFF's content digest covers its directory, every tile's offset
    and size; an object's version is its ETag)."""
    return slide_version(record.path, record.content, record.fingerprint)
