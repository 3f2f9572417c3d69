"""The sections of the commands that read tiles: the dataset (``dataset``, also
`TileDataset`'s keyword arguments), `make_loader`, `SlideBagDataset` and ``export``."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, PlainValidator

from wsi_loader.config._base import ContextScales, PathText, Strict


def _workers(value: object) -> int | str:
    """``num_workers``: a count of worker processes, or "auto" (None reads as "auto"). One
    validator, so that a bad value is reported against the option, not a branch of a union."""
    if value is None or value == "auto":
        return "auto"
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError("must be a number of worker processes (0 or more) or 'auto'")
    return value


Workers = Annotated[int | Literal["auto"] | None, PlainValidator(_workers)]


class DatasetConfig(Strict):
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
    remote_timeout_s: float = Field(
        30,
        gt=0,
        allow_inf_nan=False,
        description="remote slides: the longest one request may take; a store that does not "
        "answer by then fails the read as a transient error",
    )
    exclude_quarantined: bool = Field(False, description="leave out the quarantined tiles")
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
    backend: Literal["auto", "openslide", "tiff"] | None = Field(
        None, description="the slides' reader; null: auto (the fastest correct one per slide)"
    )
    record_failures: bool = Field(True, description="append failures to the quarantine")
    quarantine: PathText | None = Field(
        None,
        min_length=1,
        description="file failed reads are appended to and excluded from (default: the "
        "index's quarantine.jsonl; for an index on a read-only mount)",
    )


class LoaderConfig(Strict):
    """Options of `make_loader` (besides the dataset's)."""

    batch_size: int = Field(64, ge=1)
    shuffle: bool | None = None
    seed: int | None = None
    drop_last: bool = False
    num_workers: Workers = Field(
        "auto",
        description="worker processes; auto (or null): threads of this process or workers, "
        "chosen from the usable cores and what the reads need",
    )
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


class BagConfig(Strict):
    """Options of `SlideBagDataset` (besides the dataset's)."""

    k: int | None = Field(16, ge=1)
    chunk_size: int = Field(256, ge=1)
    seed: int = 0


class ExportConfig(Strict):
    """Options of `wsi-loader export` readable from the same YAML file."""

    format: Literal["imagefolder", "webdataset", "coords-h5"] = "imagefolder"
    image_format: Literal["png", "jpeg", "webp"] = "png"
    quality: int = Field(90, ge=1, le=100)
    shard_size: int = Field(1000, ge=1)
    workers: int = Field(1, ge=1, le=512, description="units of work written in parallel")
    unit_timeout: float = Field(
        0, ge=0, description="seconds a unit of work may take before it is given up (0: no limit)"
    )
    verify: bool = Field(False, description="resume only units whose files hash as recorded")
    shuffle: bool = Field(False, description="mix tiles of many slides in every shard")
    seed: int = Field(0, description="seed of the --shuffle permutation")
