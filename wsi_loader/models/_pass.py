"""One model pass over every tile of an index, slide by slide; `features` and `predict` are
writers on top of it.

make_loader (decode in workers, batches in shared memory, each slide read in the order that
decodes each storage tile once: `wsi_loader.dataset._scan`) -> DeviceLoader (copy, resize and
normalise on the device) -> the model -> one `SlideOutputs` per slide, handed to a `Writer`
once every row of the slide has passed.

What every writer gets from here:

- **Resumable per slide.** A slide's outputs are known by their content (slide version, its
  tiles, the model's spec, weights and preprocessing, the precision and the writer's own
  settings); a slide whose outputs hold that content is skipped. Writers write under a
  temporary name (`temporary_path`) and rename; files left by killed runs are removed
  (`remove_stale_files`).
- **Failures are data.** Tiles that fail on their data are left out and listed with the reason
  the reader recorded. A slide whose reads failed for another reason (replaced or missing since
  indexing, resources) is not written (``incomplete``), so the next run does it.
- **Model outputs are checked per batch.** One row of finite floating-point numbers per tile,
  the same width in every batch. A tuple, integers, another batch size or a changing width
  would fail every slide alike: `ModelOutputError` names the model and the slides of the batch
  and stops the run (finished slides are kept). Non-finite values (NaN, Inf) fail their slide:
  it is not written, it is listed in ``failed_slides`` with the count and the first tile, and
  the other slides go on.
- **torchrun ranks** split the slides (balanced by tile count, each on exactly one rank);
  ``timeout`` gives up slides whose reads hang; a progress bar counts tiles.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, fields
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt
import torch
from torch.nn import functional as F  # noqa: N812

from wsi_loader.config import DatasetConfig
from wsi_loader.dataset._loader import default_workers, make_loader
from wsi_loader.dataset._scan import slide_batches
from wsi_loader.dataset._tiles import open_for_reading
from wsi_loader.device._devices import resolve_device
from wsi_loader.device._loader import DeviceLoader
from wsi_loader.errors import ConfigError, LoaderTimeoutError, ModelOutputError
from wsi_loader.index._table import SlideIndex
from wsi_loader.index._table_files import SlideRecord
from wsi_loader.models._content import BoundPass, bind_pass, slide_content
from wsi_loader.models._pass_files import (
    rank_and_world,
)
from wsi_loader.models._specs import Model
from wsi_loader.parallel import progress_bar

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}

# the model's step: a normalised (B, 3, H, W) batch on the device -> (B, D) outputs
Forward = Callable[[torch.Tensor], torch.Tensor]
# run in the reading processes on each uint8 NHWC batch (see TileDataset's batch_transform):
# where a per-pixel transform such as stain normalisation goes
BatchTransform = Callable[[np.ndarray], np.ndarray]


@dataclass
class PassOptions:
    """How to read and run: see `wsi_loader.features.extract` for each option."""

    batch_size: int = 64
    device: str | torch.device | None = None
    dtype: str = "float32"
    workers: int | None = None
    split: str | None = None
    root: str | None = None
    missing_slides: str = "raise"
    quarantine: str | os.PathLike[str] | None = None
    timeout: float = 0
    progress: bool = False
    batch_transform: BatchTransform | None = None
    stain: Any = None  # transforms of wsi_loader.stain, applied on the device
    # context tiles (mpp, size) per scale, run through the same model as the tiles
    context: Sequence[tuple[float, int]] = ()
    # write into a folder holding the outputs of a run with other options (`claim_folder`)
    overwrite: bool = False
    # where the batches come from instead of the local loader: called as
    # ``runner(run, slides, bar)``, it yields each slide once handed to the writer
    # (`wsi_loader.ray.RayPass`, on a Ray cluster)
    runner: Callable[[Any, list[int], Any], Iterator[int]] | None = None

    @classmethod
    def pick(cls, values: dict[str, Any]) -> PassOptions:
        """The options among ``values`` (a function's ``locals()``: `extract` and `predict`
        take the same keyword arguments, each a field of this class)."""
        return cls(**{f.name: values[f.name] for f in fields(cls) if f.name in values})

    def check(self) -> None:
        if self.dtype not in DTYPES:
            raise ConfigError(
                f"dtype must be one of {sorted(DTYPES)}", key="dtype", value=self.dtype
            )
        if isinstance(self.batch_size, bool) or not isinstance(self.batch_size, int):
            raise ConfigError("batch_size must be a whole number", key="batch_size")
        if self.batch_size < 1:
            raise ConfigError("batch_size must be >= 1", key="batch_size", value=self.batch_size)
        if self.runner is not None:  # its cluster reads the tiles, not a local loader
            for key, given in (("workers", self.workers is not None), ("timeout", self.timeout)):
                if given:
                    raise ConfigError(
                        f"{key} (--{key}) cannot go with a runner (--ray): the cluster's tasks "
                        "read the tiles, not local workers; leave it out",
                        key=key,
                        value=getattr(self, key),
                    )
        resolve_device(self.device)


@dataclass
class SlideOutputs:
    """One slide's outputs: ``values[i]`` is the output of index row ``rows[i]`` (rows in index
    order, failed tiles left out); ``failures`` the tiles left out, with the reader's reason;
    ``context[k]`` the outputs of the rows' context tiles of scale k, in the same order."""

    slide_id: int
    rows: npt.NDArray[np.int64]
    values: npt.NDArray[np.float32]
    failures: list[dict[str, Any]]
    context: list[npt.NDArray[np.float32]] = field(default_factory=list)


