"""The whole pipeline on slides in a bucket (moto's S3 server on 127.0.0.1, reached through the
standard AWS environment variables): index, dataset, make_loader with 0 and 2 workers (fork
and spawn), export and features give what they give on the local files."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest

from tests.conftest import CORRUPT, REPO, SlideFactory, s3_fs, upload
from tests.servers import delay_proxy, http_files, proxy_stats
from wsi_loader.dataset import TileDataset, make_loader
from wsi_loader.errors import SlideNotFoundError
from wsi_loader.export import export_index
from wsi_loader.features import extract
from wsi_loader.index import SlideIndex, build_index
from wsi_loader.index._fingerprints import ends_digest

pytestmark = pytest.mark.filterwarnings("ignore::ResourceWarning")

OPTIONS = {"tile_size": 256, "level": 0, "min_tissue": 0.0}
NAMES = ("good slide.v2.svs", "bad (1).svs")


@pytest.fixture(scope="module")
def bucket(s3_endpoint: str, make_slide: SlideFactory, tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    """The same two slides in a local folder and under ``s3://slides/archive/``, with a labels
    CSV that names the objects by URL."""
    folder = tmp_path_factory.mktemp("local")
    shutil.copy(make_slide(width=2560, height=2048, seed=31), folder / NAMES[0])
    shutil.copy(make_slide(width=2048, height=2048, seed=32, corrupt=CORRUPT), folder / NAMES[1])
    for name in NAMES:
        upload(folder / name, f"s3://slides/archive/{name}")
    labels = folder / "labels.csv"
    labels.write_text(
        f"path,label\ns3://slides/archive/{NAMES[0]},normal\ns3://slides/archive/{NAMES[1]},tumour\n"
    )
    local_labels = folder / "local_labels.csv"
    local_labels.write_text(f"path,label\n{NAMES[0]},normal\n{NAMES[1]},tumour\n")
    return folder, labels, local_labels


@pytest.fixture(scope="module")
def indexes(bucket, tmp_path_factory: pytest.TempPathFactory) -> tuple[SlideIndex, SlideIndex]:  # type: ignore[no-untyped-def]
    folder, labels, local_labels = bucket
    out = tmp_path_factory.mktemp("idx")
    remote = build_index(["s3://slides/archive/"], out / "remote", labels=str(labels), **OPTIONS)
    local = build_index([folder], out / "local", labels=str(local_labels), **OPTIONS)
    return remote, local


def test_index_of_a_bucket_prefix_equals_the_local_index(indexes) -> None:  # type: ignore[no-untyped-def]
    remote, local = indexes
    assert [s.path for s in remote.slides] == [f"s3://slides/archive/{n}" for n in sorted(NAMES)]
    assert [s.status for s in remote.slides] == ["ok", "ok"]
    assert [s.label for s in remote.slides] == [s.label for s in local.slides]
    # the same bytes are the same slide wherever they live (splits compare this)
    # the same contents by size and ends (an object's TIFF directory is not read)
    assert [ends_digest(s.content or "") for s in remote.slides] == [
        ends_digest(s.content or "") for s in local.slides
    ]
    for name in ("slide_id", "l0_x", "l0_y", "level", "read_size", "tissue"):
        assert np.array_equal(remote.columns[name], local.columns[name])


def test_dataset_and_loaders_read_the_same_pixels(indexes) -> None:  # type: ignore[no-untyped-def]
    remote, local = indexes
    ds_remote, ds_local = TileDataset(remote), TileDataset(local)
    rows = np.arange(0, len(remote), 7)
    a, b = ds_remote.read_rows(rows), ds_local.read_rows(rows)
    assert np.array_equal(a.pixels, b.pixels) and np.array_equal(a.ok, b.ok)
    assert not a.ok.all()  # the corrupt tiles fail remotely exactly as locally
    assert ds_remote[int(rows[1])]["label"] == ds_local[int(rows[1])]["label"]


@pytest.mark.parametrize(("workers", "context"), [(0, None), (2, None), (2, "spawn")])
def test_make_loader_on_a_bucket(indexes, workers: int, context: str | None) -> None:  # type: ignore[no-untyped-def]
    remote, local = indexes
    seen = {}
    for index in (remote, local):
        loader = make_loader(
            index,
            batch_size=16,
            num_workers=workers,
            multiprocessing_context=context,
            seed=5,
            record_failures=False,
        )
        batches = list(loader)
        seen[index is remote] = (
            np.concatenate([b.images.numpy() for b in batches]),
            np.concatenate([b.ok.numpy() for b in batches]),
            np.concatenate([b.rows.numpy() for b in batches]),
        )
    for got, expected in zip(seen[True], seen[False], strict=True):
        assert np.array_equal(got, expected)


def test_export_and_features_on_a_bucket(indexes, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    remote, local = indexes
    outs = {}
    for name, index in (("remote", remote), ("local", local)):
        out = tmp_path / name
        export_index(index, out / "tiles", format="imagefolder")
        extract(index, "tests.feature_models:plain", out / "features", batch_size=32, workers=0)
        outs[name] = out
    tiles = sorted(p.relative_to(outs["local"]) for p in (outs["local"] / "tiles").rglob("*.png"))
    assert tiles and tiles == sorted(
        p.relative_to(outs["remote"]) for p in (outs["remote"] / "tiles").rglob("*.png")
    )
    for rel in tiles[:20]:
        assert (outs["remote"] / rel).read_bytes() == (outs["local"] / rel).read_bytes()
    for stem in (Path(n).stem for n in NAMES):
        with (
            h5py.File(outs["remote"] / "features" / f"{stem}.h5") as a,
            h5py.File(outs["local"] / "features" / f"{stem}.h5") as b,
        ):
            np.testing.assert_allclose(a["features"][:], b["features"][:], rtol=1e-6)
            assert np.array_equal(a["coords"][:], b["coords"][:])


def test_cli_index_of_a_bucket_with_the_aws_environment(
    s3_endpoint: str, bucket, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    out = tmp_path / "idx"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    result = subprocess.run(
        [sys.executable, "-m", "wsi_loader.cli", "index", "s3://slides/archive", "--out", str(out),
         "--tile-size", "256", "--level", "0", "--no-progress"],
        capture_output=True, text=True, env=env, timeout=300, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    index = SlideIndex.open(out)
    assert len(index.slides) == 2 and all(s.path.startswith("s3://") for s in index.slides)
    for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        assert os.environ[key] not in "".join(p.read_text() for p in out.rglob("*.json"))


def test_a_missing_object_or_unreachable_store_is_a_slide_fault(indexes, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    remote, _ = indexes
    gone = tmp_path / "gone"
    shutil.copytree(remote.path, gone)
    index = SlideIndex.open(gone)
    s3_fs().copy("slides/archive/bad (1).svs", "slides/moved/bad (1).svs")
    s3_fs().rm("slides/archive/bad (1).svs")
    try:
        with pytest.raises(SlideNotFoundError, match=r"bad \(1\)\.svs does not exist"):
            TileDataset(index)
        kept = TileDataset(index, missing_slides="exclude")
        assert len(kept) < len(index)
    finally:
        s3_fs().copy("slides/moved/bad (1).svs", "slides/archive/bad (1).svs")
        s3_fs().invalidate_cache()


def test_index_reads_only_the_header_and_lowest_level(
    make_slide: SlideFactory, tmp_path: Path
) -> None:
    root = tmp_path / "www"
    root.mkdir()
    local = make_slide(width=12000, height=9000, seed=12)
    shutil.copy(local, root / "big.svs")
    stats = tmp_path / "stats.json"
    with http_files(root) as server, delay_proxy(server.port, 0, stats) as proxy:
        index = build_index([f"{proxy.url}/big.svs"], tmp_path / "idx", tile_size=256, mpp=0.5)
        fetched = proxy_stats(proxy, stats)["bytes_to_client"]
    assert index.slides[0].status == "ok" and len(index) > 0
    assert fetched < 0.15 * local.stat().st_size, (fetched, local.stat().st_size)


def test_a_tile_whose_requests_keep_failing_is_a_failed_tile(
    make_slide: SlideFactory, tmp_path: Path
) -> None:
    root = tmp_path / "www"
    root.mkdir()
    shutil.copy(make_slide(width=2560, height=2048, seed=31), root / "s.svs")
    with http_files(root) as server:
        index = build_index([f"{server.url}/s.svs"], tmp_path / "idx", **OPTIONS)
        ds = TileDataset(index, retries=1)
        reader = ds.reader.get_reader(0)
        first = reader.byte_ranges((0, 0, 0, 256, 256), 256)[0]  # type: ignore[attr-defined]
        (root / ".faults.json").write_text(
            json.dumps({f"bytes={first[0]}-": {"status": 500, "times": -1}})
        )
        result = ds.read_rows(np.array([0, 1]))
        assert result.ok.tolist() == [False, True]
        assert "500" in (result.errors[0] or "")
        assert [f["kind"] for f in ds.reader.failures] == ["tile"]
        assert [r["row"] for r in index.quarantine.tile_records()] == [0]
        # the whole server failing mid-epoch is a slide fault: reported, nothing quarantined
        later = TileDataset(index, retries=0)
        (root / ".faults.json").write_text(json.dumps({"/s.svs": {"status": 503, "times": -1}}))
        result = later.read_rows(np.array([5, 6]))
        assert not result.ok.any() and "503" in (result.errors[0] or "")
        assert [r["row"] for r in index.quarantine.tile_records()] == [0]
        # and at start, a loud error naming the slide and why
        with pytest.raises(SlideNotFoundError, match=r"s\.svs cannot be reached \(.*503"):
            TileDataset(index)


def test_forked_workers_read_remote_slides_after_the_parent_did(indexes) -> None:  # type: ignore[no-untyped-def]
    """Remote clients are made in each process when first used: a worker forked after its
    parent read remote tiles reads its own (right) pixels, and make_loader keeps the start
    method it uses for local slides."""
    from torch.utils.data import DataLoader

    remote, local = indexes
    ds = TileDataset(remote, record_failures=False)
    first = ds.read_rows(np.arange(8))  # the main process reads remote tiles first
    assert first.ok.all()
    loader = make_loader(ds, batch_size=8, num_workers=2, seed=0, persistent_workers=False)
    local_loader = make_loader(local, batch_size=8, num_workers=2, seed=0)
    assert loader.multiprocessing_context is local_loader.multiprocessing_context is None
    got, expected = (
        {int(r): img for b in lo for r, img in zip(b.rows, b.images.numpy(), strict=True)}
        for lo in (loader, local_loader)
    )
    assert len(got) == len(expected) == len(local)
    for row, image in got.items():
        assert np.array_equal(image, expected[row])
    own = DataLoader(ds, batch_size=8, num_workers=1, multiprocessing_context="fork", timeout=120)
    assert sum(len(batch["image"]) for batch in own) == len(ds)


NO_MAIN_GUARD = """
from wsi_loader.dataset import make_loader
from wsi_loader.index import SlideIndex
import sys

