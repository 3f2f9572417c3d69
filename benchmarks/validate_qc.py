"""Validate index-time quality control against known truth; print docs/journeys/qc.md's tables.

    .venv/bin/python benchmarks/validate_qc.py [--scratch DIR] [--quick]

1. Synthetic slides with painted artefacts (`wsi_loader.synthetic._artefacts.qc_layout`: pen
   strokes in four inks along curves, regions blurred with sigma 2, 4 and 8 level-0 px,
   folded strips, bubbles; masks known exactly), indexed at 256 px, 0.5 um/px: per rule,
   tile precision and recall (`synthetic._artefacts.score`: positives are tiles the artefact
   covers at least half of, negatives those it covers under 2%, partly covered tiles are not
   scored), in three regimes of the picture QC works on: 32 um/px (0.5 um/px scans whose
   lowest level is 1/64), 8 um/px (lowest level 1/16), and 0.25 um/px scans read at 0.5.
1b. The same layouts painted by a second, independent painter (`synthetic._other_artefacts`:
   ink blended over the stain at 75%, a fold as a second tissue layer) beside ours: pen and
   fold per painter, and pen per ink colour (tiles under another ink are not scored), on
   every regime's slides and on the 8 um/px regime's slides in other tissue renderings
   (`TEXTURES`: more nuclei, stained by Beer-Lambert with Macenko's and another lab's H&E).
2. Dark field: a synthetic fluorescence slide, tissue found vs its true mask, with the
   detector chosen automatically and with brightfield forced (the old rule).
3. The real test slides (WSI_LOADER_TEST_DATA): what each rule flags on CMU-1 and the TCGA
   slide; on the DAPI NDPI, which grid tiles are background (every level-2 pixel dark) and
   whether any of them is indexed as tissue.
3b. Real images with ink, folds and IHC from other projects' public test data
   (`qc_real_images.py`; fetched by `fetch_qc_images.py` into a git-ignored folder).
4. Focus against the variance of the Laplacian of the decoded tiles (read level): Spearman's
   rank correlation over tissue tiles, and how well each separates blurred from sharp tiles
   (AUC) on the synthetic slides.
"""

from __future__ import annotations

import argparse
import os
import shutil
from dataclasses import replace
from pathlib import Path

import numpy as np
from common import scratch_folder, written
from qc_real_images import DEFAULT as IMAGES_FOLDER
from qc_real_images import real_images_section
from scipy import ndimage, stats

from wsi_loader.index import SlideIndex, build_index
from wsi_loader.index import _qc as qc
from wsi_loader.slides import open_slide
from wsi_loader.synthetic import SlideSpec, tissue_of, with_qc_artefacts
from wsi_loader.synthetic._artefacts import Score, score, truth_shares

REGIMES = {
    # name: (width, height, mpp, artefact scale, seeds)
    "32 um/px picture (0.5 um/px, 20k x 15k)": (20_000, 15_000, 0.5, 1.0, (5, 6, 7)),
    "8 um/px picture (0.5 um/px, 16k x 8k)": (16_000, 8_000, 0.5, 1.0, (1, 2, 3)),
    "16 um/px picture (0.25 um/px, 24k x 16k)": (24_000, 16_000, 0.25, 2.0, (11, 12)),
}
DARK = 7  # the DAPI NDPI's glass is 2-4/255 in its brightest channel; dim tissue 8-20
EIGHT = "8 um/px picture (0.5 um/px, 16k x 8k)"
QUICK = {EIGHT: (16_000, 8_000, 0.5, 1.0, (1,))}


def slide_for(scratch: Path, spec: SlideSpec, name: str) -> Path:
    path = scratch / f"{name}.svs"
    if not path.exists():
        written(path, spec)  # whole or not at all: an interrupted run leaves no broken slide
    return path


def fresh_index(path: Path, out: Path, **options: object) -> SlideIndex:
    shutil.rmtree(out, ignore_errors=True)
    return build_index([path], out, **options)  # type: ignore[arg-type]


