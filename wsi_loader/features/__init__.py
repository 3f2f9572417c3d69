"""Per-slide features for slide-level (MIL) training: a frozen encoder over every tile, written
in CLAM's and TRIDENT's h5 layout (`_extract`: `extract`, the h5 writer, ``features.json``),
a features folder as one AnnData ``.h5ad`` for scverse tools (`_anndata`), and one embedding per
slide from a features folder by a registry slide encoder (`_slide_embeddings`).
The pass itself (reading, the model, checked outputs, resume, ranks, timeouts) is
`wsi_loader.models`; the bags are read back by `wsi_loader.dataset.FeatureBagDataset`.

May import: every earlier step (`slides` ... `models`) and the foundation modules; not
`predict`, `export`, `view` or `cli`.
"""

from wsi_loader.features._extract import (
    FEATURES_JSON,
    Encoder,
    FeatureReport,
    encoder_from,
    extract,
    extract_features,
    load_encoder,
)
from wsi_loader.features._slide_embeddings import (
    EMBEDDINGS_CSV,
    EMBEDDINGS_H5,
    SlideEmbeddingReport,
    embed_slides,
)
from wsi_loader.models._pass import DTYPES, assign_slides

__all__ = [
    "DTYPES",
    "EMBEDDINGS_CSV",
    "EMBEDDINGS_H5",
    "FEATURES_JSON",
    "Encoder",
    "FeatureReport",
    "SlideEmbeddingReport",
    "assign_slides",
    "embed_slides",
    "encoder_from",
    "extract",
    "extract_features",
    "load_encoder",
]
