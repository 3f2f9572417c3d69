"""Pool workers of index and export end when their parent is killed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.conftest import REPO


@pytest.fixture(autouse=True)
def _ctrl_c_as_in_a_terminal() -> Iterator[None]:
    """Start the commands here with SIGINT at its default, as a terminal's foreground job has
    it: a shell ignores SIGINT in its background jobs (``make test &``, a runner started with
    ``nohup ... &``), children inherit that, and their Ctrl-C would do nothing."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:  # (None: a handler set outside Python)
        signal.signal(signal.SIGINT, signal.SIG_DFL if previous is None else previous)


def _children(parent: int) -> list[str]:
    """Pids whose parent is ``parent`` (from /proc, so no procps is needed)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == parent:
                found.append(entry.name)
    return found


def _linked_slides(testdata: Path, folder: Path, count: int) -> Path:
    """``count`` hard links to one real slide: an archive big enough to interrupt."""
    folder.mkdir()
    for i in range(count):
        os.link(testdata / "CMU-1-Small-Region.svs", folder / f"s{i}.svs")
    return folder


def _alive(pid: str) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.timeout(120)
def test_index_workers_exit_when_the_parent_is_killed(testdata: Path, tmp_path: Path) -> None:
    slides = _linked_slides(testdata, tmp_path / "slides", 80)
    code = (
        "import sys, wsi_loader as wl\n"
        "wl.build_index([sys.argv[1]], sys.argv[2], mpp=0.5, workers=2, min_tissue=0.5)\n"
    )
    parent = subprocess.Popen(
        [sys.executable, "-c", code, str(slides), str(tmp_path / "idx")],
        cwd=REPO,
        stderr=subprocess.DEVNULL,
    )
    workers: list[str] = []
    deadline = time.monotonic() + 120
    while len(workers) < 2 and time.monotonic() < deadline and parent.poll() is None:
        time.sleep(0.2)
        workers = _children(parent.pid)
    assert len(workers) >= 2, "the build ended before its workers could be seen"
    os.kill(parent.pid, signal.SIGKILL)
    parent.wait()
    deadline = time.monotonic() + 120
    while any(_alive(w) for w in workers) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = [w for w in workers if _alive(w)]
    for pid in left:
        os.kill(int(pid), signal.SIGKILL)
    assert not left, f"workers {left} outlived their parent"


def _interrupt(
    args: list[str], ready: Callable[[int], bool], delay: float = 0.0
) -> subprocess.CompletedProcess[str]:
    """Run the CLI in its own process group and press Ctrl-C (SIGINT to the whole group, as
    a terminal does) once ``ready(pid)`` and ``delay`` seconds after the start."""
    started = time.monotonic()
    proc = subprocess.Popen(
        [sys.executable, "-m", "wsi_loader.cli", *args],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    while proc.poll() is None and time.monotonic() - started < 180:
        if ready(proc.pid) and time.monotonic() - started >= delay:
            break
        time.sleep(0.02)
    workers = _children(proc.pid)
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGINT)
    try:
        out, err = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"still running 120 s after Ctrl-C: {err[-2000:]}")
    deadline = time.monotonic() + 120
    while any(_alive(w) for w in workers) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [w for w in workers if _alive(w)], "workers outlived the interrupted command"
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


@pytest.mark.parametrize("when", ["while workers start", "while units run"])
def test_ctrl_c_stops_a_parallel_export_cleanly_and_it_resumes(
    testdata: Path, tmp_path: Path, when: str
) -> None:
    import wsi_loader as wl

    labels = tmp_path / "labels.csv"  # (image folders hold labelled tiles)
    labels.write_text("slide,label\nCMU-1-Small-Region,he\n")
    index = wl.build_index(
        [testdata / "CMU-1-Small-Region.svs"], tmp_path / "idx", level=0, tile_size=64,
        min_tissue=0.0, labels=str(labels),
    )  # fmt: skip
    out = tmp_path / "export"
    args = ["export", str(index.path), "--out", str(out), "--workers", "2", "--shard-size", "4",
            "--no-progress"]  # fmt: skip
    if when == "while workers start":  # the resource tracker and a worker still importing
        done = _interrupt(args, lambda pid: len(_children(pid)) >= 2)
    else:
        done = _interrupt(args, lambda pid: (out / ".export-parts.jsonl").exists())
    if done.returncode == 0:
        pytest.skip("the export finished before Ctrl-C")
    assert done.returncode == 130, done.stderr
    assert "Traceback" not in done.stderr and "KeyboardInterrupt" not in done.stderr, done.stderr
    assert done.stderr.strip().splitlines()[-1] == "interrupted"
    again = subprocess.run(
        [sys.executable, "-m", "wsi_loader.cli", *args], cwd=REPO, capture_output=True, text=True,
        check=False,
    )  # fmt: skip
    assert again.returncode == 0, again.stderr
    assert not [p for p in out.rglob("*") if ".tmp" in p.name]
    assert len(list(out.rglob("*.png"))) == len(index)


@pytest.mark.parametrize("limit", [[], ["--slide-timeout", "60"]], ids=["", "slide timeout"])
def test_ctrl_c_stops_a_parallel_index_build_cleanly(
    testdata: Path, tmp_path: Path, limit: list[str]
) -> None:
    # enough slides that the build is still running when Ctrl-C comes on a fast machine
    slides = _linked_slides(testdata, tmp_path / "slides", 300)
    args = ["index", str(slides), "--out", str(tmp_path / "idx"), "--mpp", "0.5", "--workers",
            "2", "--no-progress", *limit]  # fmt: skip
    done = _interrupt(args, lambda pid: len(_children(pid)) >= 3, 0.5)
    if done.returncode == 0:
        pytest.skip("the build finished before Ctrl-C")
    assert done.returncode == 130, done.stderr
    assert "Traceback" not in done.stderr and "KeyboardInterrupt" not in done.stderr, done.stderr
    assert not (tmp_path / "idx").exists()  # a first build that did not finish leaves nothing


def _run_script(tmp_path: Path, text: str) -> subprocess.CompletedProcess[str]:
    """Run ``text`` as a script (its ``__main__`` guard is what spawned workers need)."""
    script = tmp_path / "run.py"
    script.write_text(text)
    return subprocess.run(
        [sys.executable, str(script)], cwd=REPO, capture_output=True, text=True, timeout=300,
        check=False,
    )  # fmt: skip


CTRL_C_WHILE_SUBMITTING = """
import concurrent.futures as cf, os, signal, time
from wsi_loader import parallel