def tile_truth(spec: SlideSpec, index: SlideIndex) -> dict[str, np.ndarray]:
    cols = index.columns
    footprint = float(index.slides[0].read_size or 0) * (index.slides[0].read_downsample or 1.0)
    return truth_shares(
        spec.artefacts,
        tissue_of(spec),
        (spec.width, spec.height),
        np.asarray(cols["l0_x"], dtype=np.int64),
        np.asarray(cols["l0_y"], dtype=np.int64),
        footprint,
    )


def laplacian_variance(index: SlideIndex) -> np.ndarray:
    """Variance of the Laplacian of each tile's grey pixels, decoded at its read level."""
    cols, record = index.columns, index.slides[0]
    size = int(record.read_size or 0)
    out = np.empty(len(index))
    with open_slide(index.slide_path(0)) as reader:
        for row in range(len(index)):
            pixels = reader.read_region(
                int(cols["l0_x"][row]), int(cols["l0_y"][row]), int(cols["level"][row]), size, size
            )
            out[row] = ndimage.laplace(pixels.astype(np.float32).mean(axis=-1)).var()
    return out


def auc(positive: np.ndarray, negative: np.ndarray) -> float:
    """Probability that a random positive scores above a random negative (ties: half)."""
    ranks = stats.rankdata(np.concatenate([positive, negative]))
    wins = ranks[: len(positive)].sum() - len(positive) * (len(positive) + 1) / 2
    return float(wins / (len(positive) * len(negative)))


def synthetic_section(scratch: Path, regimes: dict[str, tuple]) -> dict[str, list[float]]:  # type: ignore[type-arg]
    print("## QC rules on synthetic slides with painted artefacts (tile precision / recall)\n")
    print("| picture QC works on | slides | rule | positives | precision | recall |")
    print("|---|---|---|---|---|---|")
    focus_pairs: dict[str, list[float]] = {"rho": [], "auc_focus": [], "auc_laplacian": []}
    for regime, (width, height, mpp, scale, seeds) in regimes.items():
        totals: dict[str, Score] = {}
        for seed in seeds:
            spec = with_qc_artefacts(
                SlideSpec(width=width, height=height, seed=seed, mpp=mpp), scale=scale
            )
            path = slide_for(scratch, spec, f"qc-{width}x{height}-{mpp}-{seed}")
            index = fresh_index(path, scratch / "idx-qc", tile_size=256, mpp=0.5)
            truth = tile_truth(spec, index)
            flagged = qc.flags(index.columns)
            for rule in qc.RULES:
                found = score(rule, flagged[rule], truth)
                totals[rule] = totals[rule] + found if rule in totals else found
            if regime.startswith("32"):
                blurred = truth["blur"] >= 0.5
                sharp = (truth["blur"] < 0.02) & (truth["bubble"] < 0.02) & (truth["pen"] < 0.02)
                focus = np.asarray(index.columns["qc_focus"])
                lap = laplacian_variance(index)
                judged = np.isfinite(focus)
                focus_pairs["rho"].append(
                    float(stats.spearmanr(focus[judged], lap[judged]).statistic)
                )
                focus_pairs["auc_focus"].append(
                    auc(-focus[blurred & judged], -focus[sharp & judged])
                )
                focus_pairs["auc_laplacian"].append(auc(-lap[blurred], -lap[sharp]))
        for rule, s in totals.items():
            print(
                f"| {regime} | {len(seeds)} | {rule} | {s.positives} | {s.precision:.3f} | "
                f"{s.recall:.3f} |"
            )
    return focus_pairs


PAINTERS = ("ours", "other")
INKS = ("blue", "green", "black", "red")
# tissue renderings the painters' artefacts are laid on, beside the default texture (on the
# 8 um/px regime's slides): more nuclei, and stained by Beer-Lambert with known vectors
TEXTURES: dict[str, dict[str, object]] = {
    "default": {},
    "nuclei x2": {"nuclei": 2.0},
    "Macenko's H&E": {"stain": ((0.5626, 0.7201, 0.4062), (0.2159, 0.8012, 0.5581))},
    "another H&E, H x1.4, E x0.7": {
        "stain": ((0.65, 0.70, 0.29), (0.30, 0.80, 0.45)), "amounts": (1.4, 0.7)
    },
}  # fmt: skip


