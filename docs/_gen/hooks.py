"""MkDocs hooks: the reference pages are generated from the code at every build.

* ``reference/api.md``: one mkdocstrings block per name of ``wsi_loader.__all__``, at the
  module that defines it (the package's torch-based names are lazy, and ``predict`` is a
  function named like a package, so ``wsi_loader.<name>`` is not where the docs live). A
  public name without a docstring is a warning, which ``mkdocs build --strict`` fails on.
* ``reference/cli.md``: every subcommand and option of ``wsi-loader``, from its argparse
  parser (``wsi_loader.cli.main.build_parser``).
* Offline: the notebook pages' template imports mermaid from a CDN when a page has a diagram
  (none has); that script is dropped, and after the build any page, stylesheet or script
  that would fetch an asset over the network is a warning (so an error with ``--strict``).
* ``reference/config.md``: every YAML key of the config models (``wsi_loader.config``) with
  its type, default and meaning (the field's description, else the comment beside the key in
  ``configs/*.yaml``).

Nothing here is hand-copied, so a new option or name appears on the next build.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import logging
import re
import sys
import types
import typing
from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files

LOG = logging.getLogger("mkdocs.plugins.wsi_loader_reference")
REPO = Path(__file__).resolve().parents[2]


def on_files(files: Files, config: Any) -> Files:
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    for uri, text in (
        ("reference/api.md", api_page()),
        ("reference/cli.md", cli_page()),
        ("reference/config.md", config_page()),
    ):
        old = files.get_file_from_path(uri)
        if old is not None:
            files.remove(old)
        files.append(File.generated(config, uri, content=text))
    return files


# ------------------------------------------------------------------------------------ offline

_CDN_SCRIPT = re.compile(
    r"<script[^>]*>(?:(?!</script>).)*?https://cdn(?:(?!</script>).)*</script>", re.S
)
_REMOTE_ASSET = re.compile(
    r"""<(?:script|img|iframe|source|audio|video|embed)\b[^>]*\bsrc=["']?(?:https?:)?//"""
    # a link that loads something (a stylesheet, an icon, a preload); not rel=canonical,
    # which `mkdocs serve` writes and which loads nothing
    r"""|<link\b(?![^>]*\brel=["']?(?:canonical|alternate|prev|next)\b)[^>]*"""
    r"""\bhref=["']?(?:https?:)?//"""
    r"""|@import\s+(?:url\()?["']?(?:https?:)?//"""
    r"""|url\(["']?(?:https?:)?//"""
    r"""|import\(["'](?:https?:)?//"""
)


def on_post_page(output: str, page: Any, config: Any) -> str:
    return _CDN_SCRIPT.sub("", output)


def on_post_build(config: Any) -> None:
    site = Path(config["site_dir"])
    for path in sorted(site.rglob("*")):
        if path.suffix not in (".html", ".css", ".js"):
            continue
        match = _REMOTE_ASSET.search(path.read_text(encoding="utf-8", errors="replace"))
        if match:
            LOG.warning(
                "%s fetches an asset from the network (%s...): the site must work offline",
                path.relative_to(site),
                match.group(0)[:80],
            )


# ---------------------------------------------------------------------------------------- API

_GROUPS = (
    (
        "Building and opening an index",
        ("build_index", "SlideIndex", "SlideRecord", "Quarantine", "qc_filter"),
    ),
    (
        "Reading tiles",
        (
            "TileDataset",
            "make_loader",
            "TileBatch",
            "DeviceLoader",
            "DistributedTileSampler",
            "BalancedTileSampler",
            "SlideBagDataset",
        ),
    ),
    (
        "Features, MIL and predictions",
        ("extract_features", "FeatureBagDataset", "pad_bags", "predict"),
    ),
    ("Viewing", ("serve", "show")),
    ("Single slides", ("open_slide", "SlideMeta", "HandlePool")),
    ("Configuration", ("load_config", "Config", "IndexConfig", "DatasetConfig")),
)


def _public() -> dict[str, object]:
    import wsi_loader

    return {name: getattr(wsi_loader, name) for name in wsi_loader.__all__}


def _where(name: str, obj: object) -> str:
    """The dotted path of the module that defines ``obj`` (for mkdocstrings)."""
    module = getattr(obj, "__module__", None)
    qualname = getattr(obj, "__qualname__", name)
    if not module:
        raise RuntimeError(f"wsi_loader.{name} has no __module__")
    return f"{module}.{qualname}"


