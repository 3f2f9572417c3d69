"""A whole config file: its sections (`Config`) and `load_config`, which reads the YAML with
the safe loader only and refuses what YAML accepts without a word but cannot be meant."""

from __future__ import annotations

from pathlib import Path

import yaml

from wsi_loader.config._base import Strict
from wsi_loader.config._index import IndexConfig
from wsi_loader.config._reading import DatasetConfig, ExportConfig
from wsi_loader.config._stain import StainConfig
from wsi_loader.config._validate import validate
from wsi_loader.errors import ConfigError


class Config(Strict):
    """A whole config file: one section per command."""

    index: IndexConfig = IndexConfig()
    dataset: DatasetConfig = DatasetConfig()
    export: ExportConfig = ExportConfig()
    stain: StainConfig = StainConfig()


def load_config(path: str | Path) -> Config:
    """Read a YAML config file. An empty file gives the defaults."""
    source = str(path)
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"cannot read config file: {exc.strerror}", path=source) from exc
    except UnicodeDecodeError as exc:
        raise ConfigError(f"not a YAML text file (not UTF-8: {exc.reason})", path=source) from exc
    loader = yaml.SafeLoader(text)
    try:
        node = loader.get_single_node()
        if node is not None:
            _check_nodes(node, (), source, set())
        data = loader.construct_document(node) if node is not None else None
    except yaml.YAMLError as exc:
        raise ConfigError(f"not valid YAML: {exc}", path=source) from exc
    finally:
        loader.dispose()
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(
            f"the top level must be a mapping of sections, got {type(data).__name__}",
            path=source,
        )
    config: Config = validate(Config, data, source)
    return config


def _check_nodes(node: yaml.Node, keys: tuple[str, ...], source: str, seen: set[int]) -> None:
    """Refuse what YAML accepts without a word but cannot be meant:

    - a key given twice in one mapping: YAML keeps the last value, so a line appended below
      an old one, or a second ``index:`` section (which replaces the whole first one), silently
      changed the run (``<<`` merges may still be overridden);
    - an unquoted ``None``: YAML reads it as the text 'None' (its no-value is ``null``), which
      became, for example, a background class named 'None'.

    Each node is visited once: aliases share nodes, and a nest of them would be exponential.
    """
    if id(node) in seen:
        return
    seen.add(id(node))
    dotted = ".".join(keys)
    if isinstance(node, yaml.ScalarNode):
        if node.style is None and node.value in ("None", "none", "NONE"):
            raise ConfigError(
                f"'{dotted}' is {node.value} (line {node.start_mark.line + 1}), which YAML "
                "reads as the text 'None': write null (or ~) for no value, or quote it if you "
                "mean the text",
                path=source,
                key=dotted,
                value=node.value,
            )
        return
    if isinstance(node, yaml.SequenceNode):
        for item in node.value:
            _check_nodes(item, keys, source, seen)
        return
    if not isinstance(node, yaml.MappingNode):
        return
    first_line: dict[str, int] = {}
    for key_node, value_node in node.value:
        if key_node.tag == "tag:yaml.org,2002:merge" or not isinstance(key_node, yaml.ScalarNode):
            continue
        key, line = str(key_node.value), key_node.start_mark.line + 1
        dotted = ".".join((*keys, key))
        if key in first_line:
            raise ConfigError(
                f"'{dotted}' is given twice (lines {first_line[key]} and {line}); "
                "keep one (YAML would silently use the last)",
                path=source,
                key=dotted,
            )
        first_line[key] = line
        _check_nodes(value_node, (*keys, key), source, seen)
