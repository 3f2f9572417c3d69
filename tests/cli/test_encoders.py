"""`wsi-loader features`/`predict` options that belong to registry encoders (`--model NAME`)."""

from __future__ import annotations

from pathlib import Path

import pytest

from wsi_loader.cli import main
from wsi_loader.index import SlideIndex


@pytest.mark.parametrize("command", ["features", "predict"])
@pytest.mark.parametrize(
    "option", [["--precision", "float16"], ["--compile"], ["--strict"], ["--weights", "w.pt"]]
)
def test_encoder_options_with_another_model_are_refused(
    index: SlideIndex,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    command: str,
    option: list[str],
) -> None:
    """--precision, --compile and --strict with a model that is not a registry encoder ran
    and were silently ignored (--weights and --head were refused)."""
    out = tmp_path / "out"
    code = main([command, str(index.path), "--model", "tests.feature_models:classifier",
                 "--out", str(out), "--workers", "0", "--no-progress", *option])  # fmt: skip
    err = capsys.readouterr().err
    assert code == 2 and f"{option[0]} goes with --model NAME" in err, err
    assert not out.exists()