def api_page() -> str:
    names = _public()
    lines = [
        "# API reference",
        "",
        "Generated from the docstrings of every public name (`wsi_loader.__all__`) at each "
        "build. `import wsi_loader as wl`; every name below is `wl.<name>`. The torch-based "
        "names are imported on first use, so `import wsi_loader` stays torch-free.",
        "",
    ]
    placed: set[str] = set()
    errors = sorted(n for n in names if issubclass_safe(names[n], BaseException))
    groups = [*_GROUPS, ("Errors", tuple(errors))]
    rest = sorted(set(names) - {n for _, g in groups for n in g})
    if rest:
        groups.append(("Other names", tuple(rest)))
    for title, group in groups:
        lines += [f"## {title}", ""]
        for name in group:
            if name not in names or name in placed:
                continue
            placed.add(name)
            obj = names[name]
            if not (inspect.getdoc(obj) or "").strip() or _inherited_doc(obj):
                LOG.warning("wsi_loader.%s has no docstring of its own", name)
            where = _where(name, obj)
            if not where.endswith(f".{name}"):  # an alias: say which name the docs show
                lines += [f"`wl.{name}` is `{where.rsplit('.', 1)[1]}`:", ""]
            lines += [f"::: {where}", ""]
    return "\n".join(lines)


def issubclass_safe(obj: object, base: type) -> bool:
    return isinstance(obj, type) and issubclass(obj, base)


def _inherited_doc(obj: object) -> bool:
    """A class without a docstring of its own: ``inspect.getdoc`` falls back to its base's,
    and ``@dataclass`` writes its signature as ``__doc__``."""
    if not isinstance(obj, type):
        return False
    own = (obj.__dict__.get("__doc__") or "").strip()
    return not own or (dataclasses.is_dataclass(obj) and own.startswith(f"{obj.__name__}("))


# ---------------------------------------------------------------------------------------- CLI


def _md(text: str | None) -> str:
    text = (text or "").replace("%(default)s", "the default").replace("%%", "%")
    text = text.replace("|", "\\|").replace("<", "&lt;").replace(">", "&gt;")
    return " ".join(text.split())


def _option_row(action: argparse.Action) -> str:
    if action.option_strings:
        names = ", ".join(f"`{o}`" for o in action.option_strings)
        if action.nargs != 0:
            metavar = action.metavar or (
                "{" + ",".join(map(str, action.choices)) + "}"
                if action.choices
                else action.dest.upper()
            )
            names += f" `{metavar if isinstance(metavar, str) else ' '.join(metavar)}`"
    else:
        names = f"`{action.metavar or action.dest}`"
        if action.nargs in ("+", "*"):
            names += " ..."
    details = []
    if action.choices and action.nargs != 0:
        details.append("one of " + ", ".join(f"`{c}`" for c in action.choices))
    if action.required and action.option_strings:
        details.append("required")
    default = action.default
    if (
        action.option_strings
        and default not in (None, False, argparse.SUPPRESS)
        and action.nargs != 0
    ):
        details.append(f"default `{default}`")
    help_text = _md(action.help if action.help != argparse.SUPPRESS else "")
    if details:
        help_text = f"{help_text} ({'; '.join(details)})" if help_text else "; ".join(details)
    return f"| {names} | {help_text} |"


def _actions(parser: argparse.ArgumentParser) -> list[tuple[str, list[argparse.Action]]]:
    groups = []
    for group in parser._action_groups:
        actions = [
            a
            for a in group._group_actions
            if a.help != argparse.SUPPRESS and not isinstance(a, argparse._SubParsersAction)
        ]
        if actions:
            groups.append((group.title or "", actions))
    return groups


def cli_page() -> str:
    from wsi_loader.cli.main import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    helps = {c.dest: c.help for c in sub._choices_actions}
    lines = [
        "# CLI reference",
        "",
        "Generated from the `wsi-loader` argument parser at each build: every subcommand and "
        "option. Exit codes: 0 success, 1 the work ran but produced nothing usable, 2 a usage "
        "or input error (bad option, config, manifest or index folder), 130 interrupted.",
        "",
        "```text",
        parser.format_usage().strip(),
        "```",
        "",
        "| command | what it does |",
        "|---|---|",
    ]
    for name in sub.choices:
        lines.append(f"| [`{name}`](#{name}) | {_md(helps.get(name))} |")
    lines.append("")
    for _title, actions in _actions(parser):
        lines += ["| option | meaning |", "|---|---|", *map(_option_row, actions), ""]
    for name, command in sub.choices.items():
        usage = command.format_usage().strip().removeprefix("usage: ")
        lines += [f"## `wsi-loader {name}` {{ #{name} }}", ""]
        if command.description or helps.get(name):
            lines += [_md(command.description or helps.get(name)), ""]
        lines += ["```text", usage, "```", ""]
        for title, actions in _actions(command):
            lines += [f"**{title}**", "", "| option | meaning |", "|---|---|"]
            lines += [*map(_option_row, actions), ""]
        if command.epilog:
            lines += [_md(command.epilog), ""]
    return "\n".join(lines)