@dataclass
class PassReport:
    slides: int = 0  # slides of this run (all ranks)
    written: int = 0  # slides written by this rank
    skipped: int = 0  # slides already complete, kept by this rank
    tiles: int = 0  # tiles written by this rank
    failed: int = 0  # tiles left out by this rank
    dim: int | None = None  # outputs per tile
    failures: list[dict[str, Any]] = field(default_factory=list)
    written_slides: list[str] = field(default_factory=list)  # stored paths, by this rank
    # slides left unwritten for the next run: reads failed for reasons that are not the data's
    # (a changed or missing slide, resources), so a file would wrongly count as complete
    incomplete: list[dict[str, Any]] = field(default_factory=list)
    # slides whose model outputs were not finite (NaN, Inf): not written
    failed_slides: list[dict[str, Any]] = field(default_factory=list)
    # the stain transforms, as `StainPipeline.spec` (targets resolved): None without
    stain: list[dict[str, Any]] | None = None

    def part(self) -> dict[str, Any]:
        """This rank's share, for `gather_parts`."""
        return {
            "written": self.written,
            "skipped": self.skipped,
            "tiles": self.tiles,
            "failed": self.failed,
            "dim": self.dim,
            "failures": self.failures,
            "slides_written": self.written_slides,
            "incomplete": self.incomplete,
            "failed_slides": self.failed_slides,
        }


class Writer(Protocol):
    """What a pass writes through: ``settings`` (JSON values) are part of each slide's content;
    `is_complete` says whether a slide's stored outputs hold one of ``contents`` (read once:
    the pass asks about every slide); `write` stores them (whole or not at all)."""

    settings: list[Any]

    def is_complete(self, slide_id: int, contents: tuple[str, ...]) -> bool: ...

    def write(self, outputs: SlideOutputs, content: str) -> None: ...


class BadOutputError(Exception):
    """A model output that is not one row of floating-point numbers per tile (the runner adds
    the model and the slides: `ModelOutputError`)."""


def output_rows(output: Any, tiles: int) -> torch.Tensor:
    """``output`` as a (tiles, D) floating-point tensor (trailing dimensions of size 1
    dropped), or `BadOutputError` saying what is wrong with it: a (B, C, H, W) map would
    otherwise become C*H*W "classes" or features."""
    if isinstance(output, tuple | list):
        raise BadOutputError(
            f"returned a {type(output).__name__} of {len(output)}, not a tensor (a model "
            "returning (logits, attention) is a MIL model: predict FEATURES_DIR --mil-model)"
        )
    if not isinstance(output, torch.Tensor):
        raise BadOutputError(f"returned {type(output).__name__}, not a tensor")
    if not output.is_floating_point():
        raise BadOutputError(f"returned {output.dtype} values; outputs must be floating point")
    if output.ndim == 0 or output.shape[0] != tiles:
        raise BadOutputError(
            f"returned shape {tuple(output.shape)} for a batch of {tiles} tiles: the first "
            "dimension must be the batch, one row per tile"
        )
    if output.ndim > 2 and any(side != 1 for side in output.shape[2:]):
        raise BadOutputError(
            f"returned shape {tuple(output.shape)}: one row of values per tile, (B, C) or "
            "(B, C, 1, 1), not a map per tile (pool or flatten it in the model)"
        )
    return output.reshape(tiles, -1)


