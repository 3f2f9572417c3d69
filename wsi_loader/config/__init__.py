"""Typed, validated configuration (YAML files and keyword arguments).

pydantic does the validation (strict types, unknown keys rejected) so every error can name the
key, the value and the file; `ConfigError` carries those as fields. YAML is read with
``yaml.safe_load`` only.

A foundation: it imports only `wsi_loader.errors` and `wsi_loader.files`, so every step may
import it. One module per section (``_index``, ``_reading``, ``_stain``) on a shared base
(``_base``); ``_validate`` turns pydantic's errors into `ConfigError`; ``_load`` reads a file.
"""

from wsi_loader.config._base import magnification
from wsi_loader.config._index import QC_RULES, IndexConfig, with_overrides
from wsi_loader.config._load import Config, load_config
from wsi_loader.config._reading import BagConfig, DatasetConfig, ExportConfig, LoaderConfig
from wsi_loader.config._stain import StainConfig, StainJitterConfig
from wsi_loader.config._validate import check_keywords, close_key, validate

__all__ = [
    "QC_RULES",
    "BagConfig",
    "Config",
    "DatasetConfig",
    "ExportConfig",
    "IndexConfig",
    "LoaderConfig",
    "StainConfig",
    "StainJitterConfig",
    "check_keywords",
    "close_key",
    "load_config",
    "magnification",
    "validate",
    "with_overrides",
]
