"""What the sections build on: the strict base model (no unknown keys, no type coercion, no
inf or nan) and the field types several sections share (paths, context scales)."""

from __future__ import annotations

import re
from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict

from wsi_loader.files import expand_home

PathText = Annotated[str, AfterValidator(expand_home)]  # a local path or a URL

MAX_CONTEXT_SCALES = 8  # context tiles per item (each is a buffer per batch)

# a magnification as pathologists write it: 20, 20x, 40X, 2.5x
_MAGNIFICATION = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*[xX]?\s*")


def magnification(value: Any) -> Any:
    """A magnification written as text (``"20x"``, ``"40X"``, ``"20"``) as its number; other
    values are left for the type check. Raises ``ValueError`` for text that is not one."""
    if not isinstance(value, str):
        return value
    match = _MAGNIFICATION.fullmatch(value)
    if match is None:
        raise ValueError(f"{value!r} is not a magnification (write it as 20, 20x or 40X)")
    return float(match.group(1))


def context_scales(value: Any) -> Any:
    """Context scales as ``[(mpp, size), ...]`` from what users write: pairs (tuples or YAML
    lists), ``{"mpp": M, "size": S}`` mappings, or ``"MPP:SIZE"`` strings (``--context``,
    comma-separated). Anything else is left for the type check to refuse with its message."""
    if isinstance(value, str):
        value = [part for part in value.split(",") if part.strip()]
    if not isinstance(value, (list, tuple)):
        return value
    scales: list[Any] = []
    for item in value:
        scale = item
        if isinstance(item, str) and item.count(":") == 1:
            mpp, size = (part.strip() for part in item.split(":"))
            try:
                scale = (float(mpp), int(size))
            except ValueError as exc:
                raise ValueError(f"context scale {item!r} is not MPP:SIZE ({exc})") from None
        elif isinstance(item, dict) and set(item) == {"mpp", "size"}:
            scale = (item["mpp"], item["size"])
        elif isinstance(item, list):
            scale = tuple(item)
        scales.append(scale)
    return scales


def _check_context(scales: list[tuple[float, int]] | None) -> list[tuple[float, int]] | None:
    if scales is None:
        return None
    if len(scales) > MAX_CONTEXT_SCALES:
        raise ValueError(f"at most {MAX_CONTEXT_SCALES} context scales, got {len(scales)}")
    for mpp, size in scales:
        if not 0 < mpp <= 1000:
            raise ValueError(f"context MPP {mpp} is not in (0, 1000] um/px")
        if not 1 <= size <= 16384:
            raise ValueError(f"context tile size {size} is not in 1..16384 px")
    if len(set(scales)) != len(scales):
        raise ValueError(f"context scales repeat: {scales}")
    return list(scales)


# a target magnification: a number, or text such as "20x" (see magnification)
Magnification = Annotated[float | None, BeforeValidator(magnification)]

# co-centred context tiles: [(mpp, size), ...] (see context_scales for the spellings)
ContextScales = Annotated[
    list[tuple[float, int]] | None,
    BeforeValidator(context_scales),
    AfterValidator(_check_context),
]


class Strict(BaseModel):
    # allow_inf_nan: `--mpp inf` or `.nan` in YAML is an error, not Infinity in meta.json
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True, allow_inf_nan=False)
