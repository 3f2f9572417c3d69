"""Slide-level normalisation against known truth: two renderings of the same synthetic tissue
with other stain vectors and amounts, normalised to a crop of one of them."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from wsi_loader.dataset import TileDataset
from wsi_loader.index import SlideIndex, build_index
from wsi_loader.slides._open import open_slide
from wsi_loader.stain import Normalize

H_A = ((0.5626, 0.7201, 0.4062), (0.2159, 0.8012, 0.5581))
H_B = ((0.65, 0.70, 0.29), (0.30, 0.80, 0.45))


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[SlideIndex, np.ndarray]:
    """Slide a (Macenko's reference stain) and slide b (another lab's vectors, H x1.4 and E
    x0.7) of the same tissue, indexed at level 0, and a 1024 px level-0 crop of slide a."""
    from wsi_loader.synthetic import SlideSpec, write_svs

    folder = tmp_path_factory.mktemp("pair")
    write_svs(str(folder / "a.svs"), SlideSpec(4000, 3000, seed=3, stain=H_A))
    b = SlideSpec(4000, 3000, seed=3, stain=H_B, amounts=(1.4, 0.7))
    write_svs(str(folder / "b.svs"), b)
    index = build_index([folder / "a.svs", folder / "b.svs"], folder / "idx", tile_size=256,
                        level=0, min_tissue=0.5)  # fmt: skip
    with open_slide(str(folder / "a.svs")) as reader:
        crop = reader.read_region(1024, 768, 0, 1024, 1024)
    return index, crop


def _paired_tiles(index: SlideIndex) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The tiles of a and b at the same positions: pixels of a, of b, and their rows."""
    cols = index.columns
    where = {
        (int(cols["l0_x"][r]), int(cols["l0_y"][r])): r
        for r in np.flatnonzero(cols["slide_id"] == 0)
    }
    rows = [
        (where[key], r)
        for r in np.flatnonzero(cols["slide_id"] == 1)
        if (key := (int(cols["l0_x"][r]), int(cols["l0_y"][r]))) in where
    ]
    assert len(rows) >= 20
    rows_a = np.array([p[0] for p in rows])
    rows_b = np.array([p[1] for p in rows])
    reader = TileDataset(index).reader
    return reader.read(rows_a).pixels.copy(), reader.read(rows_b).pixels.copy(), rows_a, rows_b


def _normalised(op: Normalize, pixels: np.ndarray, slide: int, rows: np.ndarray) -> np.ndarray:
    out = pixels.copy()
    op.apply_numpy(out, np.full(len(pixels), slide), rows)
    return out.astype(np.int64)


@pytest.mark.parametrize("method", ["macenko", "reinhard"])
def test_a_slide_normalised_to_a_crop_of_itself_barely_moves(
    method: str, pair: tuple[SlideIndex, np.ndarray]
) -> None:
    """The target's statistics and the slide's are fitted over the same kind of pixels at
    the same resolution: measured 5.3 (Macenko) and 7.1 (Reinhard) grey levels, against
    11.3 and 42.5 when the target's moments took the crop's glass in and the slide's were
    sampled at a coarser level."""
    index, crop = pair
    a, _, rows_a, _ = _paired_tiles(index)
    op = Normalize(method, target=crop).bind(index)
    moved = np.abs(_normalised(op, a, 0, rows_a) - a).mean()
    assert moved < 8.0


@pytest.mark.parametrize("method", ["macenko", "reinhard"])
def test_paired_renderings_get_closer(method: str, pair: tuple[SlideIndex, np.ndarray]) -> None:
    """Normalised to a crop of slide a, the tiles of a and b at one position are closer than
    before, and per slide at least as close as per tile (measured raw 17.2; per slide
    Macenko 15.0, Reinhard 10.9; per tile 16.4 and 11.6; before the fix Reinhard per slide
    was 15.5 against 11.5 per tile, further apart than the raw tiles)."""
    index, crop = pair
    a, b, rows_a, rows_b = _paired_tiles(index)
    raw = np.abs(a.astype(np.int64) - b).mean()
    op = Normalize(method, target=crop).bind(index)
    per_slide = np.abs(_normalised(op, a, 0, rows_a) - _normalised(op, b, 1, rows_b)).mean()
    assert per_slide < 0.9 * raw
    tile_op = Normalize(method, target=crop, per_tile=True).bind(index)
    per_tile = np.abs(
        _normalised(tile_op, a, 0, rows_a) - _normalised(tile_op, b, 1, rows_b)
    ).mean()
    assert per_slide <= per_tile


def test_a_target_image_is_fitted_over_its_tissue_like_a_slide(
    pair: tuple[SlideIndex, np.ndarray], tmp_path: Path
) -> None:
    """A crop with glass around its tissue gives the same Reinhard moments as the same tissue
    without the glass (its glass is not tissue)."""
    from wsi_loader.stain import resolve_target

    _, crop = pair
    with_glass = np.full((1024, 2048, 3), 242, np.uint8)
    with_glass[:, :1024] = crop
    alone, padded = resolve_target(crop), resolve_target(with_glass)
    assert np.allclose(alone.lab_mean, padded.lab_mean, atol=0.5)
    assert np.allclose(alone.lab_std, padded.lab_std, atol=0.5)
