from __future__ import annotations

import numpy as np

from wsi_loader.device._bench import format_table, run_bench, sample_rows
from wsi_loader.index._table import SlideIndex


def test_sample_rows_are_distinct_when_the_index_is_large_enough(index: SlideIndex) -> None:
    rows = sample_rows(index, len(index) - 3, seed=1)
    assert len(rows) == len(index) - 3 and len(np.unique(rows)) == len(rows)
    assert np.array_equal(rows, sample_rows(index, len(index) - 3, seed=1))


def test_sample_rows_of_a_small_index_read_every_row_about_equally(index: SlideIndex) -> None:
    count = 2 * len(index) + 5
    rows = sample_rows(index, count, seed=1)
    assert len(rows) == count and rows.dtype == np.int64
    reads = np.bincount(rows, minlength=len(index))
    assert reads.min() >= 2 and reads.max() <= 3


def test_every_path_reads_the_same_number_of_tiles(index: SlideIndex) -> None:
    """A small index is read round after round by every path, baselines included, so the
    loader is not measured on warmer caches than OpenSlide."""
    tiles = len(index) + 20
    result = run_bench(index, tiles=tiles, batch_size=8, workers=(0,))
    assert result["tiles"] == tiles and result["distinct_tiles"] == len(index)
    assert [r["tiles"] for r in result["results"]] == [tiles] * 4
    assert result["busy"] == 0
    assert f"({len(index)} distinct, the index is small)" in format_table(result)


def test_bench_under_load_records_it(index: SlideIndex) -> None:
    result = run_bench(index, tiles=16, batch_size=8, workers=[0], busy=1)
    assert result["busy"] == 1 and all(r["tiles_per_s"] > 0 for r in result["results"])
    assert "1 other busy processes" in format_table(result)


def test_busy_cores_spin_for_the_duration_and_stop() -> None:
    import os

    from wsi_loader.device._bench import busy_cores

    with busy_cores(2) as spinners:
        pids = [s.pid for s in spinners]
        assert all(s.poll() is None for s in spinners)
        with open(f"/proc/{pids[0]}/stat") as fh:
            state = fh.read().rsplit(")", 1)[1].split()[0]
        assert state == "R"  # running: burning a core
    assert all(s.returncode is not None for s in spinners)
    assert not any(os.path.exists(f"/proc/{pid}") for pid in pids)


def test_cpu_per_tile_counts_the_worker_processes(index: SlideIndex) -> None:
    """With a worker, the decoding happens in another process: its CPU time must be in the
    path's CPU per tile (the main process alone would look almost free)."""
    result = run_bench(index, tiles=300, batch_size=16, workers=(1,))
    by_name = {(r["name"], r["workers"]): r for r in result["results"]}
    single = by_name[("wsi_loader", 0)]["cpu_us_per_tile"]
    assert single > 0 and by_name[("openslide", 0)]["cpu_us_per_tile"] > 0
    assert by_name[("make_loader", 1)]["cpu_us_per_tile"] >= 0.5 * single
    assert "CPU us/tile" in format_table(result)
