"""Quality control and the H&E fit on real images with ink, folds and other stains.

    .venv/bin/python benchmarks/qc_real_images.py [--images DIR] [--overlays]

The images are public test and training images of other projects (HistoQC, histolab,
TIAToolbox; benchmarks/README.md says where each comes from and how to fetch it), kept in a
git-ignored folder (``.cache/qc-real`` by default) and never committed. Each is taken as a
slide's low-resolution picture at the microns per pixel `IMAGES` assumes (none records its
own): the QC columns (`_qc.measure`) over tiles of 256 px at 0.5 um/px (128 um), and the
stain fit of its tissue (`estimate_stain`: `he_deg`, `e_lean`, and whether it is said not to
be H&E). Where an image comes with a mask of its ink (HistoQC's ``*_mask.png``), pen is
scored as the synthetic slides are: recall over tiles the mask covers at least half of,
precision over tiles it covers under 2%. ``--overlays`` writes each image with the flagged
pixels marked (pen cyan, fold yellow) beside it, to judge the images without a mask by eye.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image

from wsi_loader.index import _qc as qc
from wsi_loader.index._lowres import LowResolution, TileBoxes
from wsi_loader.index._stain_estimates import estimate_stain
from wsi_loader.index._tissue import choose_detector, pixel_rule, tissue_mask
from wsi_loader.synthetic._artefacts import Score

DEFAULT = Path(__file__).resolve().parent.parent / ".cache" / "qc-real"
TILE_UM = 128.0  # 256 px tiles at 0.5 um/px


@dataclass(frozen=True)
class RealImage:
    name: str  # file in the folder (its mask, if any: the same name ending _mask.png)
    um_per_px: float  # assumed from what the image shows (nuclei ~8 um, whole sections)
    shows: str


IMAGES = (
    RealImage("histoqc--pen--1k_version--pen_black.png", 20, "H&E slide, black marker"),
    RealImage("histoqc--pen--1k_version--pen_green.png", 20,
              "H&E slide, green marker circle, yellow margin dye"),
    RealImage("histoqc--pen--1k_version--pen_red.png", 20, "H&E slide, red marker strokes"),
    RealImage("histoqc--models--pen_markings_he--pen_green.png", 68,
              "the green slide, smaller"),
    RealImage("histoqc--models--pen_markings_he--pen_red.png", 37, "the red slide, smaller"),
    RealImage("histolab--tcga-green-pen.png", 4, "TCGA H&E region, green ink over tissue"),
    RealImage("histolab--tcga-red-pen.png", 4, "TCGA H&E region, red ink over fat"),
    RealImage("histolab--wsi-blue-pen.png", 64, "slide thumbnail, blue ink ticks"),
    RealImage("histolab--diagnostic-slide-thumb-rgb.png", 32,
              "slide thumbnail, red, green and black ink outlines"),
    RealImage("histolab--medium-nuclei-score-green-pen-level1.png", 1,
              "TCGA H&E tile, green ink over tissue"),
    RealImage("histolab--high-nuclei-score-red-pen-level1.png", 2,
              "TCGA H&E tile, a fold (dark band) and red ink"),
    RealImage("histoqc--models--coverslip_edge_ihc--coverslip_edge.png", 10,
              "IHC (H-DAB) slide edge"),
    RealImage("histoqc--models--coverslip_edge_he--coverslip_edge.png", 10,
              "H&E section, coverslip edge"),
    RealImage("histoqc--templates--template1.png", 1, "clean H&E region"),
    RealImage("tiatoolbox--target_image.png", 0.5, "clean H&E region"),
    RealImage("histolab--tcga-lung-rgb.png", 0.5, "clean H&E region"),
)  # fmt: skip


def measure_image(rgb: np.ndarray, um_per_px: float) -> tuple[qc.QcResult, TileBoxes, np.ndarray]:
    """The QC columns of a picture taken as a whole slide at ``um_per_px`` (level 0 = the
    picture), over `TILE_UM` tiles; and its tissue mask."""
    detector, _ = choose_detector(rgb)
    rule = pixel_rule(rgb, detector)
    h, w = rgb.shape[:2]
    step = TILE_UM / um_per_px
    xs = np.arange(0, w, step)
    ys = np.arange(0, h, step)
    gy, gx = np.meshgrid(ys, xs, indexing="ij")
    tiles = TileBoxes(gx.ravel().astype(np.int64), gy.ravel().astype(np.int64), step)
    low = LowResolution(rgb, 0, (w, h))
    tissue = tissue_mask(rgb, rule, None)
    return qc.measure(low, rule, tiles, um_per_px, None, tissue), tiles, tissue


def mask_shares(mask: np.ndarray, tiles: TileBoxes) -> np.ndarray:
    """The share of each tile the mask covers (the part on the picture)."""
    h, w = mask.shape
    step = tiles.footprint
    out = np.empty(len(tiles))
    for i, (x, y) in enumerate(zip(tiles.l0_x.tolist(), tiles.l0_y.tolist(), strict=True)):
        x1, y1 = min(w, math.ceil(x + step)), min(h, math.ceil(y + step))
        out[i] = mask[y:y1, x:x1].mean()
    return out


def overlay(rgb: np.ndarray, result: qc.QcResult, path: Path) -> None:
    """The picture with QC's pen (cyan) and fold (yellow) pixels marked, beside itself."""
    marked = rgb.copy()
    for name, colour in (("pen", (0, 255, 255)), ("fold", (255, 230, 0))):
        area = result.areas.get(name)
        if area is not None and area.any():
            big = Image.fromarray(area.astype(np.uint8) * 255).resize(
                (rgb.shape[1], rgb.shape[0]), Image.Resampling.NEAREST
            )
            area = np.asarray(big) > 0
            marked[area] = (0.4 * marked[area] + 0.6 * np.array(colour)).astype(np.uint8)
    Image.fromarray(np.concatenate([rgb, marked], axis=1)).save(path)


