"""The dataset card (``README.md``) of an export, for Hugging Face ``datasets``.

``datasets.load_dataset(FOLDER)`` reads the card's YAML header: which files make which split,
and the types of the fields. Without one it guesses, wrongly for exports:

* Splits from words in file and folder names: "train", "val", "dev", "test", "eval"... between
  separators (digits count as separators), so Camelyon16's ``test_001`` or an NDPI named
  ``test3-DAPI-2`` made a "test" split of that slide's tiles alone, the others dropped. The
  export names image files without slide names (see `_imagefolder.image_file`), and the card puts
  every file in one split: the index split exported (``--split``), else ``train``.
* Image-folder labels only when there are two class folders or more; the card names the
  classes (the index's labels, in its id order), so one class still has a label column.
* A WebDataset sample's field types from the first 5 samples (datasets#7549): when those have
  no label (an unlabelled slide first, tiles no annotation covers), or no split or MPP, the
  field is typed null and the first value later fails the load ("Couldn't cast array of type
  string to null").

``load_dataset("imagefolder", data_dir=FOLDER)`` does not read the card: it still reads split
words in class folder names, which are the labels and cannot be renamed, so the export warns
of those (`warn_of_split_words`).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import yaml

from wsi_loader.files import write_file

log = logging.getLogger(__name__)

CARD_FILE = "README.md"
# the card's last line: a README.md without it is someone else's, never replaced
MARK = "<!-- written by wsi_loader export; rewritten by the next export into this folder -->"

# The JSON member of every sample (export/_webdataset.py writes it): field -> Hugging Face type
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

# Hugging Face datasets' split inference (datasets/data_files.py, SPLIT_KEYWORDS and
# NON_WORDS_CHARS): a keyword with a separator or the name's end on each side
SPLIT_WORDS = re.compile(
    r"(?:^|[-._ 0-9])(train|training|validation|valid|dev|val|test|testing|eval|evaluation)"
    r"(?:$|[-._ 0-9])"
)


def card_split(split: str | None) -> str:
    """The card's split name: the index split exported, as Hugging Face allows split names
    (``\\w+``), else ``train``."""
    name = re.sub(r"\W+", "_", split or "").strip("_")
    return name or "train"


def _card(
    data_files: str | Sequence[tuple[str, str]],
    split: str,
    features: list[dict[str, Any]],
    text: str,
    options: dict[str, Any] | None = None,
) -> str:
    """A card with one config: the files of ``data_files`` in ``split`` (or, given (split,
    files) pairs, each split's files), the builder ``options``, and ``features``; ``text``
    below the YAML header."""
    pairs = [(split, data_files)] if isinstance(data_files, str) else list(data_files)
    card: dict[str, Any] = {
        "configs": [
            {
                "config_name": "default",
                **(options or {}),
                "data_files": [{"split": name, "path": path} for name, path in pairs],
            }
        ],
        "dataset_info": {"features": features},
    }
    front = yaml.safe_dump(card, sort_keys=False, allow_unicode=True)
    return f"---\n{front}---\n\n{text}\n\n{MARK}\n"


# One entry of a sample's ``context`` list (exports with context tiles): the scale, the
# window it was read from (level-0 top-left, level, edge in level pixels), its on-slide box
CONTEXT_FIELDS = {
    "mpp": "float64",
    "size": "int64",
    "x": "int64",
    "y": "int64",
    "level": "int64",
    "read_size": "int64",
}


def webdataset_card(
    image_ext: str, classes: Sequence[str], split: str | None = None, context: int = 0
) -> str:
    """The card of shards whose samples are ``KEY.<image_ext>`` and ``KEY.json`` (with a
    ``coverage`` object of ``classes`` when the index has annotation classes), and with
    ``context`` scales ``KEY.ctx1.<image_ext>``... and a ``context`` list in the JSON."""
    types: dict[str, dict[str, object]] = {
        name: {"dtype": dtype} for name, dtype in SAMPLE_FIELDS.items()
    }
    if classes:
        types["coverage"] = {"struct": [{"name": name, "dtype": "float64"} for name in classes]}
    if context:
        entry: list[dict[str, object]] = [
            {"name": name, "dtype": dtype} for name, dtype in CONTEXT_FIELDS.items()
        ]
        entry.append({"name": "inside", "list": "int64"})
        types["context"] = {"list": sorted(entry, key=lambda f: str(f["name"]))}
    # in the order json.dumps(sort_keys=True) writes them
    fields = [{"name": name, **spec} for name, spec in sorted(types.items())]
    features: list[dict[str, Any]] = [
        {"name": image_ext, "dtype": "image"},
        *({"name": f"ctx{k}.{image_ext}", "dtype": "image"} for k in range(1, context + 1)),
        {"name": "json", "struct": fields},
        {"name": "__key__", "dtype": "string"},
        {"name": "__url__", "dtype": "string"},
    ]
    text = (
        f"Tiles exported by wsi_loader as WebDataset shards: `KEY.{image_ext}` (the tile) and "
        "`KEY.json` (its slide, level-0 position, level, label, slide label, split and, for "
        "annotated indexes, class coverage)"
        + (
            f", and `KEY.ctx1.{image_ext}`... (its co-centred context tiles, one per scale; "
            "`context` in the JSON gives each one's scale, window and part on the slide)"
            if context
            else ""
        )
        + ". `manifest.csv` lists every tile, `failures.csv` "
        "those not exported, `export.json` the arguments and counts. Load with "
        "`datasets.load_dataset(FOLDER)` (the types above) or `webdataset.WebDataset`. "
        f"Every tile is in the one `{card_split(split)}` split of this card; the `split` field "
        "holds the index's own split."
    )
    return _card("shard-*.tar", card_split(split), features, text)


def imagefolder_card(
    image_ext: str,
    classes: Sequence[str],
    split: str | None = None,
    splits: Sequence[tuple[str, str]] = (),
) -> str:
    """The card of class folders ``<class>/<tile>.<image_ext>``; ``classes`` are the folder
    names in the index's label id order (which is also their sorted order). With ``splits``
    (split name, folder): ``<folder>/<class>/<tile>``, one card split per folder."""
    features: list[dict[str, Any]] = [{"name": "image", "dtype": "image"}]
    if classes:
        names = {str(i): name for i, name in enumerate(classes)}
        features.append({"name": "label", "dtype": {"class_label": {"names": names}}})
    text = (
        f"Tiles exported by wsi_loader as image folders: `CLASS/s<slide id>_x<X>_y<Y>."
        f"{image_ext}`, one folder per label (tiles without a label are not here). "
        "`manifest.csv` maps every file to its slide, level-0 position, level, label and "
        "split; `failures.csv` lists the tiles not exported and why; `export.json` the "
        "arguments and counts. "
    )
    # drop_labels false: labels even for one class folder (inferred only from two or more)
    options = {"drop_labels": False} if classes else {}
    if splits:
        named = [(card_split(name or folder), folder) for name, folder in splits]
        text = text.replace("`CLASS/", "`SPLIT/CLASS/") + (
            "Load with `datasets.load_dataset(FOLDER)` (this card: the splits "
            f"{', '.join(f'`{name}`' for name, _ in named)}, the classes above with the "
            "index's label ids) or `torchvision.datasets.ImageFolder(FOLDER/SPLIT)` (its class "
            "ids are those of the class folders present in that split)."
        )
        files = [(name, f"{folder}/*/*.{image_ext}") for name, folder in named]
        return _card(files, named[0][0], features, text, options)
    text += (
        "Load with `datasets.load_dataset(FOLDER)` (this card: one split, the classes above "
        "with the index's label ids) or `torchvision.datasets.ImageFolder`. Every tile is in "
        f"the one `{card_split(split)}` split of this card."
    )
    return _card(f"*/*.{image_ext}", card_split(split), features, text, options)


def warn_of_split_words(folders: Iterable[str], out: Path) -> list[str]:
    """Warn of class folders whose names Hugging Face's imagefolder builder takes for split
    names; returns them."""
    taken = [folder for folder in folders if SPLIT_WORDS.search(folder)]
    if taken:
        log.warning(
            "%s: the class folders %s hold a word that load_dataset('imagefolder', "
            "data_dir=...) takes for a split name (train, val, test...): it would load them as "
            "splits of their own and drop the other classes. Load the export with "
            "load_dataset(%r), which reads the export's dataset card (one split, every class)",
            out,
            ", ".join(repr(f) for f in taken),
            str(out),
        )
    return taken


def is_ours(out: Path) -> bool:
    """Whether ``out``'s README.md was written by an export (or there is none)."""
    path = out / CARD_FILE
    try:
        return path.read_text(encoding="utf-8", errors="replace").rstrip().endswith(MARK)
    except FileNotFoundError:
        return True


def write_card(out: Path, card: str) -> bool:
    """Write ``card`` unless ``out`` holds a README.md of someone else's (said, and kept)."""
    if not is_ours(out):
        log.warning(
            "%s: a README.md not written by an export is there, so the dataset card was not "
            "written (Hugging Face datasets then infers splits from file names and field types "
            "from the first samples: pass data_files= and features= to load_dataset)",
            out,
        )
        return False
    write_file(out / CARD_FILE, card.encode("utf-8"))
    return True
