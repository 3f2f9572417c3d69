"""Slides on object storage: make_loader from S3 at 0, 5 and 20 ms per request against the
local file, and tiffslide over fsspec (the peer that reads remote slides) at the same latencies.

    .venv/bin/python benchmarks/bench_remote.py [--tiles 2048] [--latencies 0,5,20] [--scratch DIR]
        [--workers 2] [--reader-cpus 0 --bucket-cpus 1]
    .venv/bin/python benchmarks/bench_remote.py --regimes [--server nginx]   # see regimes()
    .venv/bin/python benchmarks/bench_remote.py --request-cpu   # see request_cpu()

Set-up, all on 127.0.0.1 (tests/servers.py): one S3 endpoint per latency serving a synthetic
20k x 15k Aperio slide as ``s3://bench/slide.svs``, answering every request that many ms late
(a bucket in the same region: 5-20 ms). The endpoint speaks the read side of the S3 API (HEAD,
ranged GET) in a small asyncio server, not moto: moto spends ~60 ms of CPU per range
request to a 60 MB object, on the same two cores as the reader, so a benchmark through it
measures moto. Every pass runs in a fresh process (its own S3 client, reaching the bucket
through ``AWS_ENDPOINT_URL``, as a user's job does), reads the same random aligned 256 px
tiles with 2 DataLoader workers (--workers), batch 64, and is timed after its first batch (worker
start-up, slide open). Passes are interleaved and repeated (--repeats, 4, best of: a pass is
under half a second, and with 2 the cold/warm ratio of one build ranged 0.86-0.99x).

* local warm: the file in the page cache; local cold: ``posix_fadvise(DONTNEED)`` first;
* s3 N ms: make_loader on an index of ``s3://bench/slide.svs`` (look-ahead ``prefetch=2``);
* tiffslide N ms: ``tiffslide.TiffSlide(url)`` per worker, ``read_region`` per item (fsspec's
  default read-ahead file), default collate: how remote slides are read today.

Requests per tile and bytes fetched per byte used are counted at the endpoint (responses with
their headers) against the compressed tile bytes the pass needs. CPU columns: the pass's own
processes, and the endpoint's: on this 2-core machine the emulated bucket runs on the same
cores as the reader, which a real bucket does not. ``--reader-cpus 0 --bucket-cpus 1
--workers 1`` keeps them apart (every pass, local ones included, on core 0; the buckets on
core 1): the comparison a machine with a remote bucket makes.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import tifffile

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # tests.servers

from common import scratch_folder, synthetic_slide  # noqa: E402

from tests.servers import (  # noqa: E402
    Server,
    delay_proxy,
    nginx_files,
    nginx_stats,
    proxy_stats,
    s3_files,
)

S3_ENV = {
    "AWS_ACCESS_KEY_ID": "bench",
    "AWS_SECRET_ACCESS_KEY": "bench",
    "AWS_DEFAULT_REGION": "us-east-1",
}
URL = "s3://bench/slide.svs"
BATCH = 64
WORKERS = 2  # DataLoader workers per pass (--workers)


def cpu_seconds(pid: int) -> float:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


# -- one pass, in a fresh process --------------------------------------------------------------
def child(
    kind: str,
    index_dir: str,
    rows_file: str,
    url: str,
    workers: str = str(WORKERS),
    epochs: str = "1",
) -> dict[str, float]:
    """One pass: ``kind`` "ours", "tiffslide" (fsspec's default file for ``url``), or, for the
    regimes, "s3fs-default" / "s3fs-none" (tiffslide over s3fs with its default block cache /
    without a cache, each slide of the index opened by its own URL); ``epochs`` passes over
    the rows, timed after the first batch."""
    import multiprocessing

    import torch
    from torch.utils.data import DataLoader, Dataset

    from wsi_loader.dataset import make_loader
    from wsi_loader.index import SlideIndex

    rows = np.load(rows_file).tolist()
    index = SlideIndex.open(index_dir)
    if kind == "ours":
        loader: Any = make_loader(
            index, batch_size=BATCH, sampler=rows, num_workers=int(workers), record_failures=False
        )
    else:
        import tiffslide

        cols = index.columns
        paths = [index.slide_path(sid) for sid in range(len(index.slides))]

        def open_slide(sid: int) -> Any:
            if kind == "tiffslide":
                return tiffslide.TiffSlide(url)
            cache = {"cache_type": "none"} if kind.endswith("-none") else {}
            if kind.startswith("http-"):  # fsspec's HTTP file (aiohttp), default 5 MB blocks
                import fsspec

                return tiffslide.TiffSlide(fsspec.filesystem("http").open(paths[sid], **cache))
            import s3fs

            fs = s3fs.S3FileSystem()
            key = paths[sid].removeprefix("s3://")
            return tiffslide.TiffSlide(fs.open(key, "rb", **cache))

        class TiffslideTiles(Dataset[dict[str, Any]]):
            def __init__(self) -> None:
                self.slides: dict[int, Any] = {}

            def __len__(self) -> int:
                return len(index)

            def __getitem__(self, i: int) -> dict[str, Any]:
                sid = int(cols["slide_id"][i])
                if sid not in self.slides:
                    self.slides[sid] = open_slide(sid)
                x, y = int(cols["l0_x"][i]), int(cols["l0_y"][i])
                pixels = self.slides[sid].read_region((x, y), 0, (256, 256), as_array=True)
                return {"image": torch.from_numpy(np.ascontiguousarray(pixels[..., :3]))}

        loader = DataLoader(
            TiffslideTiles(),
            batch_size=BATCH,
            sampler=rows,
            num_workers=int(workers),
            persistent_workers=int(workers) > 0,
        )
    iterator = iter(loader)
    next(iterator)  # workers started, slide opened
    pids = [p.pid for p in multiprocessing.active_children() if p.pid]
    cpu0 = time.process_time() + sum(cpu_seconds(p) for p in pids)
    last = {p: cpu_seconds(p) for p in pids}
    start, seen = time.perf_counter(), 0
    for epoch in range(int(epochs)):
        for batch in iterator if epoch == 0 else iter(loader):
            seen += len(batch) if kind == "ours" else len(batch["image"])
            last = {p: cpu_seconds(p) or last[p] for p in pids}
    wall = time.perf_counter() - start
    cpu = time.process_time() + sum(last.values()) - cpu0
    return {"tiles_per_s": seen / wall, "cpu_us": cpu / seen * 1e6, "tiles": seen}


# -- the driver ---------------------------------------------------------------------------------
def tile_bytes(slide: Path, index: Any, rows: np.ndarray) -> int:
    """Compressed bytes of the level-0 storage tiles the rows read."""
    with tifffile.TiffFile(slide) as tif:
        page = tif.pages[0]
        counts = np.asarray(page.databytecounts)
        across = -(-page.imagewidth // page.tilewidth)
    cols = index.columns
    tiles = (cols["l0_y"][rows] // 256) * across + cols["l0_x"][rows] // 256
    return int(counts[tiles].sum())


def run_pass(
    kind: str,
    index_dir: Path,
    rows_file: Path,
    url: str,
    endpoint: str | None,
    workers: int,
    cpus: set[int] | None = None,
    epochs: int = 1,
) -> dict[str, float]:
    env = {**os.environ, **S3_ENV, "PYTHONPATH": str(REPO)}
    if endpoint:
        env["AWS_ENDPOINT_URL"] = endpoint
    code = (
        "import json, sys; sys.path.insert(0, 'benchmarks'); from bench_remote import child; "
        "print(json.dumps(child(*sys.argv[1:])))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code, kind, str(index_dir), str(rows_file), url, str(workers),
         str(epochs)],
        env=env, capture_output=True, text=True, cwd=REPO, check=False, timeout=1200,
        preexec_fn=(lambda: os.sched_setaffinity(0, cpus)) if cpus else None,
    )  # fmt: skip
    if result.returncode:
        raise RuntimeError(f"{kind} pass failed:\n{result.stderr[-3000:]}")
    out: dict[str, float] = json.loads(result.stdout.strip().splitlines()[-1])
    return out


def drop_page_cache(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def warm_page_cache(path: Path) -> None:
    with open(path, "rb") as fh:
        while fh.read(1 << 24):
            pass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tiles", type=int, default=2048, help="tiles per pass (ours)")
    parser.add_argument("--peer-tiles", type=int, default=512, help="tiles per tiffslide pass")
    parser.add_argument("--latencies", default="0,5,20", help="ms per request, comma-separated")
    parser.add_argument("--repeats", type=int, default=4, help="interleaved rounds, best of")
    parser.add_argument(
        "--workers",
        type=int,
        default=WORKERS,
        help="DataLoader workers per pass; 1 leaves a core of this 2-core machine to the "
        "network client and the emulated bucket",
    )
    parser.add_argument(
        "--reader-cpus",
        help="run every pass on these cores only (e.g. 0), its workers included",
    )
    parser.add_argument(
        "--bucket-cpus",
        help="run the emulated buckets on these cores only (e.g. 1): with --reader-cpus, a "
        "bucket that does not take the reader's cores, as a real one does not",
    )
    parser.add_argument("--scratch")
    parser.add_argument("--regimes", action="store_true", help="dense and sparse regimes")
    parser.add_argument("--big-width", type=int, default=80_000, help="~1 GB at 80,000 px")
    parser.add_argument("--archive-width", type=int, default=30_000)
    parser.add_argument("--archive-slides", type=int, default=4)
    parser.add_argument("--dense-tiles", type=int, default=2048)
    parser.add_argument("--sparse-tiles", type=int, default=2048)
    parser.add_argument("--peer-sparse-tiles", type=int, default=256)
    parser.add_argument("--peer-sparse-default", type=int, default=64)
    parser.add_argument("--regime-latency", type=float, default=20)
    parser.add_argument("--keep", action="store_true", help="keep the generated slides")
    parser.add_argument(
        "--request-cpu",
        action="store_true",
        help="CPU of one range request on the read path, without decoding (see request_cpu)",
    )
    parser.add_argument(
        "--server",
        choices=("s3", "nginx"),
        default="s3",
        help="regimes: s3 (tests.servers.s3_files; peer tiffslide over s3fs) or nginx "
        "(https; peer tiffslide over fsspec's HTTP file)",
    )
    args = parser.parse_args()
    args.reader_cpus = _cpus(args.reader_cpus)
    args.bucket_cpus = _cpus(args.bucket_cpus)
    if args.regimes:
        regimes(args)
        return
    if args.request_cpu:
        request_cpu(args)
        return
    latencies = [float(v) for v in args.latencies.split(",")]

    from wsi_loader.index import build_index

    scratch = scratch_folder(args.scratch, "wsi-bench-remote-")
    slide = synthetic_slide(scratch / "slide.svs", seed=5, mpp=0.5)
    options = {"tile_size": 256, "level": 0, "min_tissue": 0.5}
    local = build_index([slide], scratch / "local", **options)
    rng = np.random.default_rng(0)
    rows = rng.permutation(len(local))[: args.tiles + BATCH]
    peer_rows = rows[: args.peer_tiles + BATCH]
    np.save(scratch / "rows.npy", rows)
    np.save(scratch / "peer_rows.npy", peer_rows)
    used = tile_bytes(slide, local, rows[BATCH:])
    peer_used = tile_bytes(slide, local, peer_rows[BATCH:])

    bucket = scratch / "bucket" / "bench"
    bucket.mkdir(parents=True, exist_ok=True)
    if not (bucket / "slide.svs").exists():
        os.link(slide, bucket / "slide.svs")
    stats = scratch / "stats.json"
    servers: dict[float, Server] = {}
    contexts = []
    try:
        for ms in latencies:
            ctx = s3_files(scratch / "bucket", ms, stats.with_suffix(f".{ms:g}.json"))
            servers[ms] = ctx.__enter__()
            contexts.append(ctx)
            if args.bucket_cpus:
                os.sched_setaffinity(servers[ms].proc.pid, args.bucket_cpus)
        os.environ.update(S3_ENV, AWS_ENDPOINT_URL=servers[latencies[0]].url)
        remote = build_index([URL], scratch / "remote", **options)
        assert np.array_equal(remote.columns["l0_x"], local.columns["l0_x"])
        results = measure(args, scratch, local.path, remote.path, servers, stats, used, peer_used)
    finally:
        for ctx in contexts:
            ctx.__exit__(None, None, None)
    report(results, latencies)


def _cpus(text: str | None) -> set[int] | None:
    """ "0,2-3" -> {0, 2, 3}."""
    if not text:
        return None
    cpus: set[int] = set()
    for part in text.split(","):
        first, _, last = part.partition("-")
        cpus.update(range(int(first), int(last or first) + 1))
    return cpus


def measure(
    args: argparse.Namespace,
    scratch: Path,
    local_dir: Path,
    remote_dir: Path,
    servers: dict[float, Server],
    stats: Path,
    used: int,
    peer_used: int,
) -> dict[str, dict[str, float]]:
    rows_file, peer_file = scratch / "rows.npy", scratch / "peer_rows.npy"
    slide = scratch / "slide.svs"
    best: dict[str, dict[str, float]] = {}
    cpus = args.reader_cpus

    def keep(name: str, result: dict[str, float]) -> None:
        old = best.get(name)
        if old is None or result["tiles_per_s"] > old["tiles_per_s"]:
            best[name] = result

    for _ in range(args.repeats):
        warm_page_cache(slide)
        keep("local warm", run_pass("ours", local_dir, rows_file, URL, None, args.workers, cpus))
        drop_page_cache(slide)
        keep("local cold", run_pass("ours", local_dir, rows_file, URL, None, args.workers, cpus))
        warm_page_cache(slide)
        for ms, server in servers.items():
            for kind, rows, name, tiles_used in (
                ("ours", rows_file, f"s3 {ms:g} ms", used),
                ("tiffslide", peer_file, f"tiffslide {ms:g} ms", peer_used),
            ):
                stat_file = stats.with_suffix(f".{ms:g}.json")
                before = proxy_stats(server, stat_file)
                server_cpu = cpu_seconds(server.proc.pid)
                result = run_pass(kind, remote_dir, rows, URL, server.url, args.workers, cpus)
                after = proxy_stats(server, stat_file)
                server_cpu = cpu_seconds(server.proc.pid) - server_cpu
                tiles = result["tiles"] + BATCH  # the counters include the first batch
                result["requests_per_tile"] = (after["requests"] - before["requests"]) / tiles
                fetched = after["bytes_to_client"] - before["bytes_to_client"]
                result["fetched_per_used"] = fetched / (tiles_used * tiles / result["tiles"])
                result["server_cpu_us"] = server_cpu / tiles * 1e6
                keep(name, result)
    return best


def report(best: dict[str, dict[str, float]], latencies: list[float]) -> None:
    base = best["local warm"]["tiles_per_s"]
    print(f"{'path':<18} {'tiles/s':>8} {'vs warm':>8} {'CPU us/tile':>12} "
          f"{'server us':>10} {'GETs/tile':>9} {'fetched/used':>13}")  # fmt: skip
    for name, r in best.items():
        extra = (
            f" {r['server_cpu_us']:10.0f} {r['requests_per_tile']:9.2f} "
            f"{r['fetched_per_used']:13.2f}"
            if "requests_per_tile" in r
            else f" {'-':>10} {0:9.2f} {'-':>13}"  # a local pass makes no GETs
        )
        print(
            f"{name:<18} {r['tiles_per_s']:8.0f} {r['tiles_per_s'] / base:7.2f}x "
            f"{r['cpu_us']:12.0f}{extra}"
        )
    print()
    cold = best["local cold"]["tiles_per_s"] / base
    print(f"local cold / warm: {cold:.2f}x (target >= 0.9)")
    for ms in latencies:
        ours, peer = best[f"s3 {ms:g} ms"], best[f"tiffslide {ms:g} ms"]
        print(
            f"{ms:g} ms: s3 / local warm {ours['tiles_per_s'] / base:.2f}x (target at 20 ms "
            f">= 0.8), s3 / tiffslide {ours['tiles_per_s'] / peer['tiles_per_s']:.1f}x "
            "(target at 20 ms >= 5)"
        )


# -- what one range request costs the reader ------------------------------------------------------
def request_child(url: str, count: str, mode: str) -> dict[str, float]:
    """``count`` random ranges of 15-35 KB, 64 KB apart at least, in batches of 64: "planned",
    the reader's path (each batch's look-ahead planned two batches ahead through the range
    store, then every range read), or "libcurl", the same requests straight through
    `_curl.Transfers`, a batch at a time. CPU per range after four warm-up batches."""
    from wsi_loader.slides.storage._range_cache import RangeStore
    from wsi_loader.slides.storage._sources import RemoteBytes

    store = RangeStore()
    source = RemoteBytes(url, store)
    client: Any = source._client  # the libcurl path alone
    rng = np.random.default_rng(1)
    n = int(count)
    offsets = (rng.integers(0, source.size // 65536 - 1, n) * 65536).tolist()
    sizes = rng.integers(15_000, 35_000, n).tolist()
    pairs = list(zip(offsets, sizes, strict=True))
    batches = [pairs[i : i + 64] for i in range(0, n, 64)]

    def run(part: list[list[tuple[int, int]]]) -> None:
        for i, batch in enumerate(part):
            if mode == "planned":
                for ahead in part[i + 1 : i + 3]:
                    source.prefetch(ahead)
                for offset, size in batch:
                    source.read(offset, size)
            else:
                futures = [client.submit(url, o, s, source.stat.etag) for o, s in batch]
                for future in futures:
                    future.result()

    run(batches[:4])
    cpu, requests = time.process_time(), store.requests
    run(batches[4:])
    ranges = sum(len(b) for b in batches[4:])
    return {
        "cpu_us": (time.process_time() - cpu) / ranges * 1e6,
        "requests_per_range": (store.requests - requests) / ranges if mode == "planned" else 1.0,
    }


def request_cpu(args: argparse.Namespace) -> None:
    """``--request-cpu``: the CPU one range request costs the reader, decoding left out, against
    `tests.servers.s3_files` (+``--regime-latency`` ms) on ``--bucket-cpus``, the reader on
    ``--reader-cpus``; ``--tiles`` ranges of a 2 GB object (a sparse file), best of
    ``--repeats``. The sparse regime's reader pays this per tile on top of the decode."""
    scratch = scratch_folder(args.scratch, "wsi-bench-request-")
    bucket = scratch / "bucket" / "bench"
    bucket.mkdir(parents=True, exist_ok=True)
    with open(bucket / "big.bin", "wb") as fh:
        fh.truncate(2000 * 2**20)
    best: dict[str, dict[str, float]] = {}
    with s3_files(scratch / "bucket", args.regime_latency, scratch / "stats.json") as server:
        if args.bucket_cpus:
            os.sched_setaffinity(server.proc.pid, args.bucket_cpus)
        env = {**os.environ, **S3_ENV, "PYTHONPATH": str(REPO), "AWS_ENDPOINT_URL": server.url}
        code = (
            "import json, sys; sys.path.insert(0, 'benchmarks'); "
            "from bench_remote import request_child; "
            "print(json.dumps(request_child(*sys.argv[1:])))"
        )
        for _ in range(args.repeats):
            for mode in ("planned", "libcurl"):
                result = subprocess.run(
                    [sys.executable, "-c", code, "s3://bench/big.bin", str(args.tiles), mode],
                    env=env, capture_output=True, text=True, cwd=REPO, check=True, timeout=600,
                    preexec_fn=(lambda: os.sched_setaffinity(0, args.reader_cpus))
                    if args.reader_cpus else None,
                )  # fmt: skip
                out = json.loads(result.stdout.strip().splitlines()[-1])
                if mode not in best or out["cpu_us"] < best[mode]["cpu_us"]:
                    best[mode] = out
    print(f"one range request at +{args.regime_latency:g} ms, {args.tiles} ranges, best of "
          f"{args.repeats}")  # fmt: skip
    for mode, out in best.items():
        print(f"{mode:<8} {out['cpu_us']:6.0f} us CPU per range, "
              f"{out['requests_per_range']:.2f} requests per range")  # fmt: skip
    if not args.keep:
        shutil.rmtree(scratch, ignore_errors=True)