def real_images_section(folder: Path = DEFAULT, overlays: bool = False) -> None:
    print("\n## Real images with ink, folds, IHC (public test images; see Sources)\n")
    if not folder.is_dir():
        print(f"(skipped: no {folder}; benchmarks/README.md says how to fetch the images)")
        return
    print(
        "| image | um/px assumed | shows | tiles | pen tiles flagged | pen recall / precision "
        "(mask) | fold tiles flagged | blue stain | he_deg H, E | e_lean | said not H&E |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for image in IMAGES:
        path = folder / image.name
        if not path.is_file():
            print(f"| {image.name} | missing | | | | | | | | | |")
            continue
        rgb = np.asarray(Image.open(path).convert("RGB"))
        result, tiles, tissue = measure_image(rgb, image.um_per_px)
        flagged = qc.flags(result.columns)
        scored = "-"
        mask_path = path.with_name(path.stem + "_mask.png")
        if mask_path.is_file():
            shares = mask_shares(np.asarray(Image.open(mask_path).convert("L")) > 0, tiles)
            positive, negative = shares >= 0.5, shares < 0.02
            hits = int((flagged["pen"] & positive).sum())
            found = Score(
                int(positive.sum()),
                hits,
                int((flagged["pen"] & negative).sum()),
                int(positive.sum()) - hits,
            )
            scored = f"{found.recall:.2f} / {found.precision:.2f} of {found.positives}"
        stain = estimate_stain(rgb, tissue)
        if isinstance(stain, str):
            fit = f"no estimate ({stain.split(' (')[0]}) | - | -"
        else:
            h_deg, e_deg = stain.he_angles()
            said = "yes" if stain.not_he() else "no"
            fit = f"{h_deg:.1f}, {e_deg:.1f} | {stain.e_lean():.2f} | {said}"
        blue = "yes" if result.summary.get("blue_stain") else "no"
        print(
            f"| {image.name} | {image.um_per_px:g} | {image.shows} | {len(tiles)} | "
            f"{int(flagged['pen'].sum())} | {scored} | {int(flagged['fold'].sum())} | {blue} | "
            f"{fit} |"
        )
        if overlays:
            overlay(rgb, result, folder / "overlays" / image.name)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--images", type=Path, default=DEFAULT, help="the fetched images")
    parser.add_argument("--overlays", action="store_true", help="write marked copies")
    args = parser.parse_args()
    if args.overlays:
        (args.images / "overlays").mkdir(parents=True, exist_ok=True)
    real_images_section(args.images, args.overlays)


if __name__ == "__main__":
    main()
