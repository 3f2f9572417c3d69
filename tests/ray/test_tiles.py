"""`wsi_loader.ray.tiles` on a real local Ray cluster (two CPUs, started once for the module and
shut down after): every row once, with `TileDataset`'s pixels; failed tiles and a slide gone
between epochs are rows with ``ok = False`` and quarantine records, not a failed job; a read
worker killed mid-epoch is retried by Ray without losing or repeating a tile."""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from tests.conftest import corrupt_rows
from wsi_loader.dataset import TileDataset
from wsi_loader.index import SlideIndex
from wsi_loader.ray import TileSource, tiles
from wsi_loader.ray._source import COLUMNS, plan_runs, remote_options

pytestmark = [
    pytest.mark.slow,
    # Ray's own deprecations, warned inside Ray by its defaults
    pytest.mark.filterwarnings("ignore::DeprecationWarning:ray"),
    # Ray silences torch's read-only array warning itself (torch_utils: zero-copy arrays from
    # its object store) inside warnings.catch_warnings, which is not thread-safe: with
    # iter_torch_batches' prefetch threads it sometimes raced with our "error" filter and
    # failed test_iter_torch_batches_and_where in a fresh-clone CI run
    pytest.mark.filterwarnings("ignore:The given NumPy array is not writable:UserWarning"),
]


def collect(batches: Iterator[dict[str, Any]]) -> dict[str, np.ndarray]:
    """All batches' columns concatenated."""
    parts: dict[str, list[np.ndarray]] = {}
    for batch in batches:
        for name, values in batch.items():
            parts.setdefault(name, []).append(np.asarray(values))
    return {name: np.concatenate(values) for name, values in parts.items()}


def test_every_row_once_with_the_pixels_of_tile_dataset(cluster: str, index: SlideIndex) -> None:
    got = collect(
        tiles(index, batch_size=16, columns=COLUMNS).iter_batches(
            batch_format="numpy", batch_size=16
        )
    )
    assert got["image"].dtype == np.uint8 and got["image"].shape[1:] == (256, 256, 3)
    assert sorted(got["row"].tolist()) == list(range(len(index)))  # each row once
    bad = set(corrupt_rows(index).tolist())
    assert bad and set(got["row"][~got["ok"]].tolist()) == bad
    assert all(got["error"][~got["ok"]]) and not any(got["error"][got["ok"]])
    # the workers recorded the failed tiles in the index's quarantine
    recorded = {(r["x"], r["y"]) for r in index.quarantine.tile_records()}
    cols = index.columns
    assert recorded == {(int(cols["l0_x"][r]), int(cols["l0_y"][r])) for r in bad}
    local = TileDataset(index)
    labels = local.tile_labels(got["row"])
    for i, row in enumerate(got["row"].tolist()):
        sample = local[row]
        assert np.array_equal(got["image"][i], sample["image"].permute(1, 2, 0).numpy()), row
        assert (got["slide_id"][i], got["x"][i], got["y"][i], got["ok"][i]) == (
            sample["slide_id"],
            sample["x"],
            sample["y"],
            sample["ok"],
        )
        assert got["level"][i] == cols["level"][row] and got["label"][i] == labels[i]
    assert set(got["split"].tolist()) == {""}


def test_a_slide_deleted_between_epochs_gives_not_ok_rows_and_a_record(
    cluster: str, index: SlideIndex, archive: Path
) -> None:
    source = TileSource(index, batch_size=32, columns=["row", "ok", "error"], shuffle=True)
    first = collect(source.dataset(0).iter_batches(batch_format="numpy"))
    assert sorted(first["row"].tolist()) == list(range(len(index)))
    (archive / "good.svs").unlink()
    second = collect(source.dataset(1).iter_batches(batch_format="numpy"))
    assert sorted(second["row"].tolist()) == list(range(len(index)))
    good = next(i for i, s in enumerate(index.slides) if s.path.endswith("good.svs"))
    gone = index.columns["slide_id"][second["row"]] == good
    assert gone.any() and not second["ok"][gone].any()
    assert all("good.svs" in e or "No such file" in e for e in second["error"][gone])
    assert [r["path"] for r in index.quarantine.slide_records()] == [index.slides[good].path]


def test_epochs_reorder_the_read_tasks_by_seed(cluster: str, index: SlideIndex) -> None:
    source = TileSource(index, batch_size=8, shuffle=True, seed=3)
    runs = plan_runs(index, 8, 6)
    assert sorted(np.concatenate(runs).tolist()) == list(range(len(index)))
    for run in runs:  # a run is whole batches of one slide
        assert len(set(index.columns["slide_id"][run].tolist())) == 1
    assert all(len(run) % 8 == 0 for run in runs[:-1])

    def order(epoch: int, seed: int = 3) -> list[int]:
        source.epoch, source.seed = epoch, seed
        return [k for k, _ in source.runs(6)]

    assert order(0) == order(0) != order(1)
    assert order(0) != order(0, seed=4)
    assert sorted(order(1)) == list(range(len(runs)))
    assert len(source.get_read_tasks(6)) == len(runs)


def test_iter_torch_batches_and_where(cluster: str, index: SlideIndex) -> None:
    good = next(i for i, s in enumerate(index.slides) if s.path.endswith("good.svs"))
    ds = tiles(index, batch_size=16, where=lambda c: c["slide_id"] == good)
    seen = 0
    for batch in ds.iter_torch_batches(batch_size=16):
        assert batch["image"].dtype == torch.uint8 and batch["image"].shape[1:] == (256, 256, 3)
        assert bool((batch["slide_id"] == good).all()) and bool(batch["ok"].all())
        seen += len(batch["image"])
    assert seen == int((index.columns["slide_id"] == good).sum())