# -- dense and sparse regimes on realistic sizes -----------------------------------------------
def regimes(args: argparse.Namespace) -> None:
    """``--regimes``: a ~1 GB slide and an archive of several, behind one S3 endpoint at
    ``--regime-latency`` ms (`tests.servers.s3_files`: it answers a range by ``pread`` of
    that range only, as a bucket does, unlike moto, which copies the whole object for every
    GET: 137 ms of CPU per GET on a 253 MB object).

    * dense: ``--dense-tiles`` neighbouring tissue tiles of the big slide, 3 epochs;
    * sparse: ``--sparse-tiles`` random tiles across the archive, one epoch (the peers read
      fewer: ``--peer-sparse-tiles``; s3fs's default cache pulls 50 MB blocks per tile).

    Each line: tiles/s, ratio to local warm (the same rows from the files on disk), GETs
    and bytes per tile counted at the endpoint, and client CPU per tile."""
    from wsi_loader.index import build_index

    scratch = scratch_folder(args.scratch, "wsi-bench-regimes-")
    archive = scratch / "bucket" / "bench"
    archive.mkdir(parents=True, exist_ok=True)
    print(f"generating slides in {archive} ...", flush=True)
    big = synthetic_slide(archive / "big.svs", width=args.big_width, seed=11, mpp=0.5)
    others = [
        synthetic_slide(archive / f"case-{i}.svs", width=args.archive_width, seed=20 + i, mpp=0.5)
        for i in range(args.archive_slides)
    ]
    slides = [big, *others]
    sizes = {p.name: p.stat().st_size for p in slides}
    print("slides:", ", ".join(f"{n} {v / 1e6:.0f} MB" for n, v in sizes.items()), flush=True)
    options = {"tile_size": 256, "level": 0, "min_tissue": 0.5}
    local = build_index(slides, scratch / "local", **options)
    rng = np.random.default_rng(0)
    big_rows = np.flatnonzero(local.columns["slide_id"] == 0)
    middle = len(big_rows) // 2
    dense = big_rows[middle : middle + args.dense_tiles]
    sparse = rng.permutation(len(local))[: args.sparse_tiles]
    results: list[tuple[str, str, dict[str, float]]] = []
    with contextlib.ExitStack() as stack:
        counts, urls, endpoint, peer = _serve(args, scratch, slides, stack)
        remote = build_index(urls, scratch / "remote", **options)
        assert np.array_equal(remote.columns["l0_x"], local.columns["l0_x"])
        plans = [
            ("dense", dense, 3, [("ours", dense), (f"{peer}-default", dense),
                                 (f"{peer}-none", dense)]),
            ("sparse", sparse, 1, [
                ("ours", sparse),
                (f"{peer}-default", sparse[: args.peer_sparse_default + BATCH]),
                (f"{peer}-none", sparse[: args.peer_sparse_tiles + BATCH]),
            ]),
        ]  # fmt: skip
        for regime, rows, epochs, passes in plans:
            rows_file = scratch / f"{regime}.npy"
            np.save(rows_file, rows)
            warm_page_cache_all(slides)
            base = run_pass("ours", local.path, rows_file, "", None, args.workers,
                            args.reader_cpus, epochs)  # fmt: skip
            results.append((regime, "local warm", base))
            for kind, kind_rows in passes:
                kind_file = scratch / f"{regime}-{kind}.npy"
                np.save(kind_file, kind_rows)
                before = counts()
                result = run_pass(kind, remote.path, kind_file, "", endpoint, args.workers,
                                  args.reader_cpus, epochs)  # fmt: skip
                after = counts()
                tiles = (len(kind_rows)) * epochs
                result["gets_per_tile"] = (after["requests"] - before["requests"]) / tiles
                result["bytes_per_tile"] = (
                    after["bytes_to_client"] - before["bytes_to_client"]
                ) / tiles
                result["vs_local"] = result["tiles_per_s"] / base["tiles_per_s"]
                results.append((regime, kind, result))
                print(f"  {regime:<7} {kind:<13} {result['tiles_per_s']:8.0f} tiles/s, "
                      f"{result['gets_per_tile']:.3f} GETs/tile", flush=True)  # fmt: skip
    report_regimes(results, args, peer)
    if not args.keep:
        shutil.rmtree(scratch, ignore_errors=True)