def assign_slides(tiles: Sequence[int], world_size: int) -> list[int]:
    """Rank of each slide: largest first to the least loaded rank (the same on every rank)."""
    load = [0] * world_size
    owner = [0] * len(tiles)
    for sid in sorted(range(len(tiles)), key=lambda s: (-tiles[s], s)):
        rank = min(range(world_size), key=lambda r: (load[r], r))
        owner[sid] = rank
        load[rank] += tiles[sid]
    return owner


def open_view(index: SlideIndex | str | os.PathLike[str], options: PassOptions) -> SlideIndex:
    """The index view a pass reads (``split``, ``root``, ``missing_slides``, ``quarantine``)."""
    config = DatasetConfig(
        split=options.split,
        root=options.root,
        missing_slides=options.missing_slides,  # type: ignore[arg-type]
        quarantine=None if options.quarantine is None else os.fspath(options.quarantine),
    )
    return open_for_reading(index, config)


def slides_with_tiles(view: SlideIndex) -> list[int]:
    return [int(s) for s in np.flatnonzero(np.diff(view.slide_starts()) > 0)]


def run_pass(
    view: SlideIndex,
    model: Model,
    forward: Forward,
    writer: Writer,
    options: PassOptions,
    what: str,
    bound: BoundPass | None = None,
) -> PassReport:
    """Run ``forward`` over every tile of this rank's slides of ``view`` that ``writer`` does
    not hold complete yet, and hand each slide's outputs to ``writer``. ``bound``: the pass's
    `bind_pass`, when the caller has it already."""
    options.check()
    device = resolve_device(options.device)
    rank, world = rank_and_world()
    starts = view.slide_starts()
    counts = np.diff(starts)
    slide_ids = slides_with_tiles(view)
    owner = assign_slides([int(counts[s]) for s in slide_ids], world)
    mine = [sid for sid, r in zip(slide_ids, owner, strict=True) if r == rank]
    bound = bound or bind_pass(view, model, writer, options)
    header, stain, stain_spec = bound.header, bound.stain, bound.stain_spec
    content = {sid: slide_content(view, starts, sid, header, stain_spec) for sid in mine}
    # a slide is done when its stored outputs hold its content, or the digest of outputs
    # written before slides were known by content (of this very slide version)
    todo = [
        sid
        for sid in mine
        if not writer.is_complete(
            sid,
            (content[sid], slide_content(view, starts, sid, header, stain_spec, legacy=True)),
        )
    ]
    report = PassReport(slides=len(slide_ids), skipped=len(mine) - len(todo), stain=stain_spec)
    run = _Run(view, model, forward, writer, options, device, report, content, stain)
    total = int(sum(counts[s] for s in todo))
    with progress_bar(total, "tile", what, options.progress and bool(todo)) as bar:
        while todo:
            done: set[int] = set()
            try:
                for sid in run.slides(todo, bar):
                    done.add(sid)
                todo = []
            except LoaderTimeoutError as exc:
                todo = _after_timeout(exc, [s for s in todo if s not in done], view, counts, report)
                bar.n = total - int(sum(counts[s] for s in todo))  # a slide begun starts over
                bar.refresh()
    return report


@dataclass
class _Parts:
    """What has come back of one slide so far."""

    values: list[np.ndarray] = field(default_factory=list)
    rows: list[np.ndarray] = field(default_factory=list)
    failed_rows: list[np.ndarray] = field(default_factory=list)
    not_finite: list[np.ndarray] = field(default_factory=list)
    context: list[list[np.ndarray]] = field(default_factory=list)  # per scale, like values
    received: int = 0