real, calls = cf.ProcessPoolExecutor.submit, [0]

def submit(self, *args, **kwargs):  # Ctrl-C while the tasks are handed to the pool
    calls[0] += 1
    if calls[0] == 5:
        os.kill(os.getpid(), signal.SIGINT)
    return real(self, *args, **kwargs)

if __name__ == "__main__":
    cf.ProcessPoolExecutor.submit = submit
    start = time.monotonic()
    try:
        parallel.run_all(
            time.sleep, [0.5] * 40, 2, None, parallel.progress_bar(40, "", "", False),
            given_up=lambda task, why: why,
        )
        print(f"finished after {time.monotonic() - start:.1f} s")
    except KeyboardInterrupt:
        print("interrupted")
"""


CTRL_C_AT_ANOTHER_THREAD = """
import multiprocessing.process, signal, threading, time
from multiprocessing.connection import wait
from wsi_loader import parallel

started, real_start = [], multiprocessing.process.BaseProcess.start
idle = threading.Thread(target=threading.Event().wait, daemon=True)  # a thread of the caller

def start(self):  # the terminal's Ctrl-C reaches the process while a worker is being started
    started.append(self)
    try:
        if len(started) == 1:
            signal.pthread_kill(idle.ident, signal.SIGINT)  # taken by the thread that has it open
            time.sleep(0.2)
        real_start(self)
    except KeyboardInterrupt:
        print("interrupted inside Process.start")
        raise

if __name__ == "__main__":
    idle.start()
    multiprocessing.process.BaseProcess.start = start
    try:
        parallel.run_all(
            time.sleep, [0.5] * 8, 2, None, parallel.progress_bar(8, "", "", False),
            given_up=lambda task, why: why,
        )
        print("finished")
    except KeyboardInterrupt:
        print("interrupted")
    # by sentinel, not exitcode: the pool's own thread may still be reaping them
    print("alive:", [p.pid for p in started if p.pid is None or not wait([p.sentinel], 5)])
    # a pool thread still closing its pipes raced interpreter exit ('Exception ignored in:
    # threading ... OSError: [Errno 9] Bad file descriptor')
    pool = [t.name for t in threading.enumerate() if "ExecutorManager" in type(t).__name__]
    print("pool threads:", pool)