def _serve(
    args: argparse.Namespace, scratch: Path, slides: list[Path], stack: contextlib.ExitStack
) -> tuple[Any, list[str], str | None, str]:
    """Start the server of ``--server`` (kept off the reader's cores with --bucket-cpus):
    (request counters, slide URLs, S3 endpoint or None, the peer's name)."""
    stats = scratch / "stats.json"
    if args.server == "s3":
        server = stack.enter_context(s3_files(scratch / "bucket", args.regime_latency, stats))
        if args.bucket_cpus:
            os.sched_setaffinity(server.proc.pid, args.bucket_cpus)
        os.environ.update(S3_ENV, AWS_ENDPOINT_URL=server.url)
        urls = [f"s3://bench/{p.name}" for p in slides]
        return (lambda: proxy_stats(server, stats)), urls, server.url, "s3fs"
    folder = scratch / "nginx"
    nginx = stack.enter_context(nginx_files(scratch / "bucket" / "bench", folder))
    proxy = stack.enter_context(delay_proxy(nginx.port, args.regime_latency, stats))
    if args.bucket_cpus:
        for pid in (nginx.proc.pid, proxy.proc.pid, *_children(nginx.proc.pid)):
            os.sched_setaffinity(pid, args.bucket_cpus)
    os.environ["SSL_CERT_FILE"] = str(folder / "cert.pem")  # our libcurl, fsspec's aiohttp
    urls = [f"https://127.0.0.1:{proxy.port}/{p.name}" for p in slides]
    return (lambda: nginx_stats(folder)), urls, None, "http"


