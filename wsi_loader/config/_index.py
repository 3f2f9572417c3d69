"""The ``index`` section: how `build_index` lays the tile grid (resolution, tissue,
annotations, quality control), and the CLI's overrides of it."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from wsi_loader.config._base import ContextScales, Magnification, PathText, Strict
from wsi_loader.config._validate import OptionValueError, close_key, validate

QC_RULES = ("pen", "blur", "fold", "bubble")  # index/_qc.py's RULES, by name


_DEFAULT_MIN_COVERAGE = 0.5


class IndexConfig(Strict):
    """How `build_index` lays the tile grid; ``configs/index.yaml`` documents the defaults."""

    tile_size: int = Field(256, gt=0, le=16384, description="tile edge in output pixels")
    mpp: float | None = Field(0.5, gt=0, le=1000, description="target microns per pixel")
    level: int | None = Field(None, ge=0, description="read this pyramid level instead of an MPP")
    mag: Magnification = Field(
        None,
        gt=0,
        le=200,
        description="target magnification instead of an MPP (20, 20x or 20X: the slide's objective "
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
        _DEFAULT_MIN_COVERAGE,
        gt=0,
        le=1,
        description="share of a tile a class must cover to label it (or roi)",
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
                # what labels or keeps tiles by annotated classes: ignored without them
                ("min_coverage", self.min_coverage != _DEFAULT_MIN_COVERAGE),
                ("class_priority", bool(self.class_priority)),
            )
            if used
        ]
        if wanted and self.annotations is None:
            raise ValueError(f"{', '.join(wanted)} needs annotations (--annotations PATH)")
        both = sorted(set(self.roi) & set(self.exclude))
        if both:
            raise ValueError(f"classes {both} are both a region of interest and excluded")
        if self.max_excluded and not self.exclude:
            raise ValueError("max_excluded applies to exclude (--exclude C[,C])")
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
