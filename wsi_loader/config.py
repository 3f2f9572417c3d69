"""Typed, validated configuration (YAML files and keyword arguments).

pydantic does the validation (strict types, unknown keys rejected) so every error can name the
key, the value and the file; `ConfigError` carries those as fields. YAML is read with
``yaml.safe_load`` only.
"""

from __future__ import annotations

import difflib
import reprlib
import types
import typing
from collections.abc import Iterable
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    model_validator,
)

from wsi_loader.errors import ConfigError
from wsi_loader.files import expand_home

__all__ = [
    "BagConfig",
    "Config",
    "DatasetConfig",
    "ExportConfig",
    "IndexConfig",
    "LoaderConfig",
    "StainConfig",
    "check_keywords",
    "load_config",
    "validate",
]


QC_RULES = ("pen", "blur", "fold", "bubble")  # index/qc.py's RULES, by name


class OptionValueError(ValueError):
    """What a validator of a section raises about one of its keys (``key``, dotted, relative
    to the section; its ``value``, said as invalid when ``invalid``): the error then names
    that key, not the whole section, and says the problem in words."""

    def __init__(self, message: str, *, key: str, value: Any = None, invalid: bool = False) -> None:
        super().__init__(message)
        self.key = key
        self.value = value
        self.invalid = invalid


PathText = Annotated[str, AfterValidator(expand_home)]  # a local path or a URL

MAX_CONTEXT_SCALES = 8  # context tiles per item (each is a buffer per batch)


def context_scales(value: Any) -> Any:
    """Context scales as ``[(mpp, size), ...]`` from what users write: pairs (tuples or YAML
    lists), ``{"mpp": M, "size": S}`` mappings, or ``"MPP:SIZE"`` strings (``--context``,
    comma-separated). Anything else is left for the type check to refuse with its message."""
    if isinstance(value, str):
        value = [part for part in value.split(",") if part.strip()]
    if not isinstance(value, (list, tuple)):
        return value
    scales: list[Any] = []
    for item in value:
        scale = item
        if isinstance(item, str) and item.count(":") == 1:
            mpp, size = (part.strip() for part in item.split(":"))
            try:
                scale = (float(mpp), int(size))
            except ValueError as exc:
                raise ValueError(f"context scale {item!r} is not MPP:SIZE ({exc})") from None
        elif isinstance(item, dict) and set(item) == {"mpp", "size"}:
            scale = (item["mpp"], item["size"])
        elif isinstance(item, list):
            scale = tuple(item)
        scales.append(scale)
    return scales


def _check_context(scales: list[tuple[float, int]] | None) -> list[tuple[float, int]] | None:
    if scales is None:
        return None
    if len(scales) > MAX_CONTEXT_SCALES:
        raise ValueError(f"at most {MAX_CONTEXT_SCALES} context scales, got {len(scales)}")
    for mpp, size in scales:
        if not 0 < mpp <= 1000:
            raise ValueError(f"context MPP {mpp} is not in (0, 1000] um/px")
        if not 1 <= size <= 16384:
            raise ValueError(f"context tile size {size} is not in 1..16384 px")
    if len(set(scales)) != len(scales):
        raise ValueError(f"context scales repeat: {scales}")
    return list(scales)


# co-centred context tiles: [(mpp, size), ...] (see context_scales for the spellings)
ContextScales = Annotated[
    list[tuple[float, int]] | None,
    BeforeValidator(context_scales),
    AfterValidator(_check_context),
]


class _Strict(BaseModel):
    # allow_inf_nan: `--mpp inf` or `.nan` in YAML is an error, not Infinity in meta.json
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True, allow_inf_nan=False)


