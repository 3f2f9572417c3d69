from __future__ import annotations

import numpy as np
import pytest

from wsi_loader.errors import ResolutionError
from wsi_loader.index._geometry import grid, plan_read
from wsi_loader.slides._base import SlideMeta


def meta(
    mpp: float | None = 0.25,
    source: str = "vendor",
    dims: tuple[int, int] = (4096, 2048),
    downsamples: tuple[float, ...] = (1.0, 4.0, 16.0),
) -> SlideMeta:
    return SlideMeta(
        backend="test",
        vendor="test",
        level_dimensions=tuple((int(dims[0] / d), int(dims[1] / d)) for d in downsamples),
        level_downsamples=downsamples,
        mpp=mpp,
        mpp_source=source,  # type: ignore[arg-type]
        tile_sizes=tuple((256, 256) for _ in downsamples),
    )


def test_exact_level_is_read_without_resampling() -> None:
    plan = plan_read(meta(mpp=0.25), 256, 256, mpp=1.0)
    assert (plan.level, plan.read_size, plan.tile_mpp, plan.aligned) == (1, 256, 1.0, True)
    assert plan.warning is None


def test_between_levels_reads_finer_level_and_scales_window() -> None:
    plan = plan_read(meta(mpp=0.25), 224, 224, mpp=0.5)
    assert (plan.level, plan.read_size, plan.l0_footprint) == (0, 448, 448)
    assert plan.tile_mpp == pytest.approx(0.5)
    assert not plan.aligned  # resampled reads are never "aligned"


def test_within_tolerance_snaps_and_warns() -> None:
    plan = plan_read(meta(mpp=0.23), 256, 256, mpp=0.5, tolerance=0.1)  # wants 2.17x: level 0
    assert plan.level == 0 and plan.read_size == 557  # round(256 * 0.5 / 0.23)
    snapped = plan_read(meta(mpp=0.2282, downsamples=(1.0, 2.0, 4.0)), 256, 256, mpp=0.5)
    assert (snapped.level, snapped.read_size) == (1, 256)
    assert snapped.warning and "8.7%" in snapped.warning


def test_coarser_than_target_fails_with_advice() -> None:
    with pytest.raises(ResolutionError, match=r"coarser than the target 0\.25.*--mpp 0\.5"):
        plan_read(meta(mpp=0.5), 256, 256, mpp=0.25)
    assert plan_read(meta(mpp=0.52), 256, 256, mpp=0.5).level == 0  # within tolerance


@pytest.mark.parametrize(
    ("mpp", "source", "reason"),
    [
        (None, "missing", "no MPP"),
        (352.8, "tiff-resolution", "not a microscope resolution.*screen DPI"),
        # a resolution tag in pixels per micrometre written with the unit centimetre
        (0.00025, "tiff-resolution", "finer than a light microscope.*resolution unit"),
    ],
)
def test_unusable_mpp_says_how_to_proceed(mpp: float | None, source: str, reason: str) -> None:
    with pytest.raises(ResolutionError, match=f"{reason}.*--level N"):
        plan_read(meta(mpp=mpp, source=source), 256, 256, mpp=0.5)


def test_manifest_mpp_overrides_metadata() -> None:
    plan = plan_read(meta(mpp=None, source="missing"), 256, 256, mpp=1.0, slide_mpp=0.25)
    assert plan.level == 1


def test_level_mode() -> None:
    plan = plan_read(meta(mpp=None, source="missing"), 128, 64, level=2)
    assert (plan.level, plan.read_size, plan.l_stride, plan.tile_mpp) == (2, 128, 64, None)
    with pytest.raises(ResolutionError, match="level 3 requested but the slide has 3 level"):
        plan_read(meta(), 128, 128, level=3)


def test_grid_aligned_starts_at_origin_and_centred_splits_margin() -> None:
    m = meta(dims=(1000, 600), downsamples=(1.0,))
    plan = plan_read(m, 256, 256, level=0)
    x, y = grid(m, plan, align=True)
    assert sorted(set(x.tolist())) == [0, 256, 512] and sorted(set(y.tolist())) == [0, 256]
    x, y = grid(m, plan, align=False)
    assert sorted(set(x.tolist())) == [116, 372, 628] and sorted(set(y.tolist())) == [44, 300]


