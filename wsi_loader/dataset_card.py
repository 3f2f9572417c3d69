"""The dataset card (``README.md``) of a WebDataset export, for Hugging Face ``datasets``.

``datasets.load_dataset(FOLDER)`` takes the types of a sample's fields from the folder's card.
Without one, its WebDataset reader guesses them from the first 5 samples (datasets#7549):
when those have no label (an unlabelled slide first, tiles no annotation covers), or no
split or MPP, the field is typed null and the first value later fails the load ("Couldn't
cast array of type string to null"). The card also names the shards, so the folder loads
without ``data_files``.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

import yaml

from wsi_loader.files import write_file

log = logging.getLogger(__name__)

CARD_FILE = "README.md"
# the card's last line: a README.md without it is someone else's, never replaced
MARK = "<!-- written by wsi_loader export; rewritten by the next export into this folder -->"

# The JSON member of every sample (export.py writes it): field -> Hugging Face type
SAMPLE_FIELDS = {
    "slide": "string",
    "slide_id": "int64",
    "x": "int64",
    "y": "int64",
    "level": "int64",
    "read_size": "int64",
    "mpp": "float64",
    "label": "string",
    "label_id": "int64",
    "slide_label": "string",
    "split": "string",
    "row": "int64",
}


def card_text(image_ext: str, classes: Sequence[str]) -> str:
    """The card of shards whose samples are ``KEY.<image_ext>`` and ``KEY.json`` (with a
    ``coverage`` object of ``classes`` when the index has annotation classes)."""
    types: dict[str, dict[str, object]] = {
        name: {"dtype": dtype} for name, dtype in SAMPLE_FIELDS.items()
    }
    if classes:
        types["coverage"] = {"struct": [{"name": name, "dtype": "float64"} for name in classes]}
    # in the order json.dumps(sort_keys=True) writes them
    fields = [{"name": name, **spec} for name, spec in sorted(types.items())]
    card = {
        "configs": [
            {
                "config_name": "default",
                "data_files": [{"split": "train", "path": "shard-*.tar"}],
            }
        ],
        "dataset_info": {
            "features": [
                {"name": image_ext, "dtype": "image"},
                {"name": "json", "struct": fields},
                {"name": "__key__", "dtype": "string"},
                {"name": "__url__", "dtype": "string"},
            ]
        },
    }
    front = yaml.safe_dump(card, sort_keys=False, allow_unicode=True)
    return (
        f"---\n{front}---\n\n"
        f"Tiles exported by wsi_loader as WebDataset shards: `KEY.{image_ext}` (the tile) and "
        "`KEY.json` (its slide, level-0 position, level, label, slide label, split and, for "
        "annotated indexes, class coverage). `manifest.csv` lists every tile, `failures.csv` "
        "those not exported, `export.json` the arguments and counts. Load with "
        "`datasets.load_dataset(FOLDER)` (the types above) or `webdataset.WebDataset`. "
        "Every tile is in the one `train` split of this card; the `split` field holds the "
        "index's own split.\n\n"
        f"{MARK}\n"
    )


def is_ours(out: Path) -> bool:
    """Whether ``out``'s README.md was written by an export (or there is none)."""
    path = out / CARD_FILE
    try:
        return path.read_text(encoding="utf-8", errors="replace").rstrip().endswith(MARK)
    except FileNotFoundError:
        return True


def write_card(out: Path, image_ext: str, classes: Sequence[str]) -> bool:
    """Write the card unless ``out`` holds a README.md of someone else's (said, and kept)."""
    if not is_ours(out):
        log.warning(
            "%s: a README.md not written by an export is there, so the dataset card was not "
            "written (Hugging Face datasets then guesses the field types from the first samples: "
            "pass features= to load_dataset)",
            out,
        )
        return False
    write_file(out / CARD_FILE, card_text(image_ext, classes).encode("utf-8"))
    return True