class IndexConfig(_Strict):
    """How `build_index` lays the tile grid; ``configs/index.yaml`` documents the defaults."""

    tile_size: int = Field(256, gt=0, le=16384, description="tile edge in output pixels")
    mpp: float | None = Field(0.5, gt=0, le=1000, description="target microns per pixel")
    level: int | None = Field(None, ge=0, description="read this pyramid level instead of an MPP")
    mag: float | None = Field(
        None,
        gt=0,
        le=200,
        description="target magnification instead of an MPP (20 = 20x: the slide's objective "
        "power, else mpp = 10 / mag)",
    )
    mpp_tolerance: float = Field(0.1, ge=0, lt=1, description="relative MPP mismatch accepted")
    stride: int | None = Field(None, gt=0, description="grid step in output pixels (tile_size)")
    min_tissue: float = Field(0.5, ge=0, le=1, description="minimum tissue fraction of a tile")
    align_to_storage: bool = Field(True, description="start the grid on storage-tile corners")
    mask_max_size: int = Field(2048, ge=64, le=16384, description="longest side of tissue mask")
    backend: Literal["auto", "openslide", "tiff"] = "auto"
    workers: int = Field(1, ge=1, le=512)
    slide_timeout: float = Field(
        0, ge=0, description="seconds a slide may take before it is given up (0: no limit)"
    )
    root: PathText | None = Field(None, description="store slide paths relative to this folder")
    labels: PathText | None = Field(None, description="CSV of labels joined by path or slide name")
    strict_labels: bool = Field(
        False, description="labels rows matching no slide, or unlabelled slides, are errors"
    )
    exclude_quarantined: bool = Field(True, description="drop quarantined tiles when rebuilding")
    allow_shrink: bool = Field(
        False, description="let a rebuild drop more than half of the indexed slides"
    )
    annotations: PathText | None = Field(
        None, description="region annotations: a folder, a file, or a CSV with 'annotations'"
    )
    label_from: Literal["slides", "annotations"] = Field(
        "slides", description="a tile's label: its slide's label, or its annotated class"
    )
    min_coverage: float = Field(
        0.5, gt=0, le=1, description="share of a tile a class must cover to label it (or roi)"
    )
    background_label: str | None = Field(
        None, min_length=1, description="label of tiles no class covers enough (else none)"
    )
    class_priority: list[str] = Field(
        default_factory=list,
        description="which class labels a tile several classes cover (first wins)",
    )
    roi: list[str] = Field(default_factory=list, description="keep only tiles inside these")
    exclude: list[str] = Field(
        default_factory=list, description="drop tiles overlapping these classes"
    )
    max_excluded: float = Field(
        0.0, ge=0, lt=1, description="share of an excluded class a kept tile may overlap"
    )
    context: ContextScales = Field(
        default_factory=list,
        description="context tiles datasets of this index read by default: [(mpp, size), ...]",
    )
    annotation_objects: list[Literal["annotation", "detection", "cell", "tile", "tma_core"]] = (
        Field(
            default_factory=list,
            description="QuPath object types read from GeoJSON (detection takes cells and "
            "tiles too; none named: all)",
        )
    )
    tissue_detector: Literal["auto", "brightfield", "fluorescence"] = Field(
        "auto",
        description="how tissue is found in pixels: per slide from its picture (auto), or this",
    )
    tissue_masks: PathText | None = Field(
        None,
        description="tissue mask images (a folder or file matched by slide name, or a CSV "
        "with path|slide and mask): white is tissue; slides without one use the detector",
    )
    tissue_class: str | None = Field(
        None, min_length=1, description="an annotation class that is the tissue (no detector)"
    )
    qc: Literal["all", "none"] = Field(
        "all", description="quality-control columns (qc_focus, qc_pen...): all, or none"
    )
    qc_exclude: list[Literal["pen", "blur", "fold", "bubble"]] = Field(
        default_factory=list, description="drop tiles these QC rules flag"
    )
    qc_thresholds: dict[str, float] = Field(
        default_factory=dict, description="QC rule thresholds (rule -> value) other than defaults"
    )

    @model_validator(mode="before")
    @classmethod
    def _default_mpp_only_alone(cls, data: Any) -> Any:
        """``mag`` or ``level`` given without ``mpp``: the default MPP does not apply."""
        alone = isinstance(data, dict) and "mpp" not in data
        if alone and (data.get("mag") is not None or data.get("level") is not None):
            return {**data, "mpp": None}
        return data

    @model_validator(mode="after")
    def _mpp_or_level(self) -> IndexConfig:
        given = [k for k in ("mpp", "mag", "level") if getattr(self, k) is not None]
        if len(given) > 1:
            raise ValueError(
                f"give either {' or '.join(given)}, not both (set the others to null)"
                if len(given) == 2
                else "give one of mpp, mag and level (set the others to null)"
            )
        if not given:
            raise ValueError("give mpp (microns per pixel), mag (magnification) or level")
        return self

    @model_validator(mode="after")
    def _annotation_options(self) -> IndexConfig:
        wanted = [
            name
            for name, used in (
                ("label_from: annotations", self.label_from == "annotations"),
                ("roi", bool(self.roi)),
                ("exclude", bool(self.exclude)),
                ("annotation_objects", bool(self.annotation_objects)),
            )
            if used
        ]
        if wanted and self.annotations is None:
            raise ValueError(f"{', '.join(wanted)} needs annotations (--annotations PATH)")
        both = sorted(set(self.roi) & set(self.exclude))
        if both:
            raise ValueError(f"classes {both} are both a region of interest and excluded")
        if self.background_label is not None and self.label_from != "annotations":
            raise ValueError("background_label applies to label_from: annotations")
        if self.tissue_class is not None and self.annotations is None:
            raise ValueError("tissue_class needs annotations (--annotations PATH)")
        return self

    @model_validator(mode="after")
    def _qc_options(self) -> IndexConfig:
        if self.qc == "none":
            for key, does in (
                ("qc_exclude", "drops tiles that quality control flags"),
                ("qc_thresholds", "sets thresholds of quality control"),
            ):
                if getattr(self, key):
                    raise OptionValueError(
                        f"{does}, but quality control is off (qc: none); turn it on "
                        f"(qc: all) or leave {key} out",
                        key=key,
                        value=getattr(self, key),
                    )
        for rule, value in self.qc_thresholds.items():
            key = f"qc_thresholds.{rule}"
            if rule not in QC_RULES:
                raise OptionValueError(
                    f"no QC rule {rule!r}{close_key(rule, QC_RULES)}; "
                    f"the rules are {', '.join(QC_RULES)}",
                    key=key,
                )
            if not 0 <= value <= (10 if rule == "blur" else 1):
                what = (
                    "a focus relative to the slide's typical, between 0 and 10"
                    if rule == "blur"
                    else "a share of the tile, between 0 and 1"
                )
                raise OptionValueError(what, key=key, value=value, invalid=True)
        return self

    @property
    def annotation_params(self) -> dict[str, Any]:
        """The options that decide which tiles of an annotated slide are kept."""
        return {
            "roi": list(self.roi),
            "exclude": list(self.exclude),
            "max_excluded": self.max_excluded,
            "min_coverage": self.min_coverage,
        }

    @property
    def grid_stride(self) -> int:
        return self.stride if self.stride is not None else self.tile_size


