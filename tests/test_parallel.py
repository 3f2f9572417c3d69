"""Pool workers of index and export end when their parent is killed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import REPO


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


def _alive(pid: str) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.timeout(120)
def test_index_workers_exit_when_the_parent_is_killed(testdata: Path, tmp_path: Path) -> None:
    slides = tmp_path / "slides"
    slides.mkdir()
    for i in range(80):
        os.link(testdata / "CMU-1-Small-Region.svs", slides / f"s{i}.svs")
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
    deadline = time.monotonic() + 30
    while len(workers) < 2 and time.monotonic() < deadline and parent.poll() is None:
        time.sleep(0.2)
        workers = _children(parent.pid)
    assert len(workers) >= 2, "the build ended before its workers could be seen"
    os.kill(parent.pid, signal.SIGKILL)
    parent.wait()
    deadline = time.monotonic() + 10
    while any(_alive(w) for w in workers) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = [w for w in workers if _alive(w)]
    for pid in left:
        os.kill(int(pid), signal.SIGKILL)
    assert not left, f"workers {left} outlived their parent"
