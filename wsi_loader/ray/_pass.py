"""`RayPass`: a model pass (`wsi_loader.models`, what `features` and `predict` write from) whose
tiles are read by Ray CPU tasks and run through the model by a pool of Ray actors, each
holding the model (on a GPU when the cluster has them: ``map_batches`` with ``num_gpus``).

Given as ``runner`` to `wsi_loader.features.extract` / `wsi_loader.predict.predict`
(``--ray ADDRESS``), it replaces only where batches come from: the pass still decides on the
driver which slides are to do (resume: a slide whose outputs are complete is skipped),
gathers each slide's outputs and writes them through the same writer, so the files are
those of a local run. The read tasks are `wsi_loader.ray.TileSource`'s (each slide in strip
order), the actors normalise, stain and run the batch exactly as the local pass does
(`DeviceLoader`, then the pass's own output checks). A task or actor lost with its node is
redone by Ray; a slide is written once, when all its rows have come back.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any

import numpy as np
import numpy.typing as npt
import ray
import torch

from wsi_loader.dataset._batch import TileBatch
from wsi_loader.device._devices import resolve_device
from wsi_loader.device._loader import DeviceLoader
from wsi_loader.errors import ConfigError
from wsi_loader.models._pass import PassReport, _Parts, _Run, gather
from wsi_loader.ray._source import TileSource

# batches per read task: the model sees the local pass's batches whatever this is (same rows,
# same order); fewer tasks cost less to schedule (see wsi_loader.ray._source.MIN_TASK_BATCHES)
TASK_BATCHES = 4


class RayPass:
    """Run a model pass on the Ray cluster at ``address`` (None: the one this process is
    connected to, or a local one). ``actors``: model replicas; ``num_gpus``: GPUs per actor
    (None: one when the cluster has GPUs, else none)."""

    def __init__(
        self,
        address: str | None = None,
        *,
        actors: int = 1,
        num_gpus: float | None = None,
    ) -> None:
        if actors < 1:
            raise ConfigError("actors must be >= 1", key="actors", value=actors)
        self.address = address
        self.actors = actors
        self.num_gpus = num_gpus

    def __call__(self, run: _Run, todo: list[int], bar: Any) -> Iterator[int]:
        """`_Run.slides` on Ray: yield each slide of ``todo`` once it is written, failed or
        left for the next run."""
        options = run.options
        if options.batch_transform is not None:
            raise ConfigError(
                "batch_transform cannot run on Ray: use stain= (applied by the model actors)",
                key="batch_transform",
            )
        if not ray.is_initialized():
            ray.init(address=self.address, log_to_driver=False)
        gpus = self.num_gpus
        if gpus is None:
            resources: dict[str, float] = ray.cluster_resources()  # type: ignore[no-untyped-call]
            gpus = 1.0 if resources.get("GPU", 0) > 0 else 0.0
        source = TileSource(
            run.view,
            batch_size=options.batch_size,
            columns=["image", *_context_columns(len(options.context)), "slide_id", "row", "ok"],
            context=list(options.context),
            slides=todo,
            task_batches=TASK_BATCHES,
            decode_threads=1,
        )
        # exactly the tasks planned, so that Ray does not split their blocks: each block is
        # one batch of the local pass (`slide_batches`), run by the model as it is
        tasks = len(source.runs(1))
        # what an actor needs of the run: not the writer (files are written here)
        actor_run = copy.copy(run)
        actor_run.writer = None  # type: ignore[assignment]
        actor_run.report = PassReport()
        actor_run.device = torch.device("cpu")  # chosen again in the actor
        outputs = source.dataset(0, override_num_blocks=tasks).map_batches(
            _ModelActor,
            fn_constructor_args=(_Shipped(actor_run),),
            batch_size=None,
            batch_format="numpy",
            compute=ray.data.ActorPoolStrategy(size=self.actors),
            num_gpus=gpus,
        )
        counts = np.diff(run.view.slide_starts())
        parts: dict[int, _Parts] = {}
        for batch in outputs.iter_batches(batch_format="numpy", batch_size=None):
            values = np.asarray(batch["values"], dtype=np.float32)
            context = [
                np.asarray(batch[f"values_{k}"], dtype=np.float32)
                for k in range(1, len(options.context) + 1)
            ]
            if run.report.dim is None:
                run.report.dim = int(values.shape[1])
            ok = np.asarray(batch["ok"], dtype=bool)
            rows = np.asarray(batch["row"], dtype=np.int64)
            slides = np.asarray(batch["slide_id"], dtype=np.int64)
            for sid, done in gather(parts, counts, values, context, ok, rows, slides):
                run._finish(sid, done)
                yield sid
            bar.update(len(rows))


def _context_columns(scales: int) -> list[str]:
    return [*(f"context_{k}" for k in range(scales)), *(["context_inside"] if scales else [])]


class _Shipped:
    """The run an actor is made from, in a box that is not a dataclass: Ray Data describes
    its operators' arguments with ``dataclasses.asdict``, which would deep-copy the run's
    index field by field, its open lock file with it (two objects closing one descriptor)."""

    def __init__(self, run: _Run) -> None:
        self.run = run

    def __repr__(self) -> str:
        return f"<model pass of {self.run.model.spec!r}>"


class _ModelActor:
    """One model replica (a Ray actor): a block of tiles in, the checked outputs out."""

    def __init__(self, shipped: _Shipped) -> None:
        self.run = run = shipped.run
        run.device = resolve_device(run.options.device)
        model = run.model.model.eval().to(run.device)
        if run.device.type == "cuda":
            model.to(memory_format=torch.channels_last)  # type: ignore[call-overload]

    def __call__(self, block: dict[str, npt.NDArray[Any]]) -> dict[str, npt.NDArray[Any]]:
        run = self.run
        n = len(block["row"])
        scales = len(run.options.context)
        batch = TileBatch(
            images=torch.from_numpy(np.ascontiguousarray(block["image"])),
            ok=torch.from_numpy(np.asarray(block["ok"], dtype=bool)),
            substituted=torch.zeros(n, dtype=torch.bool),
            rows=torch.from_numpy(np.asarray(block["row"], dtype=np.int64)),
            slide_id=torch.from_numpy(np.asarray(block["slide_id"], dtype=np.int64)),
            x=torch.zeros(n, dtype=torch.int64),
            y=torch.zeros(n, dtype=torch.int64),
            label=torch.full((n,), -1, dtype=torch.int64),
            context=(
                [
                    torch.from_numpy(np.ascontiguousarray(block[f"context_{k}"]))
                    for k in range(scales)
                ]
                if scales
                else None
            ),
            context_inside=(
                torch.from_numpy(np.asarray(block["context_inside"])) if scales else None
            ),
        )
        loader = DeviceLoader(
            [batch],
            run.device,
            mean=run.model.mean,
            std=run.model.std,
            channels_last=True,
            stain=run.stain,
        )
        out: dict[str, npt.NDArray[Any]] = {}
        for moved in loader:
            out["values"] = run._outputs(moved, moved["image"])
            for k, tiles in enumerate(moved.get("context") or (), 1):
                out[f"values_{k}"] = run._outputs(moved, tiles, k)
        out.update(
            row=np.asarray(block["row"]),
            slide_id=np.asarray(block["slide_id"]),
            ok=np.asarray(block["ok"]),
        )
        return out
