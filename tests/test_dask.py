"""Index and export on a real Dask LocalCluster (2 worker processes on loopback) give the same
result as the local run; ``--scheduler`` at something that is not a Dask scheduler is said so."""

from __future__ import annotations

import socketserver
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
import pytest

from wsi_loader.cli import common, main
from wsi_loader.export import export_index
from wsi_loader.index import SlideIndex, build_index

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


class _Dashboard(BaseHTTPRequestHandler):
    """An HTTP service (Dask's dashboard, a proxy): it waits for a request."""

    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:
        self.send_response(200)
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"ok")

    def log_message(self, format: str, *args: object) -> None:
        pass


class _SpeaksFirst(socketserver.BaseRequestHandler):
    """A service that answers as soon as a client connects, with an HTTP status line: read as
    a Dask frame length, "HTTP/1.1" is 3.07 EiB."""

    def handle(self) -> None:
        self.request.sendall(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n")


@pytest.fixture(params=["http", "speaks-first"])
def not_a_scheduler(request: pytest.FixtureRequest) -> Iterator[str]:
    server: socketserver.TCPServer
    if request.param == "http":
        server = ThreadingHTTPServer(("127.0.0.1", 0), _Dashboard)
    else:
        server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), _SpeaksFirst)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05})
    thread.start()
    try:
        yield f"tcp://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        thread.join()
        server.server_close()


@pytest.mark.timeout(300)  # the Client used to wait forever on an HTTP service
def test_a_scheduler_address_that_is_not_a_scheduler_is_said_so(
    not_a_scheduler: str,
    archive: Path,
    index: SlideIndex,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(common, "SCHEDULER_TIMEOUT_S", 2)
    out = tmp_path / "out"
    export = ["export", str(index.path), "--out", str(out), "--no-progress"]
    assert main([*export, "--scheduler", not_a_scheduler]) == 2
    err = capsys.readouterr().err
    assert f"cannot reach a Dask scheduler at {not_a_scheduler}" in err, err
    assert "Traceback" not in err and "EiB" not in err
    assert not out.exists()
    build = ["index", str(archive), "--out", str(tmp_path / "idx2")]
    assert main([*build, "--scheduler", not_a_scheduler, "--no-progress"]) == 2
    assert f"cannot reach a Dask scheduler at {not_a_scheduler}" in capsys.readouterr().err


def test_a_real_scheduler_passes_the_check(client) -> None:  # type: ignore[no-untyped-def]
    with common.dask_client(client.scheduler.address) as other:
        assert other.submit(sum, [1, 2]).result() == 3