def read_task_pids() -> list[int]:
    """Processes running a read task now (Ray titles a worker by its task)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
            except OSError:
                continue
            if cmdline.startswith(b"ray::ReadTiles"):
                found.append(int(entry))
    return found


def test_a_worker_killed_mid_epoch_loses_and_repeats_no_tile(
    cluster: str, index: SlideIndex
) -> None:
    killed: list[int] = []
    stop = threading.Event()

    def kill_one() -> None:
        while not stop.is_set() and not killed:
            for pid in read_task_pids():
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
                break
            stop.wait(0.005)

    ds = tiles(index, batch_size=4, columns=["row", "ok"], override_num_blocks=36)
    killer = threading.Thread(target=kill_one)
    killer.start()
    try:
        got = collect(ds.iter_batches(batch_format="numpy"))
    finally:
        stop.set()
        killer.join()
    assert killed, "no read task was seen running"
    assert sorted(got["row"].tolist()) == list(range(len(index)))


class DeletesItsSlide(TileDataset):
    """A `TileDataset` that deletes the file ``doomed`` (or, with ``empty``, truncates it to
    nothing) right after its first read of that slide's rows: the slide goes in the middle of
    an epoch, in the read task that read it, after some of its rows were read (a point the
    test knows, not a timing)."""

    doomed: str
    empty: bool

    def read_rows(self, rows: np.ndarray, *args: Any, **kwargs: Any) -> Any:
        result = super().read_rows(rows, *args, **kwargs)
        slides = self.index.slides
        if any(slides[s].path == self.doomed for s in self.index.columns["slide_id"][rows]):
            if self.empty:
                Path(self.doomed).write_bytes(b"")
            else:
                Path(self.doomed).unlink(missing_ok=True)
        return result


@pytest.mark.parametrize("how", ["deleted", "emptied"])
def test_a_slide_gone_during_an_epoch_gives_not_ok_rows_and_a_record(
    cluster: str, index: SlideIndex, how: str
) -> None:
    good = next(i for i, s in enumerate(index.slides) if s.path.endswith("good.svs"))
    dataset = DeletesItsSlide(index, decode_threads=1)
    dataset.doomed, dataset.empty = index.slides[good].path, how == "emptied"
    source = TileSource(dataset, batch_size=8, columns=["row", "ok", "error"], task_batches=1)
    # one read task at a time, each one batch that opens the slide anew: the tasks after the
    # one that deleted the file find it gone
    got = collect(source.dataset(0, concurrency=1).iter_batches(batch_format="numpy"))
    assert sorted(got["row"].tolist()) == list(range(len(index)))  # no crash, every row once
    mine = index.columns["slide_id"][got["row"]] == good
    assert not Path(index.slides[good].path).exists() or how == "emptied"
    # the rows read before the deletion are tiles, those after it are failures
    assert got["ok"][mine].any() and not got["ok"][mine].all()
    gone = mine & ~got["ok"]
    assert all("good.svs" in e for e in got["error"][gone]), got["error"][gone][:1]
    assert [r["path"] for r in index.quarantine.slide_records()] == [index.slides[good].path]
    # the other slide is read as before: only its corrupt tiles fail
    others = ~mine & ~got["ok"]
    assert set(got["row"][others].tolist()) == set(corrupt_rows(index).tolist())


def test_blocks_are_not_split_by_ray(cluster: str, index: SlideIndex) -> None:
    # asked for more blocks than read tasks (its default is 200 or more), Ray cuts each
    # task's blocks into pieces of a few rows, and every piece costs a block's overhead; it
    # may merge blocks (it does below 1 MB), so a block is a batch or more, but for the last
    # of each run
    source = TileSource(index, batch_size=16, columns=["image", "row"])
    sizes = [
        len(block["row"])
        for block in source.dataset(0).iter_batches(batch_format="numpy", batch_size=None)
    ]
    assert sum(sizes) == len(index)
    assert sum(size < 16 for size in sizes) <= len(source.runs(200)), sizes


def test_ray_remote_args_reach_the_read_tasks_as_rays_named_parameters(
    cluster: str, index: SlideIndex
) -> None:
    """Ray deprecates ``read_datasource(ray_remote_args=...)`` (gone in Ray 2.64): our
    parameter of that name still works, and passes what Ray names as named parameters, so
    that Ray warns of nothing (warnings are errors here)."""
    asked = {"num_cpus": 0.5, "memory": 2**20, "max_calls": 3}
    dataset = tiles(index, batch_size=16, columns=["row"], ray_remote_args=asked)
    read = dataset._logical_plan.dag  # Ray's Read operator: what each read task asks for
    assert {k: read.ray_remote_args[k] for k in asked} == asked
    got = collect(dataset.iter_batches(batch_format="numpy"))
    assert sorted(got["row"].tolist()) == list(range(len(index)))


def test_remote_options_pass_what_ray_names_and_keep_the_rest() -> None:
    given = {"num_cpus": 1, "memory": 5, "max_retries": 3}
    got = remote_options({"override_num_blocks": 4, "num_cpus": 2, "ray_remote_args": given})
    # num_cpus given by name wins, as in Ray; retries have no named parameter
    assert got == {"override_num_blocks": 4, "num_cpus": 2, "memory": 5,
                   "ray_remote_args": {"max_retries": 3}}  # fmt: skip
    assert given == {"num_cpus": 1, "memory": 5, "max_retries": 3}  # the caller's, untouched
    assert remote_options({"ray_remote_args": None}) == {}