def renderings(
    regimes: dict[str, tuple],  # type: ignore[type-arg]
    quick: bool,
    textures: tuple[str, ...] = tuple(TEXTURES),
) -> list[tuple[str, SlideSpec, float]]:
    """(texture, plain slide, artefact scale) of every regime's seeds in the default texture,
    and of the 8 um/px regime's seeds in the other textures (one texture with --quick); of
    ``textures`` only."""
    out = []
    for width, height, mpp, scale, seeds in regimes.values() if "default" in textures else ():
        for seed in seeds:
            out.append(
                ("default", SlideSpec(width=width, height=height, seed=seed, mpp=mpp), scale)
            )
    width, height, mpp, scale, seeds = regimes.get(EIGHT, QUICK[EIGHT])
    others = [(t, o) for t, o in list(TEXTURES.items())[1 : 2 if quick else None] if t in textures]
    for texture, options in others:
        for seed in seeds:
            plain = SlideSpec(width=width, height=height, seed=seed, mpp=mpp, **options)  # type: ignore[arg-type]
            out.append((texture, plain, scale))
    return out


def painters_section(
    scratch: Path,
    regimes: dict[str, tuple],  # type: ignore[type-arg]
    quick: bool = False,
    textures: tuple[str, ...] = tuple(TEXTURES),
) -> None:
    """Per rule and per ink colour, on artefacts of both painters (`_artefacts`, which the
    rules were tuned on, and `_other_artefacts`: ink blended over the stain at 75%, a fold
    as a second tissue layer) over several tissue renderings: recall of tiles at least half
    covered, precision over tiles under 2% covered."""
    print("\n## QC rules on artefacts of two painters (tile precision / recall)\n")
    print("| painter | tissue | slides | rule | ink | positives | precision | recall |")
    print("|---|---|---|---|---|---|---|---|")
    for painter in PAINTERS:
        totals: dict[tuple[str, str], Score] = {}
        slides: dict[str, int] = {}
        for texture, plain, scale in renderings(regimes, quick, textures):
            spec = replace(with_qc_artefacts(plain, scale=scale), artefact_painter=painter)
            tag = "-".join(f"{k}{v}" for k, v in TEXTURES[texture].items())
            name = f"qc-{painter}-{plain.width}x{plain.height}-{plain.mpp}-{plain.seed}{tag}"
            name = name.replace(" ", "").replace("(", "").replace(")", "").replace(",", "_")
            index = fresh_index(slide_for(scratch, spec, name), scratch / "idx-paint",
                                tile_size=256, mpp=0.5)  # fmt: skip
            slides[texture] = slides.get(texture, 0) + 1
            truth = tile_truth(spec, index)
            flagged = qc.flags(index.columns)
            found_here: dict[str, Score] = {}
            for rule in ("pen", "fold"):
                found_here[rule] = score(rule, flagged[rule], truth)
            for ink in INKS:
                strokes = tuple(a for a in spec.artefacts if getattr(a, "ink", None) == ink)
                own = tile_truth(replace(spec, artefacts=strokes), index)
                # tiles under another ink are neither positives nor negatives here
                elsewhere = (truth["pen"] >= 0.02) & (own["pen"] < 0.5)
                own["pen"] = np.where(elsewhere, 0.1, own["pen"]).astype(np.float32)
                found_here[f"pen {ink}"] = score("pen", flagged["pen"], own)
            for key, found in found_here.items():
                for where in (texture, "all"):
                    old = totals.get((where, key))
                    totals[(where, key)] = found if old is None else old + found
        slides["all"] = sum(slides.values())
        for (texture, key), s in sorted(totals.items(), key=lambda kv: kv[0][0] != "all"):
            rule, _, ink = key.partition(" ")
            print(
                f"| {painter} | {texture} | {slides[texture]} | {rule} | {ink or 'all'} | "
                f"{s.positives} | {s.precision:.3f} | {s.recall:.3f} |"
            )


