"""Index and export on a real Dask LocalCluster (2 worker processes on loopback) give the same
result as the local run."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from wsi_loader.export import export_index
from wsi_loader.index import build_index

distributed = pytest.importorskip("dask.distributed")


@pytest.fixture(scope="module")
def client():  # type: ignore[no-untyped-def]
    cluster = distributed.LocalCluster(
        n_workers=2, threads_per_worker=1, processes=True, host="127.0.0.1", dashboard_address=None
    )
    with distributed.Client(cluster) as c:
        yield c
    cluster.close()


@pytest.mark.slow
def test_index_and_export_on_localcluster(client, archive: Path, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    local = build_index([archive], tmp_path / "local", tile_size=256, level=0, min_tissue=0.2)
    remote = build_index(
        [archive], tmp_path / "dask", tile_size=256, level=0, min_tissue=0.2, executor=client
    )
    assert local.summary()["slides"] == remote.summary()["slides"]
    for name in local.columns:
        np.testing.assert_array_equal(local.columns[name], remote.columns[name])
    # export a slide without bad tiles: failures would grow the quarantine between the runs
    good = build_index([archive / "good.svs"], tmp_path / "good", level=0, min_tissue=0.2)
    a = export_index(good, tmp_path / "exp-local", format="webdataset", shard_size=25, workers=2)
    b = export_index(
        good, tmp_path / "exp-dask", format="webdataset", shard_size=25, executor=client
    )
    assert a.shards == b.shards
    for shard in a.shards:
        assert (tmp_path / "exp-local" / shard["file"]).read_bytes() == (
            tmp_path / "exp-dask" / shard["file"]
        ).read_bytes()
    assert (tmp_path / "exp-local" / "manifest.csv").read_text() == (
        tmp_path / "exp-dask" / "manifest.csv"
    ).read_text()
