"""The package's layout is its data flow (issue 47, ``../shared/DESIGN.md``): one package per
step, imports only from earlier steps, the slide and index layers free of torch, a small root
and modules small enough to read in one sitting. Checked on the source with `ast`, so an
import inside a function or under ``TYPE_CHECKING`` counts as much as one at the top."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from tests.conftest import REPO

PACKAGE = REPO / "wsi_loader"

# the steps in the order data flows; a package may import the foundations and earlier steps
STEPS: dict[str, int] = {
    "slides": 1,
    "index": 2,
    "stain": 3,
    "dataset": 4,
    "device": 5,
    "models": 6,
    "features": 7,
    "predict": 7,
    "export": 7,
    "ray": 7,
    "view": 8,
    "cli": 9,
}
# modules of the root every step may import; they import only each other
FOUNDATIONS = {"errors", "files", "config", "parallel", "permutation"}
# synthetic slides (tests, the demo, benchmarks): import foundations only; of the package,
# only the command line (``wsi-loader demo``) uses them
SYNTHETIC = "synthetic"
TORCH_FREE = {"slides", "index"}
MAX_ROOT_MODULES = 6
MAX_LINES = 600


def part_of(module: str) -> str:
    """The step or foundation a dotted module name belongs to (``wsi_loader.index._table``
    -> ``index``); ``""`` for the package root itself."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def imports_of(path: Path, module: str) -> list[tuple[int, str]]:
    """Every ``wsi_loader`` module ``path`` imports, relative imports resolved, with its line."""
    found = []
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                target = f"{base}.{node.module}" if node.module else base
            else:
                target = node.module or ""
            found.append((node.lineno, target))
            # ``from wsi_loader import index`` imports the step named by the alias (other
            # names, ``__version__``, are the root's own)
            if target == "wsi_loader":
                parts = {*STEPS, *FOUNDATIONS, SYNTHETIC}
                found += [
                    (node.lineno, f"wsi_loader.{a.name}") for a in node.names if a.name in parts
                ]
    return [(line, name) for line, name in found if name.split(".")[0] in ("wsi_loader", "torch")]


def violations(root: Path) -> list[str]:
    """What in the package at ``root`` breaks the layout, one line each."""
    said = []
    for path in sorted(root.rglob("*.py")):
        relative = path.relative_to(root.parent).with_suffix("")
        module = ".".join(relative.parts).removesuffix(".__init__")
        mine = part_of(module)
        where = f"{path.relative_to(root.parent)}"
        for line, name in imports_of(path, module):
            theirs = part_of(name)
            if name.split(".")[0] == "torch":
                if mine in TORCH_FREE:
                    said.append(f"{where}:{line}: the {mine} layer imports torch")
                continue
            if mine == "" or theirs in ("", mine):
                continue  # the root's public API; within one step
            if mine in FOUNDATIONS or mine == SYNTHETIC:
                if theirs not in FOUNDATIONS:
                    said.append(f"{where}:{line}: foundation {mine} imports {name}")
            elif theirs == SYNTHETIC:
                if mine != "cli":
                    said.append(f"{where}:{line}: {mine} imports the synthetic slides")
            elif theirs in FOUNDATIONS:
                continue
            elif mine not in STEPS or theirs not in STEPS:
                said.append(f"{where}:{line}: {module} or {name} is in no step of the flow")
            elif STEPS[theirs] >= STEPS[mine]:
                said.append(f"{where}:{line}: {mine} imports a later or parallel step: {name}")
    return said


def test_every_import_goes_to_an_earlier_step() -> None:
    assert violations(PACKAGE) == []


def test_the_check_sees_an_import_of_a_later_step(tmp_path: Path) -> None:
    fake = tmp_path / "wsi_loader"
    for name, text in {
        "__init__.py": "",
        "errors.py": "",
        "index/__init__.py": "",
        "index/_table.py": "import torch\nfrom wsi_loader.dataset import make_loader\n",
        "dataset/__init__.py": "from . import _loader\n",
        "dataset/_loader.py": "def f():\n    from wsi_loader.predict._run import predict\n",
        "predict/_run.py": "from ..export import _export\n",
        "export/_export.py": "from wsi_loader.synthetic import write_svs\n",
        "files.py": "from wsi_loader.slides import open_slide\n",
    }.items():
        (fake / name).parent.mkdir(parents=True, exist_ok=True)
        (fake / name).write_text(text)
    assert violations(fake) == [
        "wsi_loader/dataset/_loader.py:2: dataset imports a later or parallel step: "
        "wsi_loader.predict._run",
        "wsi_loader/export/_export.py:1: export imports the synthetic slides",
        "wsi_loader/files.py:1: foundation files imports wsi_loader.slides",
        "wsi_loader/index/_table.py:1: the index layer imports torch",
        "wsi_loader/index/_table.py:2: index imports a later or parallel step: wsi_loader.dataset",
        "wsi_loader/predict/_run.py:1: predict imports a later or parallel step: wsi_loader.export",
    ]


def test_each_step_is_a_package_with_a_docstring() -> None:
    for step in STEPS:
        init = PACKAGE / step / "__init__.py"
        assert init.is_file(), f"no package {step}/"
        assert ast.get_docstring(ast.parse(init.read_text(encoding="utf-8"))), init


def test_the_root_holds_the_public_api_and_a_few_foundations() -> None:
    root = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(root) <= MAX_ROOT_MODULES, root
    assert set(root) <= {"__init__.py", *(f"{name}.py" for name in FOUNDATIONS)}, root


@pytest.mark.parametrize(
    "path", sorted(PACKAGE.rglob("*.py")), ids=lambda p: str(p.relative_to(PACKAGE))
)
def test_modules_are_small_enough_to_read_in_one_sitting(path: Path) -> None:
    lines = len(path.read_text(encoding="utf-8").splitlines())
    assert lines <= MAX_LINES, f"{path.relative_to(REPO)}: {lines} lines"


def test_each_package_docstring_names_its_modules() -> None:
    """A newcomer finds a module from its package's docstring in one hop: every private module
    and subpackage is named there."""
    unnamed = []
    for init in sorted(PACKAGE.rglob("__init__.py")):
        doc = ast.get_docstring(ast.parse(init.read_text(encoding="utf-8"))) or ""
        folder = init.parent
        for child in sorted(folder.iterdir()):
            if (
                child.suffix == ".py"
                and child.name.startswith("_")
                and not child.name.startswith("__")
            ):
                if not re.search(rf"(?<![\w.]){re.escape(child.stem)}(?!\w)", doc):
                    unnamed.append(str(child.relative_to(PACKAGE)))
            elif (child / "__init__.py").is_file() and not re.search(
                rf"(?<![\w.]){re.escape(child.name)}(?![\w])", doc
            ):
                unnamed.append(f"{child.relative_to(PACKAGE)}/")
    assert unnamed == []