def dark_field_section(scratch: Path) -> None:
    print("\n## Tissue on a dark-field (fluorescence) synthetic slide, 12k x 9k\n")
    spec = SlideSpec(width=12_000, height=9_000, seed=21, dark_field=True)
    path = slide_for(scratch, spec, "dark-12000")
    print("| detector | chosen as | tiles | true tissue tiles found | background tiles indexed |")
    print("|---|---|---|---|---|")
    for forced in ("auto", "brightfield"):
        index = fresh_index(
            path, scratch / "idx-dark", tile_size=256, mpp=0.5, min_tissue=0.5,
            tissue_detector=forced,
        )  # fmt: skip
        grid = fresh_index(path, scratch / "idx-grid", tile_size=256, mpp=0.5, min_tissue=0.0,
                           qc="none")  # fmt: skip
        truth = _tissue_truth(spec, grid)
        kept = {
            (int(x), int(y))
            for x, y in zip(index.columns["l0_x"], index.columns["l0_y"], strict=True)
        }
        at = list(zip(grid.columns["l0_x"].tolist(), grid.columns["l0_y"].tolist(), strict=True))
        tissue = [xy in kept for xy, share in zip(at, truth, strict=True) if share >= 0.9]
        background = [xy in kept for xy, share in zip(at, truth, strict=True) if share == 0]
        record = index.slides[0]
        print(
            f"| {record.tissue_detector} | {forced} ({record.tissue_reason}) | {len(index)} | "
            f"{sum(tissue)} of {len(tissue)} | {sum(background)} of {len(background)} |"
        )


