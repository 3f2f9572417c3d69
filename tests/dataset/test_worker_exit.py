from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from torch.utils.data import DataLoader, Dataset

import wsi_loader.dataset._tiles  # noqa: F401 (what a worker holding a TileDataset imports)
from wsi_loader.index import SlideIndex


class SlowToFree:
    """Stands in for a batch whose release the queue's feeder thread does: it frees slowly
    (letting go of the GIL, as torch does when it frees a tensor), then leaves a marker."""

    def __init__(self, folder: str, n: int) -> None:
        self.folder, self.n = folder, n
        Path(folder, f"made-{os.getpid()}-{n}").touch()

    def __del__(self) -> None:
        time.sleep(0.25)
        Path(self.folder, f"freed-{os.getpid()}-{self.n}").touch()


class SlowToFreeItems(Dataset[SlowToFree]):
    def __init__(self, folder: Path) -> None:
        self.folder = str(folder)

    def __len__(self) -> int:
        return 12

    def __getitem__(self, n: int) -> SlowToFree:
        return SlowToFree(self.folder, n)


def _markers(folder: Path, kind: str, pid: int) -> set[str]:
    return {p.name.rsplit("-", 1)[1] for p in folder.glob(f"{kind}-{pid}-*")}


def test_spawned_worker_frees_what_its_queue_holds_before_it_exits(tmp_path: Path) -> None:
    """Stopping a spawned worker with results in flight: the feeder thread finishes freeing
    them before the interpreter ends (else it is killed in the middle, and with real tensors
    the worker dies of SIGABRT)."""
    loader = DataLoader(
        SlowToFreeItems(tmp_path),
        batch_size=None,
        num_workers=1,
        prefetch_factor=4,
        multiprocessing_context="spawn",
    )
    it = iter(loader)
    next(it)
    worker = it._workers[0]  # type: ignore[attr-defined]
    del it  # shuts the worker down with its prefetched results still being freed
    worker.join(120)
    assert worker.exitcode == 0
    made = _markers(tmp_path, "made", worker.pid)
    assert len(made) >= 4  # the prefetched items were all in flight
    assert _markers(tmp_path, "freed", worker.pid) == made


LOADER_LEFT_RUNNING = """
import atexit
import gc
import sys

import multiprocessing.process

killed = []  # workers ended by SIGTERM (terminate), said by the last exit handler to run
terminate = multiprocessing.process.BaseProcess.terminate

def spy(process):
    killed.append(process.name)
    terminate(process)

if __name__ == "__main__":  # not in spawned workers, which import this script too
    atexit.register(lambda: print("killed", killed, flush=True))  # registered first: runs last
    multiprocessing.process.BaseProcess.terminate = spy

import wsi_loader as wl
from wsi_loader.synthetic import SlideSpec, write_svs

if __name__ == "__main__":
    context, how = sys.argv[1], sys.argv[2]
    write_svs("a.svs", SlideSpec(width=2000, height=1500, seed=1))
    index = wl.build_index(["a.svs"], "idx", tile_size=256, level=0, min_tissue=0.1)
    # at module level: alive until the interpreter ends, as in a script or a notebook
    loader = wl.make_loader(
        index, batch_size=4, num_workers=2, multiprocessing_context=context,
        persistent_workers=how != "held",
    )
    for epoch in range(2):
        for batch in loader:
            pass
    if how == "held":  # an iterator left in the middle of an epoch, still referenced
        held = iter(loader)
        next(held)
    if how == "collected":  # in a reference cycle (a trainer holding it, say), then garbage
        trainer = {"loader": loader}
        trainer["self"] = trainer
        del trainer, loader, batch
        gc.collect()
    print("done")
"""


