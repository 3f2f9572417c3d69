"""Per-slide features for slide-level (MIL) training, in CLAM's and TRIDENT's h5 layout.

A frozen encoder turns every tile of a slide into an embedding, once; attention-MIL models then
train on each slide's bag of embeddings. The pass itself (reading, the model, checks of its
outputs, resuming, ranks, timeouts) is `wsi_loader.model_pass`; model specs are
`wsi_loader.models`. This module is the h5 writer.

Output, per slide: ``DIR/<slide name>.h5`` (the slide file's stem, as CLAM and TRIDENT name
them) with ``features`` (N x D float32) and ``coords`` (N x 2 int64, level-0 x, y), attributes
``patch_size`` and ``patch_level`` (on the file and on ``coords``, where CLAM reads them),
``mpp``, ``model``, ``generation`` and ``content``; and ``DIR/features.json`` (model, dims,
counts, failures). With context scales (``context=``), the same model encodes each tile's
co-centred context tiles: ``features_ctx1``... beside ``features``, or concatenated into it,
as the file's ``context`` attribute says. A slide's file is written under a temporary name
and renamed when complete; a rerun skips slides whose file holds the same content (slide
version, tiles, model weights, context layout). Tiles that fail to read are left out and listed
with their reason; a slide whose features are not finite (NaN, Inf) is not written and is
listed under ``failed_slides``.

Under ``torchrun`` (``torch.distributed`` initialised), ranks split the slides (balanced by
tile count, each slide on exactly one rank) and each writes its own; rank 0 writes
``features.json`` once every rank is done.
"""

from wsi_loader.features._extract import (
    DTYPES,
    FEATURES_JSON,
    Encoder,
    FeatureReport,
    assign_slides,
    encoder_from,
    extract,
    extract_features,
    load_encoder,
)

__all__ = [
    "DTYPES",
    "FEATURES_JSON",
    "Encoder",
    "FeatureReport",
    "assign_slides",
    "encoder_from",
    "extract",
    "extract_features",
    "load_encoder",
]
