"""Slides read from object storage (moto's S3 server) and a web server with Range support,
through `wsi_loader.slides.storage`: pixels equal the local file's, requests are few,
coalesced and concurrent, faults are retried and then said as they are."""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import REPO, SlideFactory, upload
from tests.servers import delay_proxy, http_files, proxy_stats
from wsi_loader.errors import (
    SlideChangedError,
    SlideNotFoundError,
    SlideOpenError,
    TransientReadError,
)
from wsi_loader.slides import open_slide
from wsi_loader.slides._openslide import OpenSlideReader
from wsi_loader.slides._tiff import TiffReader
from wsi_loader.slides.storage._local_copies import LocalCopies
from wsi_loader.slides.storage._sources import (
    PARSE_BLOCK,
    RangeStore,
    RemoteBytes,
    coalesce,
    is_url,
    list_objects,
    remote_stat,
)

pytestmark = pytest.mark.filterwarnings("ignore::ResourceWarning")

WINDOWS = [(0, 0, 0, 256, 256), (256, 512, 0, 256, 256), (100, 37, 0, 300, 200)]


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[str, Path]]:
    """A web server over a folder: (base URL, folder)."""
    root = tmp_path / "www"
    root.mkdir()
    with http_files(root) as server:
        yield server.url, root


def test_urls_are_told_from_paths() -> None:
    assert is_url("s3://bucket/a b/x.svs") and is_url("https://host/x.svs")
    assert not is_url("/data/x.svs") and not is_url("file:///data/x.svs")
    assert not is_url("C:/data/x.svs")


def test_coalesce_merges_close_ranges_and_caps_requests() -> None:
    assert coalesce([(0, 10), (10, 10), (100, 5)], gap=0) == [(0, 20), (100, 5)]
    assert coalesce([(100, 5), (0, 10)], gap=100) == [(0, 105)]
    big = [(i * 2**20, 2**20) for i in range(20)]
    merged = coalesce(big, gap=0)
    assert len(merged) == 3 and sum(s for _, s in merged) == 20 * 2**20  # 8 MiB at most each


def test_pixels_from_s3_equal_the_local_file(s3_endpoint: str, make_slide: SlideFactory) -> None:
    for kind in ("svs", "tiff"):
        local = make_slide(kind=kind, width=3000, height=2000, seed=7)
        url = upload(local, f"s3://slides/storage/a b/slide.v1 (x).{local.suffix[1:]}")
        remote, here = open_slide(url), open_slide(str(local))
        assert isinstance(remote, TiffReader)
        assert remote.meta == here.meta
        for window in WINDOWS:
            assert np.array_equal(remote.read_region(*window), here.read_region(*window))
        scaled = remote.read_region_scaled(512, 512, 0, 512, 512, 256, 256)
        assert np.array_equal(scaled, here.read_region_scaled(512, 512, 0, 512, 512, 256, 256))
        remote.close()
        here.close()