def _tissue_truth(spec: SlideSpec, index: SlideIndex) -> np.ndarray:
    mask = tissue_of(spec)
    ds = 16.0
    w, h = int(np.ceil(spec.width / ds)), int(np.ceil(spec.height / ds))
    raster = mask(0.0, 0.0, ds, w, h).astype(np.float64)
    total = np.zeros((h + 1, w + 1))
    total[1:, 1:] = raster.cumsum(0).cumsum(1)
    x0 = np.clip(index.columns["l0_x"] // ds, 0, w).astype(int)
    y0 = np.clip(index.columns["l0_y"] // ds, 0, h).astype(int)
    x1, y1 = np.clip(x0 + 16, 0, w), np.clip(y0 + 16, 0, h)
    area = np.maximum((x1 - x0) * (y1 - y0), 1)
    return (total[y1, x1] - total[y0, x1] - total[y1, x0] + total[y0, x0]) / area


def real_section(scratch: Path) -> None:
    data = Path(
        os.environ.get(
            "WSI_LOADER_TEST_DATA", Path(__file__).parent.parent.parent / "shared" / "testdata"
        )
    )
    if not data.is_dir():
        print("\n(real slides skipped: set WSI_LOADER_TEST_DATA)")
        return
    print("\n## The real test slides (256 px tiles at 0.5 um/px; TCGA has no MPP: level 0)\n")
    print("| slide | tissue detector | tiles | pen | blur | fold | bubble | min focus |")
    print("|---|---|---|---|---|---|---|---|")
    for name, options in (
        ("CMU-1-Small-Region.svs", {"mpp": 0.5}),
        ("tcga-cr-7395-01a-01-ts1.svs", {"level": 0, "mpp": None}),
        ("test3-DAPI-2-(387).ndpi", {"mpp": 0.5}),
    ):
        index = fresh_index(data / name, scratch / "idx-real", tile_size=256, **options)
        flagged = {rule: int(v.sum()) for rule, v in qc.flags(index.columns).items()}
        focus = np.asarray(index.columns["qc_focus"])
        low = f"{np.nanmin(focus):.2f}" if np.isfinite(focus).any() else "-"
        print(
            f"| {name} | {index.slides[0].tissue_detector} | {len(index)} | {flagged['pen']} | "
            f"{flagged['blur']} | {flagged['fold']} | {flagged['bubble']} | {low} |"
        )
    # the NDPI's background: grid tiles nearly all of whose level-2 pixels are glass-dark
    ndpi = data / "test3-DAPI-2-(387).ndpi"
    for forced in ("auto", "brightfield"):
        index = fresh_index(ndpi, scratch / "idx-ndpi", tile_size=256, mpp=0.5,
                            tissue_detector=forced)  # fmt: skip
        grid = fresh_index(ndpi, scratch / "idx-ndpi-grid", tile_size=256, mpp=0.5,
                           min_tissue=0.0, qc="none")  # fmt: skip
        kept = {
            (int(x), int(y))
            for x, y in zip(index.columns["l0_x"], index.columns["l0_y"], strict=True)
        }
        said = []
        for share in (0.9, 0.6):
            background = _dark_tiles(grid, share)
            indexed = sum((x, y) in kept for x, y in background)
            said.append(f"{indexed} of the {len(background)} tiles {share:.0%} glass")
        print(
            f"\nNDPI with tissue_detector {forced}: {len(index)} of {len(grid)} grid tiles "
            f"indexed as tissue, {'; '.join(said)} (level-2 pixels at most {DARK}/255, the "
            "glass's level)"
        )


def _dark_tiles(grid: SlideIndex, share: float) -> list[tuple[int, int]]:
    """Grid tiles at least ``share`` of whose level-2 pixels are at the glass's level."""
    record = grid.slides[0]
    footprint = round((record.read_size or 0) * (record.read_downsample or 1.0))
    out = []
    with open_slide(grid.slide_path(0)) as reader:
        ds = reader.meta.level_downsamples[2]
        side = int(footprint / ds)
        for x, y in zip(grid.columns["l0_x"].tolist(), grid.columns["l0_y"].tolist(), strict=True):
            pixels = reader.read_region(x, y, 2, side, side)
            if (pixels.max(axis=-1) <= DARK).mean() >= share:
                out.append((x, y))
    return out


def focus_section(pairs: dict[str, list[float]], scratch: Path) -> None:
    print("\n## Focus (stored JPEG bytes, no decode) against the variance of the Laplacian\n")
    if pairs["rho"]:
        per_slide = ", ".join(f"{r:.2f}" for r in pairs["rho"])
        print(
            "synthetic 20k x 15k slides with blurred regions: Spearman rho "
            f"{np.mean(pairs['rho']):.2f} (per slide {per_slide}); blurred vs sharp tiles, "
            f"AUC qc_focus {np.mean(pairs['auc_focus']):.3f}, variance of the Laplacian "
            f"{np.mean(pairs['auc_laplacian']):.3f}"
        )
    default = Path(__file__).resolve().parent.parent.parent / "shared" / "testdata"
    cmu = Path(os.environ.get("WSI_LOADER_TEST_DATA", default)) / "CMU-1-Small-Region.svs"
    if cmu.is_file():
        index = fresh_index(cmu, scratch / "idx-cmu", tile_size=256, mpp=0.5)
        focus, lap = np.asarray(index.columns["qc_focus"]), laplacian_variance(index)
        judged = np.isfinite(focus)
        rho = stats.spearmanr(focus[judged], lap[judged]).statistic
        print(f"CMU-1 (all in focus, {judged.sum()} tissue tiles): Spearman rho {rho:.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--scratch", default=None, help="folder for the synthetic slides")
    parser.add_argument("--quick", action="store_true", help="one slide of one regime")
    parser.add_argument(
        "--images", type=Path, default=IMAGES_FOLDER, help="real images (qc_real_images.py)"
    )
    parser.add_argument(
        "--painters-only",
        choices=TEXTURES,
        action="append",
        help="only the two painters' table, over these renderings (repeatable)",
    )
    args = parser.parse_args()
    scratch = scratch_folder(args.scratch, "wsi-qc-")
    if args.painters_only:
        painters_section(scratch, QUICK if args.quick else REGIMES, args.quick,
                         tuple(args.painters_only))  # fmt: skip
        return
    pairs = synthetic_section(scratch, QUICK if args.quick else REGIMES)
    painters_section(scratch, QUICK if args.quick else REGIMES, args.quick)
    dark_field_section(scratch)
    real_section(scratch)
    real_images_section(args.images)
    focus_section(pairs, scratch)


if __name__ == "__main__":
    main()