def gather(
    parts: dict[int, _Parts],
    counts: npt.NDArray[np.int64],
    values: np.ndarray,
    context: list[np.ndarray],
    ok: np.ndarray,
    rows: np.ndarray,
    slides: np.ndarray,
) -> Iterator[tuple[int, _Parts]]:
    """Add one batch's outputs to its slides' parts; yield each slide (and its parts, taken
    out of ``parts``) whose last row this batch brought. A batch may hold several slides'
    rows (the local loader's and Ray's alike)."""
    finite = np.isfinite(values).all(axis=1)
    for scale in context:
        finite &= np.isfinite(scale).all(axis=1)
    for sid in np.unique(slides).tolist():
        here = slides == sid
        part = parts.setdefault(sid, _Parts())
        part.values.append(values[here & ok])
        part.context = part.context or [[] for _ in context]
        for kept, scale in zip(part.context, context, strict=True):
            kept.append(scale[here & ok])
        part.rows.append(rows[here & ok])
        part.failed_rows.append(rows[here & ~ok])
        part.not_finite.append(rows[here & ok & ~finite])
        part.received += int(here.sum())
        if part.received == counts[sid]:
            yield sid, parts.pop(sid)


@dataclass
class _Run:
    view: SlideIndex
    model: Model
    forward: Forward
    writer: Writer
    options: PassOptions
    device: torch.device
    report: PassReport
    content: dict[int, str]
    stain: Any = None  # bound to the view

    def slides(self, todo: list[int], bar: Any) -> Iterator[int]:
        """Read ``todo``, run the model, write each slide once all its rows have passed; yield
        the slides done (written, failed or left for the next run)."""
        if self.options.runner is not None:
            yield from self.options.runner(self, todo, bar)
            return
        options, device = self.options, self.device
        counts = np.diff(self.view.slide_starts())
        workers = default_workers() if options.workers is None else options.workers
        loader = make_loader(
            self.view,
            options.batch_size,
            batches=slide_batches(self.view, todo, options.batch_size, workers),
            num_workers=workers,
            pin_memory=device.type == "cuda",
            persistent_workers=False,
            timeout=options.timeout,
            batch_transform=options.batch_transform,
            context=list(options.context),
        )
        batches = DeviceLoader(
            loader,
            device,
            mean=self.model.mean,
            std=self.model.std,
            channels_last=True,
            stain=self.stain,
        )
        model = self.model.model.eval().to(device)
        if device.type == "cuda":
            model.to(memory_format=torch.channels_last)  # type: ignore[call-overload]
        parts: dict[int, _Parts] = {}
        for batch in batches:
            values = self._outputs(batch, batch["image"])
            context = [
                self._outputs(batch, tiles, k)
                for k, tiles in enumerate(batch.get("context") or (), 1)
            ]
            ok = batch["ok"].cpu().numpy().astype(bool)
            rows = batch["row"].cpu().numpy().astype(np.int64)
            slides = batch["slide_id"].cpu().numpy()
            for sid, done in gather(parts, counts, values, context, ok, rows, slides):
                self._finish(sid, done)
                yield sid
            bar.update(len(rows))

    def _outputs(
        self, batch: dict[str, Any], image: torch.Tensor, scale: int = 0
    ) -> npt.NDArray[np.float32]:
        """The checked (B, D) outputs of one batch's tiles (``scale`` 0) or context tiles of
        scale ``scale``, as float32. Context outputs have the tiles' width (the same model on
        inputs resized alike)."""
        size = self.model.size
        if size is not None and image.shape[-1] != size:
            image = F.interpolate(image, size=(size, size), mode="bilinear", antialias=True)
        autocast = self.options.dtype != "float32"
        try:
            with (
                torch.inference_mode(),
                torch.autocast(
                    self.device.type, dtype=DTYPES[self.options.dtype], enabled=autocast
                ),
            ):
                output = output_rows(self.forward(image), len(image))
            if self.report.dim is not None and output.shape[1] != self.report.dim:
                what = f" (context tiles of scale {scale})" if scale else ""
                raise BadOutputError(
                    f"returned {output.shape[1]} values per tile in this batch{what}, "
                    f"{self.report.dim} in the first: the width must not change"
                )
        except BadOutputError as exc:
            paths = sorted({self.view.slides[int(s)].path for s in batch["slide_id"].tolist()})
            raise ModelOutputError(str(exc), model=self.model.spec, slides=paths) from None
        self.report.dim = int(output.shape[1])
        return output.float().cpu().numpy()

    def _finish(self, sid: int, parts: _Parts) -> None:
        view, report = self.view, self.report
        record = view.slides[sid]
        cols = view.columns
        failed = np.concatenate(parts.failed_rows)
        reasons, slide_fault = failure_reasons(view, record) if len(failed) else ({}, None)
        xy = [(int(cols["l0_x"][r]), int(cols["l0_y"][r])) for r in failed.tolist()]
        unexplained = sum(key not in reasons for key in xy)
        if unexplained:
            why = slide_fault or "reads failed for want of resources (not recorded as data errors)"
            log.warning(
                "%s: not written, %d tiles failed: %s; run again", record.path, unexplained, why
            )
            report.incomplete.append({"slide": record.path, "tiles": unexplained, "reason": why})
            return
        not_finite = np.sort(np.concatenate(parts.not_finite))
        rows = np.concatenate(parts.rows)
        if len(not_finite):
            first = int(not_finite[0])
            why = (
                f"the model returned NaN or infinite values for {len(not_finite)} of {len(rows)} "
                f"tiles (the first at level-0 x={int(cols['l0_x'][first])}, "
                f"y={int(cols['l0_y'][first])}); not written"
            )
            log.error("%s: %s", record.path, why)
            report.failed_slides.append(
                {"slide": record.path, "tiles": len(not_finite), "reason": why}
            )
            return
        order = np.argsort(rows, kind="stable")
        values = np.concatenate(parts.values)[order].astype(np.float32, copy=False)
        context = [np.concatenate(s)[order].astype(np.float32, copy=False) for s in parts.context]
        failures = [
            {"slide": record.path, "x": x, "y": y, "reason": reasons[(x, y)]} for x, y in xy
        ]
        outputs = SlideOutputs(sid, rows[order], values, failures, context)
        self.writer.write(outputs, self.content[sid])
        report.failures.extend(failures)
        report.written += 1
        report.written_slides.append(record.path)
        report.tiles += len(rows)
        report.failed += len(failed)


