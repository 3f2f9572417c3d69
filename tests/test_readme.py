"""README.md's training loop runs on a small synthetic archive, and its loss masks failed
tiles (the documentation's other blocks: tests/test_docs.py)."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
import torch

from tests.conftest import REPO, SlideFactory


def python_blocks() -> list[str]:
    text = (REPO / "README.md").read_text(encoding="utf-8")
    return re.findall(r"```python\n(.*?)```", text, flags=re.DOTALL)


def test_the_readme_has_python_blocks() -> None:
    assert len(python_blocks()) >= 1


def test_readme_python_blocks_run(
    tmp_path: Path, make_slide: SlideFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    slides = tmp_path / "slides"
    slides.mkdir()
    for i, seed in enumerate((51, 52, 53)):
        shutil.copy(make_slide(width=1800, height=1400, seed=seed), slides / f"case-00{i + 1}.svs")
    (tmp_path / "labels.csv").write_text(
        "slide,label,split\ncase-001,tumour,train\ncase-002,normal,train\ncase-003,tumour,val\n"
    )
    monkeypatch.chdir(tmp_path)
    model = torch.nn.Sequential(
        torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(3, 2)
    )
    namespace: dict[str, object] = {"model": model}
    for block in python_blocks():
        code = block.replace('"/data/slides"', repr(str(slides)))
        exec(compile(code, "README.md", "exec"), namespace)
    # the training block ran to the end with a finite, masked loss
    loss = namespace["loss"]
    assert isinstance(loss, torch.Tensor) and torch.isfinite(loss)
    # the masking works: a failed tile contributes nothing (impossible with a mean-reduced loss)
    criterion = namespace["criterion"]
    logits = torch.zeros(2, 2, requires_grad=True)
    per_tile = criterion(logits, torch.tensor([0, 1]))
    assert per_tile.shape == (2,)
    (per_tile * torch.tensor([1.0, 0.0])).sum().backward()
    assert logits.grad is not None and not logits.grad[1].any()
