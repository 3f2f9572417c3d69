"""The documentation site (docs/, README.md): every code block runs or is checked, every CLI
example parses, the generated references cover the code, and the front door stays short.

Python blocks run page by page, in order, in one namespace per page, on synthetic slides laid
out as the pages assume (``/data/slides`` with three labelled cases, an index in ``idx/``). A
Python block right after a ``<!-- not run: REASON -->`` comment is only compiled (a Ray Train
job, say: slow, and a cluster's business). YAML blocks load as config files; shell lines that
call ``wsi-loader`` are parsed by its argument parser; ``make`` targets, ``pip`` extras and
benchmark scripts must exist. The site itself is built by ``make docs`` (``mkdocs build
--strict``, run by ``make test``)."""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import re
import shlex
import shutil
from pathlib import Path
from types import ModuleType

import pytest
import torch

from tests.conftest import REPO, SlideFactory

DOCS = REPO / "docs"
PAGES = sorted(
    p for p in DOCS.rglob("*.md") if "_gen" not in p.relative_to(DOCS).parts
)  # as mkdocs.yml
BLOCK = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```", re.DOTALL | re.MULTILINE)


def _name(page: Path) -> str:
    return str(page.relative_to(REPO))


# a block after this comment is compiled but not run; the reason is required and shown
NOT_RUN = re.compile(r"<!-- not run: (\S[^>]*?) -->\s*\Z")


def _blocks(page: Path, languages: tuple[str, ...]) -> list[tuple[str, bool]]:
    """(body, run) for each block of one of ``languages``: ``run`` is False for a block
    that follows a ``<!-- not run: REASON -->`` comment (only blank lines between)."""
    text = page.read_text(encoding="utf-8")
    return [
        (m.group(2), NOT_RUN.search(text[: m.start()]) is None)
        for m in BLOCK.finditer(text)
        if m.group(1) in languages
    ]


def blocks(page: Path, *languages: str) -> list[str]:
    return [body for body, _ in _blocks(page, languages)]


def test_a_block_marked_not_run_is_compiled_but_not_run(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(
        "```python\nrun = 1\n```\n\n<!-- not run: a Ray Train job -->\n\n"
        "```python\nraise SystemExit('not run')\n```\n\n"
        "<!-- not run: -->\n```python\nempty_reason = 1\n```\n"
        "<!-- not run: further up -->\n\ntext between\n\n```python\nrun_too = 1\n```\n",
        encoding="utf-8",
    )
    assert [run for _, run in _blocks(page, ("python",))] == [True, False, True, True]
    assert len(blocks(page, "python")) == 4  # every block is still seen (and compiled)


def _hooks() -> ModuleType:
    spec = importlib.util.spec_from_file_location("docs_hooks", DOCS / "_gen" / "hooks.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_site_has_its_pages() -> None:
    names = {_name(p) for p in PAGES}
    for page in (
        "docs/index.md",
        "docs/getting-started.md",
        "docs/troubleshooting.md",
        "docs/benchmarks.md",
        "docs/changelog.md",
        "docs/concepts/index-on-disk.md",
        "docs/concepts/failures.md",
        "docs/concepts/resolutions.md",
        "docs/concepts/pixels.md",
    ):
        assert page in names
    assert len([n for n in names if n.startswith("docs/journeys/")]) >= 13
    # the notebooks are tutorial pages (links to the committed, executed notebooks)
    for notebook in sorted((REPO / "notebooks").glob("*.ipynb")):
        page = DOCS / "tutorials" / notebook.name
        assert page.resolve() == notebook.resolve(), page


def test_the_readme_is_a_front_door() -> None:
    lines = (REPO / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= 200
    # every link into the docs points at a page that exists
    for target in re.findall(r"\]\((docs/[^)#]+)", "\n".join(lines)):
        assert (REPO / target).exists(), target


# ------------------------------------------------------------------------------ python blocks


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory, make_slide: SlideFactory) -> Path:
    """Three labelled synthetic slides and their index, as the pages assume them."""
    import wsi_loader as wl

    base = tmp_path_factory.mktemp("docs")
    slides = base / "slides"
    slides.mkdir()
    for i, seed in enumerate((51, 52, 53)):
        shutil.copy(make_slide(width=1800, height=1400, seed=seed), slides / f"case-00{i + 1}.svs")
    (base / "labels.csv").write_text(
        "slide,label,split\ncase-001,tumour,train\ncase-002,normal,train\ncase-003,tumour,val\n"
    )
    wl.build_index(
        [str(slides)], str(base / "idx"), tile_size=224, mpp=0.5, labels=str(base / "labels.csv")
    )
    return base


PYTHON_PAGES = [p for p in [REPO / "README.md", *PAGES] if blocks(p, "python")]


@pytest.mark.parametrize("page", PYTHON_PAGES, ids=_name)
def test_python_blocks_run(
    page: Path, built: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import wsi_loader as wl

    slides = built / "slides"
    shutil.copytree(built / "idx", tmp_path / "idx")
    shutil.copy(built / "labels.csv", tmp_path / "labels.csv")
    monkeypatch.chdir(tmp_path)
    model = torch.nn.Sequential(
        torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(3, 2)
    )
    namespace: dict[str, object] = {"model": model, "index": wl.SlideIndex.open("idx/")}
    for block, run in _blocks(page, ("python",)):
        code = block.replace('"/data/slides"', repr(str(slides)))
        compiled = compile(code, _name(page), "exec")
        if run:
            exec(compiled, namespace)
    if "loss" in namespace:  # a training loop ran to the end with a finite loss
        loss = namespace["loss"]
        assert isinstance(loss, torch.Tensor) and torch.isfinite(loss)


def test_pages_with_python_are_run() -> None:
    # the pages whose examples users copy first: they must keep runnable examples
    names = {_name(p) for p in PYTHON_PAGES}
    for page in (
        "README.md",
        "docs/getting-started.md",
        "docs/journeys/training.md",
        "docs/journeys/stain.md",
        "docs/journeys/viewer.md",
    ):
        assert page in names


@pytest.mark.parametrize("page", [p for p in PAGES if blocks(p, "yaml")], ids=_name)
def test_yaml_blocks_are_valid_configs(page: Path, tmp_path: Path) -> None:
    from wsi_loader import load_config

    for i, block in enumerate(blocks(page, "yaml")):
        path = tmp_path / f"block{i}.yaml"
        path.write_text(block)
        load_config(path)  # raises ConfigError naming the key


# ------------------------------------------------------------------------------- CLI examples


def _parser() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    from wsi_loader.cli.main import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return parser, dict(sub.choices)


def _shell_lines(page: Path) -> list[str]:
    lines = []
    for block in blocks(page, "sh", "bash", "shell"):
        for raw in block.replace("\\\n", " ").splitlines():
            line = re.sub(r"(^|\s)#.*$", "", raw).strip()
            if line:
                lines.append(line)
    return lines


SHELL_PAGES = [p for p in [REPO / "README.md", *PAGES] if _shell_lines(p)]


@pytest.mark.parametrize("page", SHELL_PAGES, ids=_name)
def test_shell_examples_are_real(page: Path, capsys: pytest.CaptureFixture[str]) -> None:
    parser, _ = _parser()
    makefile = (REPO / "Makefile").read_text()
    pyproject = (REPO / "pyproject.toml").read_text()
    for line in _shell_lines(page):
        words = shlex.split(line)
        if words[0] == "wsi-loader":
            if words[1:] == ["--version"]:
                continue
            try:
                args = parser.parse_args(words[1:])
            except SystemExit:
                pytest.fail(f"{_name(page)}: {line!r} does not parse: {capsys.readouterr().err}")
            assert callable(args.run)
        elif words[0] == "make":
            for target in words[1:]:
                assert re.search(rf"^{re.escape(target)}:", makefile, re.M), line
        elif words[:2] == ["pip", "install"]:
            for extra in re.findall(r"wsi_loader\[(\w+)\]", line):
                assert re.search(rf"^{extra} = \[", pyproject, re.M), line
        else:
            for script in re.findall(r"\b(benchmarks/[\w./-]+\.(?:py|sh))", line):
                assert (REPO / script).exists(), line


def test_inline_commands_name_real_options() -> None:
    """`wsi-loader SUB ... --flag` in running text: SUB is a subcommand and every flag is one
    of its options (synopses with [brackets] and placeholders included)."""
    parser, commands = _parser()
    top = {o for a in parser._actions for o in a.option_strings}
    checked = 0
    for page in [REPO / "README.md", *PAGES]:
        text = page.read_text(encoding="utf-8")
        for sub, rest in re.findall(r"`wsi-loader ([a-z]+(?:-[a-z]+)*)\b([^`]*)`", text):
            assert sub in commands, f"{_name(page)}: no subcommand {sub!r}"
            known = {o for a in commands[sub]._actions for o in a.option_strings} | top
            for flag in re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", rest):
                assert flag in known, f"{_name(page)}: `wsi-loader {sub}` has no {flag}"
            checked += 1
    assert checked >= 30


# ------------------------------------------------------------------------ generated references


def test_the_cli_reference_names_every_subcommand_and_option() -> None:
    page = _hooks().cli_page()
    _, commands = _parser()
    for name, command in commands.items():
        assert f"## `wsi-loader {name}`" in page
        for action in command._actions:
            for option in action.option_strings:
                assert f"`{option}`" in page, (name, option)


def test_the_api_reference_covers_every_public_name() -> None:
    import wsi_loader

    page = _hooks().api_page()
    for name in wsi_loader.__all__:
        documented = re.search(rf"^::: wsi_loader\.[\w.]*\.{name}$", page, re.M)
        assert documented or f"`wl.{name}` is `" in page, name


def test_every_public_name_has_a_docstring_of_its_own() -> None:
    import wsi_loader

    hooks = _hooks()
    missing = [
        name
        for name in wsi_loader.__all__
        if not (inspect.getdoc(getattr(wsi_loader, name)) or "").strip()
        or hooks._inherited_doc(getattr(wsi_loader, name))
    ]
    assert not missing


def test_predict_is_documented_as_the_function() -> None:
    page = _hooks().api_page()
    assert "::: wsi_loader.predict._run.predict\n" in page


def test_the_config_reference_has_every_key() -> None:
    from wsi_loader.config import Config

    page = _hooks().config_page()
    for section, field in Config.model_fields.items():
        assert f"## `{section}`" in page
        model = field.annotation
        assert model is not None
        for key in model.model_fields:  # type: ignore[attr-defined]
            row = re.search(
                rf"^\| `{key}` \| ([^|]+(?:\\\|[^|]+)*) \| ([^|]+) \| (.*) \|$", page, re.M
            )
            assert row, (section, key)
            assert row.group(3).strip(), f"{section}.{key} has no meaning"
    # nested keys (stain.augment.hed_jitter.sigma...) too: every row says what its key means
    for row in re.findall(r"^\| `[\w.]+` \|.*\|$", page, re.M):
        assert not row.rstrip().endswith("|  |"), row


# ------------------------------------------------------------------------- the batch table


def _batch_table() -> list[tuple[set[str], set[str]]]:
    """The GPU page's table of TileBatch attributes and DeviceLoader keys: the names in
    backticks of its first two columns, per row."""
    text = (DOCS / "journeys" / "gpu.md").read_text(encoding="utf-8")
    start = text.index("| `TileBatch` attribute | `DeviceLoader` key |")
    rows = []
    for line in text[start:].splitlines()[2:]:
        if not line.startswith("|"):
            break
        first, second = line.split("|")[1:3]
        rows.append((set(re.findall(r"`(\w+)`", first)), set(re.findall(r"`(\w+)`", second))))
    return rows


def test_the_gpu_page_names_every_batch_attribute_and_device_key(index) -> None:  # type: ignore[no-untyped-def]
    from dataclasses import fields

    from wsi_loader import DeviceLoader, TileBatch, TileDataset, make_loader

    table = _batch_table()
    attributes = set().union(*(first for first, _ in table))
    keys = set().union(*(second for _, second in table))
    data = {f.name for f in fields(TileBatch) if f.name in TileBatch._BY_VALUE}
    assert attributes == data | {"images", "context"}  # every per-tile field, nothing else
    loader = make_loader(index, batch_size=4, num_workers=0)
    batch = next(iter(DeviceLoader(loader, "cpu")))
    sample = TileDataset(index)[0]
    # an index without annotations, read without context tiles
    assert (
        set(batch)
        == set(sample)
        == keys - {"coverage", "context", "context_inside", "context_mask"}
    )
    assert set(next(iter(loader)).as_dict()) == set(batch)


def test_files_the_pages_name_exist() -> None:
    """Modules, tests, benchmarks and configs named in the text (they move: a page must
    follow), and a test named with ``::`` is in its file."""
    named = 0
    for page in [REPO / "README.md", *PAGES]:
        text = page.read_text(encoding="utf-8")
        pattern = (
            r"`((?:wsi_loader|tests|benchmarks|notebooks|configs)/[\w/.-]+?"
            r"\.(?:py|sh|yaml|ipynb))(?:::(\w+))?`"
        )
        for path, test in re.findall(pattern, text):
            assert (REPO / path).exists(), f"{_name(page)} names {path}"
            if test:
                assert f"def {test}(" in (REPO / path).read_text(), f"{_name(page)}: {test}"
            named += 1
        packages = "index|dataset|slides|stain|device|models|features|predict|export|view"
        short = rf"`((?:{packages})/[\w/]+\.py)`"
        for path in re.findall(short, text):
            assert (REPO / "wsi_loader" / path).exists(), f"{_name(page)} names {path}"
            named += 1
    assert named >= 20


# ---------------------------------------------------------------------------------- offline


@pytest.mark.parametrize(
    ("html", "remote"),
    [
        ('<script src="https://cdn.example/x.js"></script>', True),
        ('<link rel="stylesheet" href="//fonts.example/css">', True),
        ("<style>@import url('https://fonts.example/a.css');</style>", True),
        ('const m = await import("https://cdnjs.example/mermaid.mjs");', True),
        ('<img src="https://example.org/a.png">', True),
        ('<link rel="canonical" href="http://127.0.0.1:8000/">', False),
        ('<a href="https://github.com/">a link</a>', False),
        ('<script src="../assets/javascripts/bundle.js"></script>', False),
        ('<link rel="stylesheet" href="assets/stylesheets/main.css">', False),
    ],
)
def test_the_build_finds_assets_fetched_from_the_network(html: str, remote: bool) -> None:
    assert bool(_hooks()._REMOTE_ASSET.search(html)) is remote


# ------------------------------------------------------------------------------ troubleshooting


def _source() -> str:
    """The package's source with string literals split over lines joined again."""
    text = "\n".join(p.read_text(encoding="utf-8") for p in (REPO / "wsi_loader").rglob("*.py"))
    return re.sub(r"\"\s*\n\s*f?\"", "", text)


def test_troubleshooting_quotes_real_messages() -> None:
    source = _source()
    headings = re.findall(r"^### `(.+)`$", (DOCS / "troubleshooting.md").read_text(), re.M)
    assert len(headings) >= 20
    for message in headings:
        assert message in source, f"troubleshooting: {message!r} is no longer in wsi_loader/"