def _after_timeout(
    exc: LoaderTimeoutError,
    todo: list[int],
    view: SlideIndex,
    counts: npt.NDArray[np.int64],
    report: PassReport,
) -> list[int]:
    """The slides still to do after no batch came within the timeout: the ones the workers
    were reading are left for the next run (``incomplete``), or the first slide not done when
    the workers were stuck elsewhere (so that every round ends at least one slide)."""
    stuck = [s for s in exc.slide_ids if s in todo] or todo[:1]
    for sid in stuck:
        path = view.slides[sid].path
        why = (
            f"no batch within timeout={exc.seconds:g} s while reading it (a read that hangs: "
            "is its storage answering?); not written, run again"
        )
        log.warning("%s: %s", path, why)
        report.incomplete.append({"slide": path, "tiles": int(counts[sid]), "reason": why})
    return [s for s in todo if s not in stuck]


def failure_reasons(
    view: SlideIndex, record: SlideRecord
) -> tuple[dict[tuple[int, int], str], str | None]:
    """What the workers recorded in the quarantine for this version of a slide: the error of
    each tile that failed on its data, and the slide fault (missing, replaced), if any."""
    reasons: dict[tuple[int, int], str] = {}
    slide_fault = None
    for entry in view.quarantine.read():
        if entry.get("path") != record.path:
            continue
        if entry.get("kind", "tile") == "slide":
            slide_fault = str(entry.get("error") or "the slide could not be read")
        elif entry.get("fingerprint") in (None, record.fingerprint):
            reasons[(int(entry["x"]), int(entry["y"]))] = str(entry.get("error") or "read failed")
    return reasons, slide_fault