def test_grid_is_in_level0_pixels_and_row_major() -> None:
    m = meta()
    plan = plan_read(m, 256, 128, level=1)  # overlap: stride half the tile
    x, y = grid(m, plan)
    assert x[1] - x[0] == 128 * 4
    assert np.all(np.diff(y) >= 0)
    assert x.max() + 256 * 4 <= 4096 and y.max() + 256 * 4 <= 2048


def with_objective(power: float | None, **kwargs: object) -> SlideMeta:
    from dataclasses import replace

    return replace(meta(**kwargs), objective_power=power)  # type: ignore[arg-type]


def test_mag_follows_the_objective_power() -> None:
    """20x of a 40x scan is a downsample of 2, whatever the MPP says (a pathologist's 20x)."""
    plan = plan_read(with_objective(40, mpp=0.25, downsamples=(1.0, 2.0, 4.0)), 256, 256, mag=20)
    assert (plan.level, plan.read_size, plan.tile_mag, plan.mag_source) == (
        1,
        256,
        20.0,
        "objective-power",
    )
    assert plan.tile_mpp == pytest.approx(0.5)
    # a 40x scanner at 0.2282 um/px: 10x is its level of downsample 4 (0.913 um/px), no warning
    plan = plan_read(with_objective(40, mpp=0.2282), 256, 256, mag=10)
    assert (plan.level, plan.read_size, plan.tile_mag, plan.warning) == (1, 256, 10.0, None)
    # between levels: the finer level, resampled
    plan = plan_read(with_objective(40, mpp=0.25), 224, 224, mag=20)
    assert (plan.level, plan.read_size, plan.tile_mag) == (0, 448, 20.0)


def test_mag_without_objective_power_is_ten_over_mag() -> None:
    plan = plan_read(with_objective(None, mpp=0.25), 256, 256, mag=10)
    assert (plan.level, plan.read_size, plan.mag_source) == (1, 256, "mpp")
    assert plan.tile_mpp == pytest.approx(1.0) and plan.tile_mag == pytest.approx(10.0)
    # a stated power that is no objective (0, a pixel count) is not used
    assert plan_read(with_objective(5000, mpp=0.25), 256, 256, mag=10).mag_source == "mpp"


def test_mag_needs_no_mpp_when_the_objective_is_stated() -> None:
    plan = plan_read(with_objective(40, mpp=None, source="missing"), 256, 256, mag=10)
    assert (plan.level, plan.tile_mpp, plan.tile_mag) == (1, None, 10.0)
    with pytest.raises(ResolutionError, match="states no objective power, and the slide has no"):
        plan_read(with_objective(None, mpp=None, source="missing"), 256, 256, mag=10)


def test_mag_beyond_the_scan_fails_with_advice() -> None:
    with pytest.raises(
        ResolutionError, match=r"resolution 20x is coarser than the target 40x.*--mag 20"
    ):
        plan_read(with_objective(20, mpp=0.5), 256, 256, mag=40)


def test_mag_and_mpp_that_disagree_are_reported() -> None:
    from wsi_loader.index._geometry import mag_disagreement

    assert mag_disagreement(with_objective(40, mpp=0.2282), 0.2282, 0.1) is None  # 8.7% apart
    note = mag_disagreement(with_objective(40, mpp=0.5), 0.5, 0.1)
    assert note and "states 40x but its MPP 0.5 um/px is 20x" in note
    assert mag_disagreement(with_objective(None, mpp=0.5), 0.5, 0.1) is None


def test_every_plan_records_its_magnification() -> None:
    assert plan_read(with_objective(20, mpp=0.5), 256, 256, level=1).tile_mag == 5.0
    assert plan_read(with_objective(None, mpp=0.5), 256, 256, mpp=1.0).tile_mag == pytest.approx(
        10.0
    )
    assert (
        plan_read(with_objective(None, mpp=None, source="missing"), 256, 256, level=0).tile_mag
        is None
    )
