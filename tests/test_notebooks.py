"""Both notebooks run top to bottom in the project's environment."""

from __future__ import annotations

import ast
import math
from pathlib import Path

import pytest

from tests.conftest import REPO

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")


@pytest.mark.slow
@pytest.mark.parametrize(
    "name", ["01_index_and_inspect.ipynb", "02_training_loop.ipynb", "03_mil_features.ipynb"]
)
def test_notebook_executes(name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("JUPYTER_PLATFORM_DIRS", "1")
    notebook = nbformat.read(REPO / "notebooks" / name, as_version=4)
    assert all(not cell.get("outputs") for cell in notebook.cells if cell.cell_type == "code"), (
        "notebooks are committed without outputs"
    )
    client = nbclient.NotebookClient(
        notebook,
        timeout=600,
        kernel_name="python3",
        resources={"metadata": {"path": str(tmp_path)}},
    )
    client.execute()
    outputs = [o for cell in notebook.cells if cell.cell_type == "code" for o in cell.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    if name.startswith("01"):
        images = [o for o in outputs if "image/png" in o.get("data", {})]
        assert len(images) >= 5  # overviews and mosaics rendered themselves
    elif name.startswith("02"):  # the training loop printed its finite losses
        text = "".join(o.get("text", "") for o in outputs if o.output_type == "stream")
        losses = ast.literal_eval(next(ln for ln in text.splitlines() if ln.startswith("[")))
        assert len(losses) == 12 and all(math.isfinite(v) for v in losses)
        assert "waited for data" in text
    else:  # features were extracted for every slide and the MIL model trained on them
        text = "".join(o.get("text", "") for o in outputs if o.output_type == "stream")
        assert "6 slides," in text and "0 failed" in text
        losses = ast.literal_eval(next(ln for ln in text.splitlines() if ln.startswith("[")))
        assert len(losses) == 12 and all(math.isfinite(v) for v in losses)
        assert "most attended tiles" in text