@pytest.mark.parametrize(
    ("context", "how"),
    [("fork", "persistent"), ("spawn", "persistent"), ("fork", "held"), ("fork", "collected")],
)
def test_workers_alive_at_exit_leave_no_temporary_files(
    tmp_path: Path, context: str, how: str
) -> None:
    """Workers still running when the script ends (persistent workers, an iterator left in
    the middle of an epoch) are stopped before multiprocessing kills them at exit, and those
    of a loader collected as garbage are stopped (not killed after 5 s each). Whatever ends
    a worker, its temporary files (torch hands batches over through a socket there) are in
    the parent's folder, which goes with the parent."""
    temp = tmp_path / "tmp"
    temp.mkdir()
    script = tmp_path / "train.py"
    script.write_text(LOADER_LEFT_RUNNING)
    env = {**os.environ, "TMPDIR": str(temp)}
    done = subprocess.run(
        [sys.executable, str(script), context, how],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split("\n")[:2] == ["done", "killed []"]
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    left = sorted(str(p.relative_to(temp)) for p in temp.rglob("*"))
    assert left == [], done.stderr[-3000:]


INTERRUPTED_LOOP = """
import os
import signal
import sys
import threading
import time

import wsi_loader as wl
from wsi_loader.synthetic import SlideSpec, write_svs

if __name__ == "__main__":
    # Ctrl-C raises KeyboardInterrupt, as in a terminal or a kernel (a script started from a
    # background job, as CI may start the suite, inherits SIGINT ignored)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    write_svs("a.svs", SlideSpec(width=2000, height=1500, seed=1))
    index = wl.build_index(["a.svs"], "idx", tile_size=256, level=0, min_tissue=0.1)
    loader = wl.make_loader(
        index, batch_size=4, num_workers=2, multiprocessing_context=sys.argv[1]
    )
    # Ctrl-C in a terminal, or a notebook's interrupt button: SIGINT to the process group
    interrupt = threading.Timer(0.2, os.killpg, (os.getpgid(0), signal.SIGINT))
    try:
        if sys.argv[2] == "starting":  # while the workers start (spawned ones import torch)
            interrupt.start()
        for n, batch in enumerate(loader):
            if n == 2 and sys.argv[2] == "mid-epoch":
                interrupt.start()
            time.sleep(0.1)
        time.sleep(30)
    except KeyboardInterrupt:
        print("interrupted", flush=True)
    for epoch in range(2):  # the loop run again, with the same loader
        tiles = sum(len(batch.ok) for batch in loader)
        print("epoch", tiles, "of", len(index), flush=True)
"""


@pytest.mark.parametrize(
    ("context", "when"),
    [
        ("fork", "mid-epoch"),
        ("spawn", "mid-epoch"),
        ("fork", "starting"),
        ("spawn", "starting"),
        ("forkserver", "starting"),
    ],
)
def test_an_interrupted_loop_can_run_again(tmp_path: Path, context: str, when: str) -> None:
    """Interrupting a training loop (the stop button of a notebook, Ctrl-C in IPython) signals
    the whole process group. The persistent workers must not take it: the loop is run again
    with the same loader (torch said "DataLoader worker (pid(s) ...) exited unexpectedly")."""
    script = tmp_path / "loop.py"
    script.write_text(INTERRUPTED_LOOP)
    done = subprocess.run(
        [sys.executable, str(script), context, when],
        cwd=tmp_path, capture_output=True, text=True, timeout=300, check=False,
        start_new_session=True,  # a group of its own, as a terminal's job or a kernel has
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert lines[0] == "interrupted"
    tiles = int(lines[1].split()[3])
    assert lines[1:] == [f"epoch {tiles} of {tiles}"] * 2


KERNEL_SESSION = '''
import threading

from jupyter_client.manager import start_new_kernel

SETUP = """
import wsi_loader as wl
from wsi_loader.synthetic import SlideSpec, write_svs

write_svs("a.svs", SlideSpec(width=2000, height=1500, seed=1))
index = wl.build_index(["a.svs"], "idx", tile_size=256, level=0, min_tissue=0.1)
loader = wl.make_loader(index, batch_size=4, num_workers=2)
"""
LOOP = """
import time
for epoch in range(100):
    for batch in loader:
        time.sleep(0.05)
"""
AGAIN = """
for epoch in range(2):
    print("epoch", sum(len(batch.ok) for batch in loader), "of", len(index))
"""

manager, client = start_new_kernel(kernel_name="python3")


def run(code):
    out = []
    reply = client.execute_interactive(
        code, timeout=240, output_hook=lambda m: out.append(m["content"].get("text", ""))
    )
    return reply["content"]["status"], "".join(out)


try:
    print("setup", run(SETUP)[0], flush=True)
    interrupt = threading.Timer(3, manager.interrupt_kernel)
    interrupt.start()
    print("loop", run(LOOP)[0], flush=True)  # error: KeyboardInterrupt
    interrupt.join()
    status, printed = run(AGAIN)
    print("again", status, flush=True)
    print(printed, end="", flush=True)
finally:
    client.stop_channels()
    manager.shutdown_wait_time = 120.0  # the grace before a kill (front ends give 5 s)
    manager.shutdown_kernel()  # a shutdown request, then the kill
'''


@pytest.mark.slow
def test_a_notebook_kernel_interrupts_and_shuts_down_cleanly(tmp_path: Path) -> None:
    """In a Jupyter kernel: the interrupt button stops the loop and the same loader runs
    again; shutting the kernel down (as a front end does: a request, then a kill after a
    grace period) stops the workers, and nothing is left in the temporary folder. Before,
    ipykernel waited ~30 s for the dead workers nobody reaped and was killed first."""
    pytest.importorskip("jupyter_client")
    pytest.importorskip("ipykernel")
    temp = tmp_path / "tmp"
    temp.mkdir()
    script = tmp_path / "session.py"
    script.write_text(KERNEL_SESSION)
    env = {**os.environ, "TMPDIR": str(temp), "JUPYTER_PLATFORM_DIRS": "1"}
    done = subprocess.run(
        [sys.executable, str(script)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert lines[:3] == ["setup ok", "loop error", "again ok"], done.stdout
    tiles = int(lines[3].split()[3])
    assert lines[3:] == [f"epoch {tiles} of {tiles}"] * 2
    assert sorted(p.name for p in temp.glob("pymp-*")) == []


KILLED_SCRIPT = """
import sys
import time

import wsi_loader as wl
from wsi_loader.synthetic import SlideSpec, write_svs

if __name__ == "__main__":
    write_svs("a.svs", SlideSpec(width=2000, height=1500, seed=1))
    index = wl.build_index(["a.svs"], "idx", tile_size=256, level=0, min_tissue=0.1)
    loader = wl.make_loader(
        index, batch_size=4, num_workers=2, multiprocessing_context=sys.argv[1]
    )
    next(iter(loader))
    print("reading", flush=True)
    time.sleep(600)
"""


def _descendants(pid: int) -> list[int]:
    """Processes started by ``pid``, their children, and so on (from /proc)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # not a process, or gone
        children.setdefault(int(fields[1]), []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"  # a zombie has ended; its parent has not reaped it yet


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="lists processes from /proc")
@pytest.mark.parametrize("context", ["forkserver", "spawn", "fork"])
def test_workers_end_when_the_training_script_is_killed(tmp_path: Path, context: str) -> None:
    """kill -9 of a training script: its workers (~380 MB each), and the fork server that
    started forkserver ones, stayed alive for good. torch's watchdog waits for the worker's
    parent to change, but a forkserver worker's parent is the fork server, which lives as
    long as its workers hold its lifeline. Now every worker ends with the script, and then
    the fork server (bounded wait: 60 s)."""
    script = tmp_path / "train.py"
    script.write_text(KILLED_SCRIPT)
    started = subprocess.Popen(
        [sys.executable, str(script), context],
        cwd=tmp_path, stdout=subprocess.PIPE, text=True, start_new_session=True,
    )  # fmt: skip
    left: list[int] = []
    try:
        assert started.stdout is not None and started.stdout.readline() == "reading\n"
        processes = _descendants(started.pid)
        assert len(processes) >= 2  # the workers (and multiprocessing's helpers)
        started.kill()  # SIGKILL: no handler, no atexit, nothing runs in the script
        started.wait()
        deadline = time.monotonic() + 180  # the fork server's own wait, 60 s, and a busy machine
        while time.monotonic() < deadline:
            left = [pid for pid in processes if _running(pid)]
            if not left:
                break
            time.sleep(0.2)
        described = [Path(f"/proc/{pid}/cmdline").read_bytes()[:120] for pid in left]
        assert left == [], described
    finally:
        started.kill()
        started.wait()
        if started.stdout is not None:
            started.stdout.close()
        for pid in left:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)


@pytest.mark.parametrize("wait_s", [0.0, 0.5])
def test_a_killed_forkserver_worker_is_named_with_how_it_ended(
    index: SlideIndex, wait_s: float
) -> None:
    """A forkserver worker is no child of this process, so torch's SIGCHLD handler never
    says it died: the loop failed with ConnectionResetError (fetching a batch the dead worker
    had queued) or 'DataLoader worker (pid(s) N) exited unexpectedly', five seconds later.
    Now: which worker, its pid, and how it ended."""
    from wsi_loader import make_loader
    from wsi_loader.errors import LoaderWorkerDiedError

    loader = make_loader(index, batch_size=4, num_workers=2, multiprocessing_context="forkserver")
    batches = iter(loader)
    next(batches)
    victim = loader._iterator._workers[0]  # type: ignore[union-attr]
    os.kill(victim.pid, signal.SIGKILL)
    time.sleep(wait_s)  # at once: its queued batches are fetched from a dead process
    with pytest.raises(LoaderWorkerDiedError) as caught:
        for _ in batches:
            pass
    error = caught.value
    assert isinstance(error, RuntimeError)  # what torch raises for a dead worker
    assert (error.worker_id, error.pid, error.exitcode) == (0, victim.pid, -signal.SIGKILL)
    assert f"worker 0 (pid {victim.pid})" in str(error) and "killed by SIGKILL" in str(error)
    assert "out-of-memory" in str(error)


def test_an_interrupt_while_workers_start_is_held_not_lost() -> None:
    """SIGINT sent to the process while it starts workers: the starting thread blocks it, so
    the kernel hands it to another thread of the process; it used to be ignored process-wide
    then, and the interrupt was lost (a busy machine's 'starting' runs of
    test_an_interrupted_loop_can_run_again). It is raised once the start is over."""
    from wsi_loader.dataset._worker_exit import sigint_held_for_new_workers

    stop = threading.Event()
    other = threading.Thread(target=stop.wait)  # a thread that does not block SIGINT
    other.start()
    try:
        with pytest.raises(KeyboardInterrupt), sigint_held_for_new_workers():
            os.kill(os.getpid(), signal.SIGINT)
            for _ in range(100):  # Python runs handlers between bytecodes of this thread
                time.sleep(0.01)
    finally:
        stop.set()
        other.join()


FIRST_SPAWN = """
import multiprocessing
import sys

from wsi_loader.dataset._worker_exit import sigint_held_for_new_workers


def blocked_at_start() -> str:
    status = open("/proc/self/status").read()
    return status.split("SigBlk:")[1].split()[0]


if __name__ == "__mp_main__":  # a spawned child, as it imports its parent's script
    print("child blocked", blocked_at_start(), flush=True)


def nothing() -> None:
    pass


if __name__ == "__main__":
    context = multiprocessing.get_context(sys.argv[1])
    with sigint_held_for_new_workers(context):
        queue = context.Queue()  # as torch makes them: starts the resource tracker
        child = context.Process(target=nothing)
        child.start()
    child.join()
    queue.close()
"""


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads the signal mask from /proc")
def test_the_first_spawned_workers_start_with_sigint_held(tmp_path: Path) -> None:
    """The first spawned workers of a process: making torch's queues starts multiprocessing's
    resource tracker, whose start unblocks SIGINT (and SIGTERM) in the starting thread, so
    these workers started with SIGINT open and an interrupt while they imported torch ended
    them (test_an_interrupted_loop_can_run_again[spawn-starting] on a busy machine)."""
    script = tmp_path / "first.py"
    script.write_text(FIRST_SPAWN)
    done = subprocess.run(
        [sys.executable, str(script), "spawn"],
        cwd=tmp_path, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    mask = int(done.stdout.split("child blocked")[1].split()[0], 16)
    assert mask & (1 << (signal.SIGINT - 1)), done.stdout
