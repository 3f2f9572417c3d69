"""Run every notebook here top to bottom and save it with its outputs (`make notebooks`).

The notebooks are committed executed, so they can be read (thumbnails, mosaics, losses) without
running them; `tests/test_notebooks.py` checks that they are and runs them again. Each runs in
a fresh temporary folder, so the slides it writes stay out of the repository; timing metadata
is not recorded, so a rerun changes only what the code printed.
"""

from __future__ import annotations

import hashlib
import sys
import tempfile
from pathlib import Path

import nbclient
import nbformat

HERE = Path(__file__).resolve().parent


def code_digest(notebook: nbformat.NotebookNode) -> str:
    """A digest of the code cells' sources: outputs saved with it came from this code."""
    code = [cell.source for cell in notebook.cells if cell.cell_type == "code"]
    return hashlib.sha256("\0".join(code).encode()).hexdigest()


def execute(path: Path) -> nbformat.NotebookNode:
    """The notebook at ``path``, run in a temporary folder (its outputs replaced)."""
    notebook = nbformat.read(path, as_version=4)
    with tempfile.TemporaryDirectory(prefix="wsi-notebook-") as folder:
        client = nbclient.NotebookClient(
            notebook,
            timeout=600,
            kernel_name="python3",
            record_timing=False,
            resources={"metadata": {"path": folder}},
        )
        client.execute()
    notebook.metadata["wsi_loader"] = {"executed_code": code_digest(notebook)}
    return notebook


def main(names: list[str]) -> None:
    paths = [HERE / name for name in names] or sorted(HERE.glob("*.ipynb"))
    for path in paths:
        print(f"running {path.name} ...", flush=True)
        nbformat.write(execute(path), path)


if __name__ == "__main__":
    main(sys.argv[1:])