"""


@pytest.mark.timeout(120)
def test_ctrl_c_taken_by_another_thread_waits_until_workers_are_started(tmp_path: Path) -> None:
    # a process-directed SIGINT goes to any thread that has it unblocked, and Python then runs
    # the handler in the main thread at once: a worker interrupted half-started printed
    # 'EOFError: Ran out of input', or outlived the run and failed on its unlinked semaphore
    done = _run_script(tmp_path, CTRL_C_AT_ANOTHER_THREAD)
    expected = ["interrupted", "alive: []", "pool threads: []"]
    assert done.stdout.split("\n")[:3] == expected, done.stdout + done.stderr
    assert "Traceback" not in done.stderr, done.stderr


@pytest.mark.timeout(120)
def test_ctrl_c_while_tasks_are_submitted_is_not_lost(tmp_path: Path) -> None:
    # workers must start with SIGINT off, but the parent must not lose a Ctrl-C meanwhile:
    # handing 100,000 slides to the pool takes seconds, and that Ctrl-C was ignored
    done = _run_script(tmp_path, CTRL_C_WHILE_SUBMITTING)
    assert done.stdout.strip() == "interrupted", done.stdout + done.stderr
    assert "Traceback" not in done.stderr, done.stderr


def _workers_left(before: set[str]) -> list[str]:
    """This process's live children not in ``before`` (servers of other tests), but
    multiprocessing's resource tracker (which stays)."""
    return [
        pid
        for pid in _children(os.getpid())
        if pid not in before
        and _alive(pid)
        and b"resource_tracker" not in Path(f"/proc/{pid}/cmdline").read_bytes()
    ]


def _gave_up(task: float, why: object) -> str:
    return f"gave up {task:g}"


@pytest.mark.parametrize("workers", [1, 2])
def test_a_task_past_its_time_limit_is_given_up_and_the_others_run(workers: int) -> None:
    """A stuck task (a hung mount, a decoder that loops) must not stop the run: it is given up
    after ``timeout``, its worker ended, and the tasks queued behind it, which never began,
    run in fresh workers (not given up with it)."""
    from wsi_loader import parallel

    tasks = [0.0, 3600.0, 0.2, 3600.0, 0.0, 0.1]
    before = set(_children(os.getpid()))
    # 20 s: a stuck task sleeps for an hour, a good one 0.2 s at most, even on a busy machine
    results = parallel.run_all(
        time.sleep, tasks, workers, None, parallel.progress_bar(6, "", "", False),
        timeout=20.0, given_up=_gave_up,
    )  # fmt: skip
    assert results == [None, "gave up 3600", None, "gave up 3600", None, None]
    assert not _workers_left(before)


def test_a_time_limit_needs_local_workers() -> None:
    import concurrent.futures as cf

    from wsi_loader import parallel

    bar = parallel.progress_bar(1, "", "", False)
    with cf.ThreadPoolExecutor(1) as pool, pytest.raises(ValueError, match="worker processes"):
        parallel.run_all(time.sleep, [0.0], 1, pool, bar, timeout=1.0, given_up=_gave_up)


def _sleep_or_die(task: float) -> float:
    """Sleep ``task`` seconds; a negative task ends the worker: -15 with SIGTERM (as the
    executor ends the others), any other with that exit status."""
    if task == -15:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(60)
    if task < 0:
        os._exit(int(-task))
    time.sleep(task)
    return task


def _why(task: float, why: object) -> str:
    return f"{task:g}: {why}"


@pytest.mark.timeout(180)
def test_tasks_whose_worker_dies_are_given_up_and_the_others_run() -> None:
    """A worker that dies under its task (here: exit status 3) gives that task up with how
    it ended; one that ends as the executor ends the others (SIGTERM) cannot be told apart,
    so the tasks that were running are retried one at a time, and only the one that kills
    its worker alone is given up."""
    from wsi_loader import parallel

    before = set(_children(os.getpid()))
    tasks = [0.1, -3.0, 0.2, 0.1, -15.0, 0.3]
    results = parallel.run_all(
        _sleep_or_die, tasks, 2, None, parallel.progress_bar(6, "", "", False),
        given_up=_why,
    )  # fmt: skip
    assert results[0] == 0.1 and results[2:4] == [0.2, 0.1] and results[5] == 0.3
    assert results[1] == "-3: GivenUp(kind='died', detail='exit status 3')"
    assert results[4] == "-15: GivenUp(kind='died', detail='killed by SIGTERM')"
    assert not _workers_left(before)