def _children(pid: int) -> list[int]:
    found = Path(f"/proc/{pid}/task/{pid}/children")
    return [int(c) for c in found.read_text().split()] if found.exists() else []


def warm_page_cache_all(paths: list[Path]) -> None:
    for path in paths:
        warm_page_cache(path)


def report_regimes(
    results: list[tuple[str, str, dict[str, float]]], args: argparse.Namespace, peer: str
) -> None:
    print()
    print(f"regimes at +{args.regime_latency:g} ms per request, {args.workers} worker(s), "
          f"server {args.server}")  # fmt: skip
    print(f"{'regime':<7} {'path':<13} {'tiles/s':>8} {'vs local':>9} {'GETs/tile':>10} "
          f"{'KB/tile':>8} {'CPU us/tile':>12}")  # fmt: skip
    for regime, kind, r in results:
        gets = f"{r.get('gets_per_tile', 0.0):10.3f}"  # local: no GETs
        kb = f"{r.get('bytes_per_tile', 0.0) / 1e3:8.1f}"
        print(f"{regime:<7} {kind:<13} {r['tiles_per_s']:8.0f} "
              f"{r['tiles_per_s'] / _base(results, regime):8.2f}x {gets} {kb} "
              f"{r['cpu_us']:12.0f}")  # fmt: skip
    for regime in ("dense", "sparse"):
        ours = _rate(results, regime, "ours")
        for kind in (f"{peer}-default", f"{peer}-none"):
            print(f"{regime}: ours / tiffslide+{kind} {ours / _rate(results, regime, kind):.1f}x")


def _rate(results: list[tuple[str, str, dict[str, float]]], regime: str, kind: str) -> float:
    return next(r["tiles_per_s"] for g, k, r in results if g == regime and k == kind)


def _base(results: list[tuple[str, str, dict[str, float]]], regime: str) -> float:
    return _rate(results, regime, "local warm")


if __name__ == "__main__":
    main()
