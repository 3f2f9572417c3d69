"""What the page is told of errors: no server path, no file bytes (the full text is logged)."""

from __future__ import annotations

import pytest

from wsi_loader.errors import InputError, SlideOpenError, TileReadError
from wsi_loader.view.browser._public import reason, scrub


@pytest.mark.parametrize(
    ("text", "sent"),
    [
        (
            "/srv/slides/a.svs: tifffile: not a TIFF file: header=b'root'",
            "…: tifffile: not a TIFF file: header=b'…'",
        ),
        ("cannot be reached (s3://bucket/a.svs: 403)", "cannot be reached (…: 403)"),
        ("C:\\slides\\a.svs: bad", "…: bad"),
        ("read failed: Bogus marker length", "read failed: Bogus marker length"),
        ("x" * 500, "x" * 239 + "…"),
    ],
)
def test_stored_texts_lose_paths_and_quoted_bytes(text: str, sent: str) -> None:
    assert scrub(text) == sent


def test_errors_become_short_reasons_without_paths_or_bytes() -> None:
    opened = SlideOpenError("tifffile: header=b'root'", path="/srv/a.svs")
    assert reason(opened) == "no reader can open the slide file"
    tile = TileReadError("read failed", path="/srv/a.svs", l0_x=768, l0_y=512, level=0)
    assert reason(tile) == "the pixels at level-0 (768, 512), level 0 cannot be decoded"
    table = InputError("not numbers: 'secret'", path="/srv/out/model-outputs-csv/a.csv", line=3)
    assert reason(table) == "a.csv:3: not numbers: 'secret'"  # a file of predict's output
    assert reason(PermissionError(13, "Permission denied", "/srv/x")).endswith(
        "(Permission denied)"
    )