loader = make_loader(SlideIndex.open(sys.argv[1]), batch_size=8, num_workers=2, seed=0)
print("tiles", sum(int(batch.ok.sum()) for batch in loader))
"""


def test_a_script_without_a_main_guard_streams_remote_slides(indexes, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    remote, local = indexes
    script = tmp_path / "train.py"
    script.write_text(NO_MAIN_GUARD)
    done = subprocess.run(
        [sys.executable, str(script), str(remote.path)], capture_output=True, text=True,
        timeout=300, check=False, cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(REPO)},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    ok = int(TileDataset(local, record_failures=False).read_rows(np.arange(len(local))).ok.sum())
    assert done.stdout.split() == ["tiles", str(ok)]


def test_short_answers_are_retried_never_slide_or_tile_faults(
    make_slide: SlideFactory, tmp_path: Path
) -> None:
    """A body shorter than the range asked for is the transport's fault: retried, and when it
    keeps coming short, a transient error; never a failed tile recorded in the quarantine,
    and never "the object is not the slide that was indexed"."""
    root = tmp_path / "www"
    root.mkdir()
    slide = make_slide(width=2560, height=2048, seed=31)
    shutil.copy(slide, root / "s.svs")
    local = build_index([slide], tmp_path / "local", **OPTIONS)
    expected = TileDataset(local, record_failures=False).read_rows(np.arange(len(local)))
    faults = root / ".faults.json"
    with http_files(root) as server:
        index = build_index([f"{server.url}/s.svs"], tmp_path / "idx", **OPTIONS)
        faults.write_text(json.dumps({"bytes=": {"status": "short", "times": 6}}))
        result = TileDataset(index).read_rows(np.arange(len(index)))
        assert result.ok.all(), result.errors
        assert np.array_equal(result.pixels, expected.pixels)
        faults.write_text(json.dumps({"bytes=": {"status": "short", "times": -1}}))
        ds = TileDataset(index, retries=1)
        result = ds.read_rows(np.arange(4))
        assert not result.ok.any()
        assert "short" in (result.errors[0] or "") and "indexed" not in (result.errors[0] or "")
        assert {f["kind"] for f in ds.reader.failures} == {"transient"}
        assert index.quarantine.tile_records() == []
        faults.write_text("{}")
        assert TileDataset(index).read_rows(np.arange(4)).ok.all()


def test_bench_on_a_remote_index(indexes, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """`wsi-loader bench` on slides in a bucket: OpenSlide cannot open URLs, so the
    OpenSlide baselines read local copies (as OpenSlide users must), and are named so."""
    from wsi_loader.device._bench import format_table, run_bench
    from wsi_loader.slides.storage._local_copies import LocalCopies

    remote, _ = indexes
    copies = LocalCopies(str(tmp_path / "copies"))
    result = run_bench(remote, tiles=64, batch_size=16, workers=(0,), copies=copies)
    names = [r["name"] for r in result["results"]]
    assert names[:2] == ["openslide (local copy)", "openslide-naive (local copy)"]
    assert all(r["tiles_per_s"] > 0 for r in result["results"])
    assert "local copy" in format_table(result)
    assert copies.downloads == 2  # once per slide, for both baselines
    # the range store's line: a second pass over the same tiles asks the bucket for nothing
    first, second = result["remote_ranges"]["passes"]
    assert first["gets_per_tile"] > 0 and first["kb_per_tile"] > 0
    assert second["gets_per_tile"] == 0 and second["hit_rate"] == 1.0
    assert "remote ranges, pass 2" in format_table(result)


def test_an_object_rewritten_in_the_middle_is_refused_not_read(
    s3_endpoint: str, make_slide: SlideFactory, tmp_path: Path
) -> None:
    """Same key, same size, same first and last 64 KiB, other tiles in between: the object's
    version (ETag) changed, so its tiles are a slide fault, never the new pixels as ok."""
    local = tmp_path / "Präparat Nr.2 (a).svs"
    shutil.copy(make_slide(width=2560, height=2048, seed=41), local)
    url = upload(local, f"s3://slides/rewritten/{local.name}")
    index = build_index([url], tmp_path / "idx", **OPTIONS)
    assert index.slides[0].status == "ok"
    data = bytearray(local.read_bytes())
    middle = len(data) // 2
    data[middle : middle + 4096] = bytes(4096)  # inside tile data, away from head and tail
    local.write_bytes(bytes(data))
    upload(local, url)
    result = TileDataset(index, record_failures=False).read_rows(np.arange(len(index)))
    assert not result.ok.any()
    assert "indexed" in (result.errors[0] or "")


def test_a_flipped_bit_in_the_head_is_retried_not_a_rewritten_slide(
    make_slide: SlideFactory, tmp_path: Path
) -> None:
    """A bit flipped on the way (plain http, no TLS) in the first 64 KiB that the slide's
    fingerprint covers: the slide used to be declared rewritten (a slide fault). The object's
    size and date are the indexed ones, so it is a transient read error, retried, and the
    tiles are read."""
    root = tmp_path / "www"
    root.mkdir()
    slide = make_slide(width=2560, height=2048, seed=31)
    shutil.copy(slide, root / "s.svs")
    local = build_index([slide], tmp_path / "local", **OPTIONS)
    expected = TileDataset(local, record_failures=False).read_rows(np.arange(4))
    faults = root / ".faults.json"
    with http_files(root) as server:
        index = build_index([f"{server.url}/s.svs"], tmp_path / "idx", **OPTIONS)
        faults.write_text(json.dumps({"bytes=0-65535": {"status": "flip", "times": -1}}))
        ds = TileDataset(index, retries=1)
        result = ds.read_rows(np.arange(4))
        assert not result.ok.any()
        assert "rewritten" not in (result.errors[0] or ""), result.errors
        assert {f["kind"] for f in ds.reader.failures} == {"transient"}
        assert index.quarantine.slide_records() == []
        faults.write_text(json.dumps({"bytes=0-65535": {"status": "flip", "times": 2}}))
        result = TileDataset(index).read_rows(np.arange(4))
        assert result.ok.all(), result.errors
        assert np.array_equal(result.pixels, expected.pixels)
        assert index.quarantine.slide_records() == []
        # a slide rewritten for real (another size and date) is still said to be
        faults.write_text("{}")
        later = TileDataset(index, record_failures=False)
        with (root / "s.svs").open("ab") as fh:
            fh.write(b"\0" * 1024)
        os.utime(root / "s.svs", (1e9, 1e9))
        result = later.read_rows(np.arange(2))
        assert not result.ok.any() and "rewritten" in (result.errors[0] or ""), result.errors


def test_an_answer_for_another_range_is_retried(make_slide: SlideFactory, tmp_path: Path) -> None:
    """A 206 whose Content-Range is not the range asked (a confused cache or proxy) is the
    transport's fault: retried, never decoded as the tile's bytes."""
    root = tmp_path / "www"
    root.mkdir()
    slide = make_slide(width=2560, height=2048, seed=31)
    shutil.copy(slide, root / "s.svs")
    local = build_index([slide], tmp_path / "local", **OPTIONS)
    expected = TileDataset(local, record_failures=False).read_rows(np.arange(len(local)))
    faults = root / ".faults.json"
    with http_files(root) as server:
        index = build_index([f"{server.url}/s.svs"], tmp_path / "idx", **OPTIONS)
        faults.write_text(json.dumps({"bytes=": {"status": "wrong-range", "times": -1}}))
        ds = TileDataset(index, retries=0)
        result = ds.read_rows(np.arange(4))
        assert not result.ok.any()
        assert "Content-Range" in (result.errors[0] or ""), result.errors
        assert {f["kind"] for f in ds.reader.failures} == {"transient"}
        assert index.quarantine.tile_records() == [] == index.quarantine.slide_records()
        faults.write_text(json.dumps({"bytes=": {"status": "wrong-range", "times": 4}}))
        result = TileDataset(index, record_failures=False).read_rows(np.arange(len(index)))
        assert json.loads(faults.read_text())["bytes="]["times"] == 0
        assert result.ok.all(), result.errors
        assert np.array_equal(result.pixels, expected.pixels)


@pytest.mark.timeout(600)
def test_a_store_that_stops_answering_fails_reads_with_one_warning(
    make_slide: SlideFactory, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Every request accepted and never answered: each read gives up at the request deadline
    (``remote_timeout_s``) as a transient read error naming the endpoint, and one WARNING
    says the store stopped answering (it used to be one batch every ~90 s, silently)."""
    root = tmp_path / "www"
    root.mkdir()
    shutil.copy(make_slide(width=2560, height=2048, seed=31), root / "s.svs")
    faults = root / ".faults.json"
    with http_files(root) as server:
        index = build_index([f"{server.url}/s.svs"], tmp_path / "idx", **OPTIONS)
        ds = TileDataset(index, retries=0, remote_timeout_s=1, record_failures=False)
        assert ds.reader.pool.store.deadline_s == 1
        assert ds.read_rows(np.arange(2)).ok.all()
        faults.write_text(json.dumps({"": {"status": "stall", "times": -1}}))
        with caplog.at_level("WARNING", logger="wsi_loader.slides.storage._sources"):
            for rows in (np.arange(8, 10), np.arange(12, 14)):
                result = ds.read_rows(rows)
                assert not result.ok.any()
                assert f"127.0.0.1:{server.port}" in (result.errors[0] or ""), result.errors
                assert "no answer" in (result.errors[0] or "")
        assert {f["kind"] for f in ds.reader.failures} == {"transient"}
        said = [r.getMessage() for r in caplog.records if "stopped answering" in r.getMessage()]
        assert len(said) == 1 and f"127.0.0.1:{server.port}" in said[0]
        faults.write_text("{}")