class DatasetConfig(_Strict):
    """Options of `TileDataset` (keyword arguments and ``TileDataset.from_config``), readable
    from the same YAML file. Keyword arguments go through this same validation."""

    on_error: Literal["fill", "substitute", "raise"] = "fill"
    context: ContextScales = Field(
        None,
        description="co-centred context tiles beside each tile: [(mpp, size), ...]; None: the "
        "index's default (index --context), [] none",
    )
    retries: int = Field(2, ge=0, le=10)
    fill_value: int = Field(255, ge=0, le=255)
    max_open_slides: int = Field(16, ge=1)
    openslide_cache_mb: int = Field(64, ge=0)
    layout_cache_mb: int = Field(64, ge=0)
    prefetch_mb: int = Field(
        256,
        ge=0,
        description="remote slides: bytes fetched ahead of the reads and kept for later "
        "reads (a second epoch), per process",
    )
    remote_cache_dir: str = Field(
        "~/.cache/wsi_loader/slides",
        min_length=1,
        description="local copies of remote slides only OpenSlide reads (NDPI, SCN...)",
    )
    remote_cache_gb: float = Field(100, gt=0, allow_inf_nan=False)
    exclude_quarantined: bool = False
    decode_threads: int | None = Field(None, ge=1)
    split: str | None = Field(None, min_length=1, description="read only this split's slides")
    missing_slides: Literal["raise", "exclude"] = Field(
        "raise", description="slides that cannot be read at start: raise, or leave them out"
    )
    unlabelled: Literal["keep", "drop", "raise"] = Field(
        "keep",
        description="tiles without a label (unlabelled slide, or no annotated class): keep (-1), "
        "drop, or raise",
    )
    root: PathText | None = Field(None, description="remap the folder relative slide paths live in")
    backend: Literal["auto", "openslide", "tiff"] | None = None
    record_failures: bool = Field(True, description="append failures to the quarantine")
    quarantine: PathText | None = Field(
        None,
        min_length=1,
        description="file failed reads are appended to and excluded from (default: the "
        "index's quarantine.jsonl; for an index on a read-only mount)",
    )


class LoaderConfig(_Strict):
    """Options of `make_loader` (besides the dataset's)."""

    batch_size: int = Field(64, ge=1)
    shuffle: bool | None = None
    seed: int | None = None
    drop_last: bool = False
    num_workers: int | None = Field(None, ge=0)
    pin_memory: bool | None = None
    prefetch_factor: int = Field(4, ge=1)
    prefetch: int = Field(
        2, ge=0, description="batches of look-ahead per reader whose bytes are fetched early"
    )
    persistent_workers: bool = True
    multiprocessing_context: Literal["fork", "spawn", "forkserver"] | None = None
    decode: Literal["cpu", "device"] = "cpu"
    reuse_buffers: bool = True
    timeout: float = Field(0, ge=0, description="seconds without a batch before TimeoutError")