def test_real_slides_from_s3_equal_the_local_file(s3_endpoint: str, testdata: Path) -> None:
    for name in ("CMU-1-Small-Region.svs", "kidney-48-5.tif"):
        url = upload(testdata / name, f"s3://slides/real/{name}")
        remote, here = open_slide(url), open_slide(str(testdata / name))
        assert type(remote) is type(here)
        w, h = here.meta.dimensions
        for x, y in [(0, 0), (w // 3, h // 2)]:
            window = (x, y, 0, 240, 240)
            assert np.array_equal(remote.read_region(*window), here.read_region(*window))


def test_openslide_only_slides_are_copied_locally_once(
    s3_endpoint: str, testdata: Path, tmp_path: Path
) -> None:
    ndpi = testdata / "test3-DAPI-2-(387).ndpi"
    url = upload(ndpi, "s3://slides/real/test3 DAPI (387).ndpi")
    copies = LocalCopies(str(tmp_path / "cache"))
    reader = open_slide(url, copies=copies)
    assert isinstance(reader, OpenSlideReader)
    here = open_slide(str(ndpi))
    assert np.array_equal(
        reader.read_region(0, 0, 0, 200, 200), here.read_region(0, 0, 0, 200, 200)
    )
    assert copies.downloads == 1
    open_slide(url, copies=copies).close()
    assert copies.downloads == 1  # the copy is reused
    files = [p.name for p in (tmp_path / "cache").iterdir() if not p.name.endswith(".lock")]
    assert len(files) == 1 and files[0].endswith(".ndpi") and "/" not in files[0]


def _local_copy(args: tuple[str, str]) -> int:
    copies = LocalCopies(args[0])
    copies.local(args[1])
    return copies.downloads


def test_processes_share_the_local_copy_cache(
    s3_endpoint: str, testdata: Path, tmp_path: Path
) -> None:
    url = upload(testdata / "test3-DAPI-2-(387).ndpi", "s3://slides/race/slide.ndpi")
    folder = str(tmp_path / "cache")
    with multiprocessing.get_context("spawn").Pool(3) as pool:
        downloads = pool.map(_local_copy, [(folder, url)] * 3)
    assert sum(downloads) == 1  # the others waited for the lock and found the copy


def test_local_copy_cache_is_bounded_and_refetches_rewritten_objects(
    s3_endpoint: str, testdata: Path, tmp_path: Path
) -> None:
    ndpi = testdata / "test3-DAPI-2-(387).ndpi"
    first = upload(ndpi, "s3://slides/bounded/one.ndpi")
    second = upload(ndpi, "s3://slides/bounded/two.ndpi")
    size = ndpi.stat().st_size
    copies = LocalCopies(str(tmp_path / "cache"), max_bytes=int(size * 1.5))
    one = copies.local(first)
    two = copies.local(second)
    assert not Path(one).exists() and Path(two).exists()  # least recently used went first
    with pytest.raises(SlideOpenError, match="larger than the local copy cache"):
        LocalCopies(str(tmp_path / "small"), max_bytes=1000).local(first)
    with pytest.raises(SlideOpenError, match="several files"):
        LocalCopies(str(tmp_path / "cache")).local("s3://slides/x/slide.mrxs")
    # the object is rewritten: another version, another copy
    other = tmp_path / "other.ndpi"
    shutil.copy(ndpi, other)
    with open(other, "r+b") as fh:
        fh.seek(size - 10)
        fh.write(b"0123456789")
    upload(other, second)
    assert copies.local(second) != two


LOCAL_COPY_ON_A_FULL_DISK = """
import resource, sys
from wsi_loader.slides import open_slide
from wsi_loader.slides.storage._local_copies import LocalCopies
from wsi_loader.errors import TransientReadError

resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, 100_000))  # the disk fills at 100 kB
try:
    open_slide(sys.argv[1], copies=LocalCopies(sys.argv[2]))
except TransientReadError as exc:
    print(type(exc).__name__, exc)
"""


def test_a_local_copy_that_cannot_be_kept_is_a_resource_error_naming_the_folder(
    s3_endpoint: str, testdata: Path, tmp_path: Path
) -> None:
    # a cache folder that is not a folder (or not writable), or a full disk or quota, raised
    # NotADirectoryError / OSError from deep inside; the slide itself is fine, so it is a
    # resource error (reported, retried, never quarantined) that says which setting to change
    url = upload(testdata / "test3-DAPI-2-(387).ndpi", "s3://slides/copies/a.ndpi")
    (tmp_path / "file").write_text("not a folder")
    folder = tmp_path / "file" / "cache"
    with pytest.raises(TransientReadError, match="cannot keep a local copy") as info:
        open_slide(url, copies=LocalCopies(str(folder)))
    message = str(info.value)
    assert str(folder) in message and "remote_cache_dir" in message and "Not a directory" in message
    assert info.value.path == url
    full = tmp_path / "full"
    done = subprocess.run(
        [sys.executable, "-c", LOCAL_COPY_ON_A_FULL_DISK, url, str(full)], cwd=REPO,
        capture_output=True, text=True, check=False, timeout=120,
    )  # fmt: skip
    assert done.stdout.startswith("TransientReadError"), done.stdout + done.stderr
    assert "File too large" in done.stdout and str(full) in done.stdout
    assert not [p for p in full.iterdir() if not p.name.endswith(".lock")]  # no part left


def test_missing_credentials_are_said_with_what_to_set(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # with no keys in the environment obstore asks the machine's instance metadata service,
    # and its answer (a 403 from a sandbox, a refused connection, a timeout) was the message,
    # retried three times, with a page of debug dump
    from tests.servers import free_port

    for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("AWS_METADATA_ENDPOINT", f"http://127.0.0.1:{free_port()}")  # no one
    monkeypatch.setenv("HOME", str(tmp_path))  # a profile, which obstore does not read
    (tmp_path / ".aws").mkdir()
    (tmp_path / ".aws" / "credentials").write_text(
        "[default]\naws_access_key_id = AKIAEXAMPLE\naws_secret_access_key = example\n"
    )
    for call in (
        lambda: list_objects("s3://wsi-no-credentials/slides/", [".svs"]),
        lambda: open_slide("s3://wsi-no-credentials/a.svs"),
    ):
        with pytest.raises(SlideOpenError, match="no credentials for this store") as info:
            call()
        message = str(info.value)
        assert "set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY" in message
        assert "aws configure export-credentials" in message
        assert "attempts" not in message and "Debug source" not in message


def test_missing_objects_and_unreachable_stores_are_slide_errors(
    s3_endpoint: str, served: tuple[str, Path]
) -> None:
    with pytest.raises(SlideNotFoundError, match="does not exist"):
        open_slide("s3://slides/nothing/here.svs")
    base, _ = served
    with pytest.raises(SlideNotFoundError):
        open_slide(f"{base}/missing.svs")
    from tests.servers import free_port

    with pytest.raises(TransientReadError, match="attempts"):
        remote_stat(f"http://127.0.0.1:{free_port()}/x.svs", retries=1)


def test_header_parse_and_reads_take_few_coalesced_concurrent_requests(
    served: tuple[str, Path], make_slide: SlideFactory, tmp_path: Path
) -> None:
    base, root = served
    local = make_slide(width=6000, height=4000, seed=8)
    shutil.copy(local, root / "big.svs")
    stats = tmp_path / "stats.json"
    with delay_proxy(int(base.rsplit(":", 1)[1]), 20, stats) as proxy:
        url = f"{proxy.url}/big.svs"
        reader = open_slide(url)
        assert isinstance(reader, TiffReader)
        opened = proxy_stats(proxy, stats)
        assert opened["requests"] <= 8, opened
        # a few blocks of the header, whatever the slide's size
        assert opened["bytes_to_client"] <= 4 * PARSE_BLOCK + 65536
        # 8 adjacent tiles: one request; 8 tiles far apart: concurrent requests
        here = open_slide(str(local))
        row = [(x * 256, 512, 0, 256, 256) for x in range(8)]
        reader.prefetch(row, 256)
        for window in row:
            assert np.array_equal(reader.read_region(*window), here.read_region(*window))
        after_row = proxy_stats(proxy, stats)
        assert after_row["requests"] - opened["requests"] == 1
        apart = [(x * 1280, y * 1280, 0, 256, 256) for x in range(4) for y in range(3)]
        reader.prefetch(apart, 256)
        for window in apart:
            assert np.array_equal(reader.read_region(*window), here.read_region(*window))
        after = proxy_stats(proxy, stats)
    made = after["requests"] - after_row["requests"]
    assert made <= 12  # merged where the gap costs less than a request (the cost model)
    assert after["max_open"] >= min(made, 4)  # the requests of one call ran side by side


def test_server_errors_and_resets_are_retried(
    served: tuple[str, Path], make_slide: SlideFactory
) -> None:
    base, root = served
    local = make_slide(width=3000, height=2000, seed=7)
    shutil.copy(local, root / "s.svs")
    reader, here = open_slide(f"{base}/s.svs"), open_slide(str(local))
    window = (256, 256, 0, 256, 256)
    faults = root / ".faults.json"
    faults.write_text(json.dumps({"/s.svs": {"status": 503, "times": 2}}))
    assert np.array_equal(reader.read_region(*window), here.read_region(*window))
    faults.write_text(json.dumps({"/s.svs": {"status": 0, "times": 1}}))  # connection reset
    assert np.array_equal(
        reader.read_region(512, 256, 0, 256, 256), here.read_region(512, 256, 0, 256, 256)
    )
    faults.write_text(json.dumps({"/s.svs": {"status": 500, "times": -1}}))
    with pytest.raises(TransientReadError, match="500"):
        reader.read_region(768, 256, 0, 256, 256)
    faults.write_text("{}")
    assert np.array_equal(
        reader.read_region(768, 256, 0, 256, 256), here.read_region(768, 256, 0, 256, 256)
    )


def test_fetched_bytes_are_bounded_and_kept_for_the_next_reads(
    s3_endpoint: str, make_slide: SlideFactory
) -> None:
    local = make_slide(width=3000, height=2000, seed=7)
    url = upload(local, "s3://slides/budget/s.svs")
    store = RangeStore(max_bytes=100_000)
    source = RemoteBytes(url, store)
    ranges = [(i * 300_000, 40_000) for i in range(5) if i * 300_000 + 40_000 < source.size]
    source.prefetch(ranges)
    assert store.nbytes <= 100_000 and store.requests == 2  # the rest did not fit
    data = [source.read(o, s) for o, s in ranges]
    with open(local, "rb") as fh:
        for (offset, size), got in zip(ranges, data, strict=True):
            fh.seek(offset)
            assert got == fh.read(size)
    assert store.nbytes <= 100_000 and store.evicted > 0  # over its budget, it evicts
    requests = store.requests
    assert source.read(*ranges[-1]) == data[-1]  # the last ones are still held
    assert store.requests == requests


def test_an_unreadable_copied_slide_is_named_by_its_url(s3_endpoint: str, tmp_path: Path) -> None:
    """A slide only OpenSlide reads is opened from a local copy; when that fails, the error
    names the object the user gave, and says where its copy is."""
    junk = tmp_path / "junk.ndpi"
    junk.write_bytes(b"not a slide at all" * 100)
    url = upload(junk, "s3://slides/real/broken scan.ndpi")
    cache = tmp_path / "cache"
    with pytest.raises(SlideOpenError) as caught:
        open_slide(url, copies=LocalCopies(str(cache)))
    assert caught.value.path == url and str(caught.value).startswith(f"{url}: ")
    assert "local copy" in str(caught.value) and str(cache) in str(caught.value)


def _fetch_copy(args: tuple[str, int, str]) -> None:
    LocalCopies(args[0], max_bytes=args[1]).local(args[2])


def test_concurrent_local_copies_stay_within_the_byte_limit(
    make_slide: SlideFactory, tmp_path: Path
) -> None:
    """Two processes each copying an object that fits alone but not together: the folder
    must stay within its limit (the room was decided before the downloads, outside the
    lock, so both copies stayed). Copies follow the umask like any file (a folder shared
    by a group must be readable by it), and lock files leave with their copies."""
    root = tmp_path / "www"
    root.mkdir()
    for name, seed in (("one.ndpi", 1), ("two.ndpi", 2)):
        shutil.copy(make_slide(width=2048, height=2048, seed=seed), root / name)
    size = max((root / n).stat().st_size for n in ("one.ndpi", "two.ndpi"))
    limit = int(size * 1.5)
    folder = tmp_path / "cache"
    stats = tmp_path / "stats.json"
    with http_files(root) as server, delay_proxy(server.port, 300, stats) as proxy:
        urls = [f"{proxy.url}/one.ndpi", f"{proxy.url}/two.ndpi"]
        with multiprocessing.get_context("spawn").Pool(2) as pool:
            pool.map(_fetch_copy, [(str(folder), limit, url) for url in urls])
        copies = [p for p in folder.iterdir() if not p.name.startswith(".")]
        data = [p for p in copies if not p.name.endswith(".lock")]
        assert sum(p.stat().st_size for p in data) <= limit, [p.name for p in data]
        assert len(data) == 1
        assert data[0].stat().st_mode & 0o777 == 0o666 & ~_umask()
        # the evicted copy's lock file went with it
        locks = [p.name for p in copies if p.name.endswith(".lock")]
        assert locks == [data[0].name + ".lock"]


def test_a_download_waits_for_room_held_by_a_copy_in_use(
    make_slide: SlideFactory, tmp_path: Path
) -> None:
    """The race behind an overfull folder: a copy checked by another process (its lock held)
    cannot be evicted, so a download that started anyway ended beside it over the limit. A
    download now waits until its room can be made, and the limit holds."""
    import threading

    from wsi_loader.files import locked

    root = tmp_path / "www"
    root.mkdir()
    for name, seed in (("one.ndpi", 1), ("two.ndpi", 2)):
        shutil.copy(make_slide(width=2048, height=2048, seed=seed), root / name)
    size = max((root / n).stat().st_size for n in ("one.ndpi", "two.ndpi"))
    limit = int(size * 1.5)
    folder = tmp_path / "cache"
    with http_files(root) as server:
        first = LocalCopies(str(folder), max_bytes=limit).local(f"{server.url}/one.ndpi")
        second = LocalCopies(str(folder), max_bytes=limit)
        done = threading.Event()
        errors: list[BaseException] = []

        def fetch() -> None:
            try:
                second.local(f"{server.url}/two.ndpi")
            except BaseException as exc:  # said by the assert below
                errors.append(exc)
            finally:
                done.set()

        with locked(first + ".lock"):  # another process checking its copy before use
            thread = threading.Thread(target=fetch)
            thread.start()
            # without the wait, the download ends while the lock is held (then the folder
            # is over its limit); with it, nothing ends before the lock goes
            finished_early = done.wait(10)
        thread.join()
        assert not errors, errors
        data = [p for p in folder.iterdir() if not p.name.startswith(".")]
        data = [p for p in data if not p.name.endswith(".lock")]
        assert sum(p.stat().st_size for p in data) <= limit, (finished_early, data)
        assert not finished_early
        assert second.downloads == 1 and not os.path.exists(first)


def _umask() -> int:
    import os

    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_coalescing_keeps_a_range_that_contains_the_next() -> None:
    # a range inside the previous one must not shrink the request to its own end
    assert coalesce([(0, 100), (10, 20)], gap=0) == [(0, 100)]
    assert coalesce([(0, 100), (10, 20), (150, 10)], gap=64) == [(0, 160)]


def test_a_stalled_request_is_asked_again_not_waited_out(
    served: tuple[str, Path], make_slide: SlideFactory
) -> None:
    """A request the server accepts and never answers: a second request for the same bytes
    goes out once the first is slower than the latency seen so far allows, and the first
    answer wins (it used to wait out the client's 120 s timeout)."""
    base, root = served
    local = make_slide(width=3000, height=2000, seed=7)
    shutil.copy(local, root / "s.svs")
    store = RangeStore()
    reader, here = open_slide(f"{base}/s.svs", store=store), open_slide(str(local))
    windows = [(x * 256, y * 256, 0, 256, 256) for x in range(6) for y in range(4)]
    for window in windows[:12]:  # the latency of this server, learnt
        assert np.array_equal(reader.read_region(*window), here.read_region(*window))
    (root / ".faults.json").write_text(json.dumps({"bytes=": {"status": "stall", "times": 2}}))
    for window in windows[12:]:
        assert np.array_equal(reader.read_region(*window), here.read_region(*window))
    assert store.hedged >= 1


def test_short_answers_are_retried(served: tuple[str, Path], make_slide: SlideFactory) -> None:
    base, root = served
    local = make_slide(width=3000, height=2000, seed=7)
    shutil.copy(local, root / "s.svs")
    reader, here = open_slide(f"{base}/s.svs"), open_slide(str(local))
    faults = root / ".faults.json"
    faults.write_text(json.dumps({"bytes=": {"status": "short", "times": 2}}))
    assert np.array_equal(
        reader.read_region(0, 0, 0, 256, 256), here.read_region(0, 0, 0, 256, 256)
    )
    faults.write_text(json.dumps({"bytes=": {"status": "short", "times": -1}}))
    with pytest.raises(TransientReadError, match="short"):
        reader.read_region(512, 512, 0, 256, 256)


def test_a_missing_bucket_is_said_in_words_at_once(s3_endpoint: str, tmp_path: Path) -> None:
    """404s are permanent: one request, and the message says what is missing (it was the
    store's raw XML, retried)."""
    from tests.servers import proxy_stats

    stats = tmp_path / "stats.json"
    port = int(s3_endpoint.rsplit(":", 1)[1])
    with delay_proxy(port, 0, stats) as proxy, _endpoint(proxy.url):
        for call in (
            lambda: open_slide("s3://no-such-bucket/a.svs"),
            lambda: list_objects("s3://no-such-bucket/slides/", [".svs"]),
        ):
            before = proxy_stats(proxy, stats)["requests"]
            with pytest.raises(SlideNotFoundError) as info:
                call()
            message = str(info.value)
            assert "no-such-bucket" in message and "bucket" in message.lower()
            assert "<" not in message and "attempts" not in message
            # not retried: a HEAD has no body, so one listing tells a missing bucket
            assert proxy_stats(proxy, stats)["requests"] - before <= 2
        with pytest.raises(SlideNotFoundError, match=r"object .* does not exist"):
            open_slide("s3://slides/no/such.svs")


@contextlib.contextmanager
def _endpoint(url: str) -> Iterator[None]:
    import os

    saved = os.environ["AWS_ENDPOINT_URL"]
    os.environ["AWS_ENDPOINT_URL"] = url
    try:
        yield
    finally:
        os.environ["AWS_ENDPOINT_URL"] = saved


def test_a_refused_connection_says_the_host_cannot_be_reached(tmp_path: Path) -> None:
    from tests.servers import free_port
    from wsi_loader.errors import InputError
    from wsi_loader.index import build_index

    url = f"https://127.0.0.1:{free_port()}/x.svs"
    with pytest.raises(TransientReadError, match=r"cannot reach 127\.0\.0\.1:\d+ .*refused"):
        remote_stat(url, retries=0)
    with pytest.raises(InputError) as info:
        build_index([url], tmp_path / "idx")
    assert "mounted" not in str(info.value) and "cannot reach" in str(info.value)


def test_merged_requests_return_the_bytes_of_single_ones(
    s3_endpoint: str, make_slide: SlideFactory
) -> None:
    """Ranges that contain, touch, overlap or sit near each other are fetched by fewer
    requests, and each read gets exactly its own bytes."""
    local = make_slide(width=3000, height=2000, seed=9)
    url = upload(local, "s3://slides/merge/s.svs")
    data = local.read_bytes()
    ranges = [
        (1000, 5000),  # contains the next
        (2000, 100),
        (6000, 300),  # touches the first's end
        (6200, 400),  # overlaps the previous
        (9000, 10),  # near: merged by the gap rule
        (400_000, 7),  # far
        (400_000, 7),  # asked twice
        (len(data) - 50, 50),  # the object's last bytes
    ]
    store = RangeStore()
    source = RemoteBytes(url, store)
    source.prefetch(ranges)
    assert store.requests < len(set(ranges))
    for offset, size in [*ranges, (1500, 3000), (6100, 200)]:  # and ranges inside blocks
        assert source.read(offset, size) == data[offset : offset + size]
    merged = store.requests
    single = RemoteBytes(url, RangeStore())
    for offset, size in ranges:
        assert single.read(offset, size) == source.read(offset, size)
    assert store.requests == merged  # everything was held


def test_a_rewritten_object_is_never_served_from_the_cache(
    s3_endpoint: str, make_slide: SlideFactory, tmp_path: Path
) -> None:
    local = tmp_path / "s.svs"
    shutil.copy(make_slide(width=3000, height=2000, seed=9), local)
    url = upload(local, "s3://slides/etag/s.svs")
    store = RangeStore()
    before = RemoteBytes(url, store)
    old = before.read(10_000, 4096)
    data = bytearray(local.read_bytes())
    data[10_000:14_096] = bytes(4096)
    local.write_bytes(bytes(data))
    upload(local, url)
    after = RemoteBytes(url, store)  # opened again: the new version
    assert after.stat.version != before.stat.version
    assert after.read(10_000, 4096) == bytes(4096) != old
    # a reader still holding the old version is refused by the store (If-Match), not fed
    # the new bytes as the old object's
    with pytest.raises(SlideChangedError):
        before.read(200_000, 4096)


OVER_HTTPS = """
import sys
import numpy as np
from wsi_loader.slides import open_slide, request_plan
from wsi_loader.slides.storage._range_cache import RangeStore

request_plan.MIN_GAP = request_plan.MAX_GAP = 0  # tiles apart: a request each
store = RangeStore()
remote, local = open_slide(sys.argv[1], store=store), open_slide(sys.argv[2])
windows = [(x * 512, y * 256, 0, 256, 256) for x in range(5) for y in range(7)]
remote.prefetch(windows, 256)  # every tile's request in flight at once
for window in windows:
    assert np.array_equal(remote.read_region(*window), local.read_region(*window)), window
print("requests", store.requests)
"""


@pytest.mark.skipif(not Path("/usr/sbin/nginx").exists(), reason="needs nginx (nginx-light)")
def test_pixels_over_https_equal_the_local_file(make_slide: SlideFactory, tmp_path: Path) -> None:
    """Many ranges in flight at once over TLS (nginx, as the https benchmark serves them):
    libcurl is woken only for the sockets that are ready, and TLS may hold bytes the socket
    no longer shows; every tile must still arrive whole."""
    from tests.servers import nginx_files

    local = make_slide(width=3000, height=2000, seed=11)
    root = tmp_path / "www"
    root.mkdir()
    shutil.copy(local, root / "s.svs")
    with nginx_files(root, tmp_path / "nginx") as nginx:
        env = {
            **os.environ,
            "SSL_CERT_FILE": str(tmp_path / "nginx" / "cert.pem"),
            "PYTHONPATH": str(REPO),
        }
        url = f"https://127.0.0.1:{nginx.port}/s.svs"
        result = subprocess.run(
            [sys.executable, "-c", OVER_HTTPS, url, str(local)],
            env=env, capture_output=True, text=True, timeout=120, check=False,
        )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert int(result.stdout.split()[-1]) >= 35


def test_plain_http_from_another_machine_is_warned_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Over plain http nothing checks a range's bytes (a flipped bit decodes as wrong
    pixels): one WARNING per store and process, none for this machine or https."""
    from wsi_loader.slides.storage._remote import _Clients, plain_http_warning

    assert plain_http_warning("http://127.0.0.1:8000/a.svs") is None
    assert plain_http_warning("http://localhost/a.svs") is None
    assert plain_http_warning("http://[::1]:80/a.svs") is None
    assert plain_http_warning("https://192.0.2.7/a.svs") is None
    assert "192.0.2.7" in (plain_http_warning("http://192.0.2.7/a.svs") or "")
    clients = _Clients()
    with caplog.at_level("WARNING", logger="wsi_loader.slides.storage._remote"):
        for name in ("a.svs", "b.svs"):
            clients.client(f"http://192.0.2.7/{name}")  # made, not connected
        clients.client("http://127.0.0.1:9/c.svs")
    said = [r.getMessage() for r in caplog.records if "plain http" in r.getMessage()]
    assert len(said) == 1 and "192.0.2.7" in said[0] and "https://" in said[0]