# ------------------------------------------------------------------------------------- config


def _yaml_comments() -> dict[tuple[str, str], str]:
    """``(section, key) -> comment`` from the documented config files."""
    comments: dict[tuple[str, str], str] = {}
    for path in sorted((REPO / "configs").glob("*.yaml")):
        section = ""
        for line in path.read_text(encoding="utf-8").splitlines():
            top = re.match(r"^(\w+):", line)
            if top:
                section = top.group(1)
                continue
            key = re.match(r"^\s{2}(\w+):[^#]*#\s*(.+)$", line)
            if key and section and (section, key.group(1)) not in comments:
                comments[(section, key.group(1))] = key.group(2).strip()
    return comments


def _type_name(annotation: Any) -> str:
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin is typing.Literal:
        return " \\| ".join(repr(a) if a is not None else "null" for a in args)
    if origin in (typing.Union, types.UnionType):
        return " \\| ".join(_type_name(a) for a in args)
    if origin is typing.Annotated:
        return _type_name(args[0])
    if annotation is type(None):
        return "null"
    if origin is not None:
        inner = ", ".join(_type_name(a) for a in args)
        return f"{getattr(origin, '__name__', str(origin))}[{inner}]"
    return getattr(annotation, "__name__", str(annotation).replace("typing.", ""))


def _default(field: Any) -> str:
    from pydantic_core import PydanticUndefined

    if field.default_factory is not None:
        value = field.default_factory()
    elif field.default is PydanticUndefined:
        return "required"
    else:
        value = field.default
    if hasattr(value, "model_dump"):
        return "(the section's defaults)"
    if value is None:
        return "`null`"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    return f"`{value!r}`" if isinstance(value, str) else f"`{value}`"


def _bounds(field: Any) -> str:
    parts = []
    for meta in field.metadata:
        for attr, sign in (("gt", ">"), ("ge", ">="), ("lt", "<"), ("le", "<=")):
            value = getattr(meta, attr, None)
            if value is not None:
                parts.append(f"{sign} {value}")
    return f" ({', '.join(parts)})" if parts else ""


def _model_table(
    model: Any, section: str, comments: dict[tuple[str, str], str], prefix: str
) -> list[str]:
    lines = ["| key | type | default | meaning |", "|---|---|---|---|"]
    nested = []
    for name, field in model.model_fields.items():
        annotation = field.annotation
        sub = _submodel(annotation)
        meaning = field.description or comments.get((section, name), "")
        if not meaning and sub is not None:  # a nested section: its class says what it is
            meaning = (inspect.getdoc(sub) or "").split("\n\n")[0]
        if sub is not None:
            nested.append((name, sub))
        lines.append(
            f"| `{prefix}{name}` | {_type_name(annotation)}{_bounds(field)} | {_default(field)} "
            f"| {_md(meaning)} |"
        )
    lines.append("")
    for name, sub in nested:
        lines += [f"`{prefix}{name}`: {_md(inspect.getdoc(sub))}", ""]
        lines += _model_table(sub, section, comments, f"{prefix}{name}.")
    return lines


def _submodel(annotation: Any) -> Any:
    from pydantic import BaseModel

    candidates = [annotation, *typing.get_args(annotation)]
    for c in candidates:
        for inner in [c, *typing.get_args(c)]:
            if isinstance(inner, type) and issubclass(inner, BaseModel):
                return inner
    return None


def config_page() -> str:
    from wsi_loader.config import Config

    comments = _yaml_comments()
    lines = [
        "# Configuration reference",
        "",
        "Generated from the config models (`wsi_loader/config/`) at each build: every key of "
        "a YAML config file, with its type, default and meaning. Every key is optional; an "
        "unknown key or a wrong type is a `ConfigError` naming the key, the value and the "
        "file (a misspelt key names the close one). `wsi-loader index|export|features|predict|"
        "mosaic --config FILE` read a file, and command-line flags override it; "
        "`wsi_loader.load_config(FILE)` gives the same typed object in Python. "
        "`configs/index.yaml` and `configs/stain.yaml` are commented examples.",
        "",
    ]
    for section, field in Config.model_fields.items():
        model = field.annotation
        lines += [f"## `{section}`", "", _md(inspect.getdoc(model)), ""]
        lines += _model_table(model, section, comments, "")
    return "\n".join(lines)