class BagConfig(_Strict):
    """Options of `SlideBagDataset` (besides the dataset's)."""

    k: int | None = Field(16, ge=1)
    chunk_size: int = Field(256, ge=1)
    seed: int = 0


class ExportConfig(_Strict):
    """Options of `wsi-loader export` readable from the same YAML file."""

    format: Literal["imagefolder", "webdataset", "coords-h5"] = "imagefolder"
    image_format: Literal["png", "jpeg", "webp"] = "png"
    quality: int = Field(90, ge=1, le=100)
    shard_size: int = Field(1000, ge=1)
    workers: int = Field(1, ge=1, le=512)
    unit_timeout: float = Field(
        0, ge=0, description="seconds a unit of work may take before it is given up (0: no limit)"
    )
    verify: bool = Field(False, description="resume only units whose files hash as recorded")
    shuffle: bool = Field(False, description="mix tiles of many slides in every shard")
    seed: int = Field(0, description="seed of the --shuffle permutation")


class HEDJitterConfig(_Strict):
    """`wsi_loader.stain.HEDJitter`: per tile and HED channel, h * U(1 +- sigma) + U(+-bias)."""

    sigma: float = Field(0.05, ge=0, lt=1)
    bias: float = Field(0.05, ge=0, lt=1)
    clamp: bool = Field(False, description="cut negative HED values first (scikit-image's trip)")


class StainJitterConfig(_Strict):
    """`wsi_loader.stain.StainJitter`: the slide's stain vectors and concentrations moved."""

    sigma: float = Field(0.05, ge=0, lt=1)
    concentration: float = Field(0.1, ge=0, lt=1)


class RandStainConfig(_Strict):
    """`wsi_loader.stain.RandStain`: a Reinhard target drawn from the archive's spread."""

    spread: float = Field(1.0, ge=0, le=10)


class AugmentStep(_Strict):
    """One augmentation of ``stain.augment``: a mapping with one of these keys (its options,
    or null for the defaults)."""

    hed_jitter: HEDJitterConfig | None = None
    stain_jitter: StainJitterConfig | None = None
    rand_stain: RandStainConfig | None = None

    @model_validator(mode="before")
    @classmethod
    def _defaults_for_null(cls, data: Any) -> Any:
        # `- hed_jitter:` (null) asks for the defaults, as `- hed_jitter: {}` does
        if isinstance(data, dict):
            return {k: ({} if v is None and k in cls.model_fields else v) for k, v in data.items()}
        return data

    @model_validator(mode="after")
    def _one(self) -> AugmentStep:
        given = [k for k in type(self).model_fields if getattr(self, k) is not None]
        if len(given) != 1:
            names = ", ".join(type(self).model_fields)
            raise ValueError(f"each augment step is one of {names} (got {given or 'none'})")
        return self

    @property
    def name(self) -> str:
        return next(k for k in type(self).model_fields if getattr(self, k) is not None)


class StainConfig(_Strict):
    """The ``stain`` section: normalisation, then augmentations in order, of the tiles the
    commands read (export, features, predict, mosaic; their ``--stain``/``--stain-target``
    flags override ``normalize``/``target``) and of ``make_loader(stain=...)`` through
    `wsi_loader.stain.stain_from_config`."""

    normalize: Literal["macenko", "reinhard"] | None = Field(
        None, description="macenko | reinhard (null: no normalisation)"
    )
    target: PathText | None = Field(
        None,
        min_length=1,
        description="an image, a reference JSON, an index folder or a slide (null: the "
        "index's median stain)",
    )
    per_tile: bool = Field(False, description="estimate every tile, not its slide's values")
    augment: list[AugmentStep] = Field(default_factory=list)
    seed: int = Field(0, description="seed of the augmentations (with the epoch and the row)")

    @model_validator(mode="after")
    def _target_needs_normalize(self) -> StainConfig:
        for key, used in (("target", self.target is not None), ("per_tile", self.per_tile)):
            if used and self.normalize is None:
                raise ValueError(f"{key} needs normalize: macenko or normalize: reinhard")
        return self


class Config(_Strict):
    """A whole config file: one section per command."""

    index: IndexConfig = IndexConfig()
    dataset: DatasetConfig = DatasetConfig()
    export: ExportConfig = ExportConfig()
    stain: StainConfig = StainConfig()


