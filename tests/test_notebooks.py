"""The notebooks are committed executed (readable without running them), with no error, and
they still run top to bottom in the project's environment."""

from __future__ import annotations

import ast
import math
import re

import pytest

from tests.conftest import REPO

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")


NOTEBOOKS = ["01_index_and_inspect.ipynb", "02_training_loop.ipynb", "03_mil_features.ipynb"]


def test_every_notebook_is_listed() -> None:
    assert sorted(p.name for p in (REPO / "notebooks").glob("*.ipynb")) == NOTEBOOKS


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_is_committed_executed(name: str) -> None:
    """Every code cell ran, in order, in one session (`make notebooks`), and none failed."""
    notebook = nbformat.read(REPO / "notebooks" / name, as_version=4)
    cells = [cell for cell in notebook.cells if cell.cell_type == "code"]
    counts = [cell.get("execution_count") for cell in cells]
    assert counts == list(range(1, len(cells) + 1)), f"run 'make notebooks' ({counts})"
    # and the outputs came from the code as it is now, not from an earlier version of a cell
    from notebooks.execute import code_digest

    executed = notebook.metadata.get("wsi_loader", {}).get("executed_code")
    assert executed == code_digest(notebook), "a code cell changed since: run 'make notebooks'"
    check_outputs(name, notebook)


@pytest.mark.slow
@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_executes(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("JUPYTER_PLATFORM_DIRS", "1")
    from notebooks.execute import execute

    notebook = execute(REPO / "notebooks" / name)
    check_outputs(name, notebook)


def check_outputs(name: str, notebook: nbformat.NotebookNode) -> None:
    outputs = [o for cell in notebook.cells if cell.cell_type == "code" for o in cell.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    if name.startswith("01"):
        images = [o for o in outputs if "image/png" in o.get("data", {})]
        assert len(images) >= 5  # overviews and mosaics rendered themselves
    elif name.startswith("02"):  # the training loop learnt the two classes it was shown
        text = "".join(o.get("text", "") for o in outputs if o.output_type == "stream")
        losses = ast.literal_eval(next(ln for ln in text.splitlines() if ln.startswith("[")))
        assert len(losses) >= 12 and all(math.isfinite(v) for v in losses)
        means = [float(v) for v in re.findall(r"mean loss ([\d.]+)", text)]
        assert len(means) == 3 and means[-1] < 0.7 * means[0], means  # a loss that drops
        accuracy = float(re.search(r"held-out accuracy ([\d.]+)", text).group(1))  # type: ignore[union-attr]
        assert accuracy >= 0.8  # and tiles of slides it never saw are told apart
        assert "waited for data" in text
        images = [o for o in outputs if "image/png" in o.get("data", {})]
        assert len(images) == 2  # a mosaic of each class
    else:  # features were extracted for every slide and the MIL model trained on them
        text = "".join(o.get("text", "") for o in outputs if o.output_type == "stream")
        assert "6 slides," in text and "0 failed" in text
        losses = ast.literal_eval(next(ln for ln in text.splitlines() if ln.startswith("[")))
        assert len(losses) == 12 and all(math.isfinite(v) for v in losses)
        assert "most attended tiles" in text
