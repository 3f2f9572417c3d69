"""Fetch the public images `qc_real_images.py` reads into the git-ignored ``.cache/qc-real``.

    .venv/bin/python benchmarks/fetch_qc_images.py [--from-mirror DIR]

Each image is copied byte for byte out of a public GitHub repository at the commit named in
`SOURCES` (benchmarks/README.md says what each shows and its licence), saved as
``<owner-repo>--<path with / as -->``. The repositories are shallow-cloned with git (or read
from local clones, ``--from-mirror DIR`` holding ``owner+name/repo``). Never commit them.
"""

from __future__ import annotations

import argparse
import subprocess
import tempfile
from pathlib import Path

from qc_real_images import DEFAULT

# repository: (commit, prefix of the saved names, files)
SOURCES: dict[str, tuple[str, str, tuple[str, ...]]] = {
    "choosehappy/HistoQC": (
        "b79561292e49d153e2e4c1401c9c48d3d5f925e1",
        "histoqc",
        tuple(
            f"histoqc/data/{name}"
            for name in (
                "pen/1k_version/pen_black.png", "pen/1k_version/pen_black_mask.png",
                "pen/1k_version/pen_green.png", "pen/1k_version/pen_green_mask.png",
                "pen/1k_version/pen_red.png", "pen/1k_version/pen_red_mask.png",
                "models/pen_markings_he/pen_green.png",
                "models/pen_markings_he/pen_green_mask.png",
                "models/pen_markings_he/pen_red.png", "models/pen_markings_he/pen_red_mask.png",
                "models/coverslip_edge_ihc/coverslip_edge.png",
                "models/coverslip_edge_he/coverslip_edge.png", "templates/template1.png",
            )
        ),
    ),
    "histolab/histolab": (
        "202a8bcac21054fbfc1f98e33867525eae8bdae4",
        "histolab",
        (
            "tests/fixtures/pil-images-rgb/tcga-green-pen.png",
            "tests/fixtures/pil-images-rgb/tcga-red-pen.png",
            "tests/fixtures/pil-images-rgb/wsi-blue-pen.png",
            "tests/fixtures/pil-images-rgb/diagnostic-slide-thumb-rgb.png",
            "tests/fixtures/pil-images-rgb/tcga-lung-rgb.png",
            "tests/fixtures/tiles/medium-nuclei-score-green-pen-level1.png",
            "tests/fixtures/tiles/high-nuclei-score-red-pen-level1.png",
        ),
    ),
    "TissueImageAnalytics/tiatoolbox": (
        "6fc8a2ec4fc6076d4c573568fa23c79dba1b0471",
        "tiatoolbox",
        ("tiatoolbox/data/target_image.png",),
    ),
}  # fmt: skip


def saved_name(prefix: str, path: str) -> str:
    """``histoqc--pen--1k_version--pen_black.png``: the prefix and the path below the
    repository's data folders (HistoQC's ``histoqc/data/``; histolab's and TIAToolbox's
    file name alone)."""
    if prefix == "histoqc":
        return f"{prefix}--" + path.removeprefix("histoqc/data/").replace("/", "--")
    return f"{prefix}--{Path(path).name}"


def fetch(out: Path, mirror: Path | None) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for repo, (commit, prefix, files) in SOURCES.items():
        with tempfile.TemporaryDirectory() as tmp:
            if mirror is not None:
                git_dir = mirror / repo.replace("/", "+") / "repo"
            else:
                git_dir = Path(tmp) / "repo"
                subprocess.run(["git", "init", "-q", str(git_dir)], check=True)
                url = f"https://github.com/{repo}"
                subprocess.run(["git", "-C", str(git_dir), "fetch", "-q", "--depth", "1", url,
                                commit], check=True)  # fmt: skip
            for path in files:
                blob = subprocess.run(["git", "--git-dir", str(git_dir / ".git")
                                       if mirror is None else str(git_dir), "show",
                                       f"{commit}:{path}"], check=True,
                                      capture_output=True).stdout  # fmt: skip
                (out / saved_name(prefix, path)).write_bytes(blob)
                print(f"{repo} {commit[:8]} {path} -> {saved_name(prefix, path)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=DEFAULT)
    parser.add_argument("--from-mirror", type=Path, default=None, help="local clones")
    args = parser.parse_args()
    fetch(args.out, args.from_mirror)


if __name__ == "__main__":
    main()