# what error messages render of a value: bounded, so a YAML alias bomb (a few hundred bytes
# that expand to gigabytes when printed) cannot exhaust memory through a message
_SHORT = reprlib.Repr()
_SHORT.maxlevel, _SHORT.maxstring, _SHORT.maxother = 3, 80, 80
_SHORT.maxlist = _SHORT.maxdict = _SHORT.maxtuple = _SHORT.maxset = 6


def close_key(key: str, known: Iterable[str], cutoff: float = 0.6) -> str:
    """`` (did you mean 'tile_size'?)`` for a misspelt key (difflib's closest of ``known``
    with a similarity of at least ``cutoff``), or nothing when none is close."""
    close = difflib.get_close_matches(key, list(known), n=1, cutoff=cutoff)
    return f" (did you mean {close[0]!r}?)" if close else ""


def check_keywords(function: str, given: Iterable[str], known: Iterable[str]) -> None:
    """Raise Python's ``TypeError`` for a keyword ``function`` does not take, naming
    ``function`` (not the inner function the keywords are passed on to) and the close key."""
    choices = sorted(known)
    for key in given:
        if key not in choices:
            raise TypeError(
                f"{function}() got an unexpected keyword argument {key!r}" + close_key(key, choices)
            )


def _describe(
    error: ValidationError, source: str | None, model: type[BaseModel] | None = None
) -> ConfigError:
    first = error.errors(include_input=True, include_url=False)[0]
    key = ".".join(str(part) for part in first["loc"]) or None
    value = first.get("input")
    if first["type"] == "extra_forbidden":
        message = f"unknown key {key!r}"
        if model is not None and first["loc"]:
            message += close_key(str(first["loc"][-1]), _keys_at(model, first["loc"][:-1]))
    elif first["type"] == "value_error":  # a validator's own words, without pydantic's
        problem = first.get("ctx", {}).get("error")
        text = str(problem) if problem is not None else first["msg"]
        invalid = not isinstance(value, dict)  # a field's value, not a whole section's
        if isinstance(problem, OptionValueError):
            key = f"{key}.{problem.key}" if key else problem.key
            value, invalid = problem.value, problem.invalid
        if key and invalid:
            message = f"invalid value {_SHORT.repr(value)} for {key!r}: {text}"
        else:  # a rule of a section: its key, never a dump of the section
            message = f"{key!r}: {text}" if key else text
            value = None if isinstance(value, dict) else value
    elif key:
        message = f"invalid value {_SHORT.repr(value)} for {key!r}: {first['msg']}"
    else:
        message = first["msg"]
    more = len(error.errors()) - 1
    if more:
        message += f" (and {more} more problem{'s' if more > 1 else ''})"
    return ConfigError(message, path=source, key=key, value=value)


def _keys_at(model: type[BaseModel], loc: tuple[int | str, ...]) -> list[str]:
    """The keys the section at ``loc`` (a pydantic error location) accepts."""
    current: type[BaseModel] | None = model
    for part in loc:
        if isinstance(part, int):  # an item of a list: the model is the list's item type
            continue
        field = current.model_fields.get(part) if current is not None else None
        if field is None:
            return []
        current = _model_in(field.annotation)
    return list(current.model_fields) if current is not None else []


def _model_in(annotation: Any) -> type[BaseModel] | None:
    """The model inside ``X``, ``X | None`` or ``list[X]``."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    if typing.get_origin(annotation) in (list, typing.Union, types.UnionType):
        for arg in typing.get_args(annotation):
            found = _model_in(arg)
            if found is not None:
                return found
    return None


def validate(model: type[_Strict], data: Any, source: str | None = None, prefix: str = "") -> Any:
    """Validate ``data`` into ``model``; raise `ConfigError` naming key, value and ``source``
    (an unknown key with the known one it is closest to)."""
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        err = _describe(exc, source, model)
        if prefix and err.key:
            err.key = f"{prefix}.{err.key}"
        raise err from None


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


def with_overrides(config: IndexConfig, source: str | None = None, **overrides: Any) -> IndexConfig:
    """A copy of ``config`` with the non-None ``overrides`` applied and validated again.

    Giving one of ``mpp``, ``mag`` and ``level`` clears the other two (when they are not
    given too), so a CLI ``--level`` or ``--mag`` beats a file's ``mpp``.
    """
    updates = {k: v for k, v in overrides.items() if v is not None}
    resolution = ("mpp", "mag", "level")
    if any(k in updates for k in resolution):
        for key in resolution:
            updates.setdefault(key, None)
    result: IndexConfig = validate(IndexConfig, {**config.model_dump(), **updates}, source)
    return result
