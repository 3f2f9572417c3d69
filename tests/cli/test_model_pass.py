"""`features` and `predict` take the options of one model pass from one place
(`cli/_model_pass.py`), and those options are `PassOptions`' fields."""

from __future__ import annotations

import dataclasses

from wsi_loader.cli import build_parser
from wsi_loader.cli._model_pass import pass_keywords
from wsi_loader.models import PassOptions

SHARED = ["--out", "o", "--batch-size", "8", "--device", "cpu", "--dtype", "bfloat16"]
SHARED += ["--workers", "0", "--timeout", "5", "--no-progress", "--split", "val"]


def test_features_and_predict_read_the_same_pass_options() -> None:
    parser = build_parser()
    features = parser.parse_args(["features", "idx", "--model", "m:f", *SHARED])
    predict = parser.parse_args(["predict", "idx", "--model", "m:f", *SHARED])
    assert pass_keywords(features) == pass_keywords(predict)
    keywords = pass_keywords(features)
    assert set(keywords) <= {f.name for f in dataclasses.fields(PassOptions)}
    options = PassOptions(**keywords)
    options.check()
    assert (options.batch_size, options.dtype, options.timeout, options.split) == (
        8,
        "bfloat16",
        5.0,
        "val",
    )
    assert options.progress is False and options.stain is None
