"""The shared file routines: `locked` excludes other holders, `append_line` appends one JSON
line with one write, repairs a torn last line and reports a short write."""

from __future__ import annotations

import errno
import json
import os
import threading
from pathlib import Path

import pytest

from wsi_loader import files


def test_append_line_starts_afresh_after_a_torn_line(tmp_path: Path) -> None:
    path = tmp_path / "log.jsonl"
    files.append_line(path, {"a": 1})
    with open(path, "ab") as fh:
        fh.write(b'{"a": 2, "b"')  # a writer killed mid-line
    files.append_line(path, {"a": 3})
    lines = path.read_bytes().splitlines()
    assert json.loads(lines[0]) == {"a": 1} and json.loads(lines[-1]) == {"a": 3}
    assert len(lines) == 3 and path.read_bytes().endswith(b"\n")


def test_append_line_never_writes_through_a_symlink(tmp_path: Path) -> None:
    target = tmp_path / "elsewhere"
    target.write_text("kept\n")
    (tmp_path / "log.jsonl").symlink_to(target)
    with pytest.raises(OSError):
        files.append_line(tmp_path / "log.jsonl", {"a": 1})
    assert target.read_text() == "kept\n"


def test_a_short_write_is_a_full_disk(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real = os.write
    monkeypatch.setattr(os, "write", lambda fd, data: real(fd, data[:5]))
    with pytest.raises(OSError) as caught:
        files.append_line(tmp_path / "log.jsonl", {"a": 1})
    assert caught.value.errno == errno.ENOSPC


def test_locked_holds_out_another_holder_until_released(tmp_path: Path) -> None:
    """flock belongs to the open file: a second `locked` on the same file, even in another
    thread of this process, waits for the first."""
    order: list[str] = []
    lock = tmp_path / "x.lock"

    def second() -> None:
        with files.locked(lock):
            order.append("second")

    with files.locked(lock):
        waiter = threading.Thread(target=second)
        waiter.start()
        waiter.join(timeout=0.5)
        order.append("first released")
    waiter.join(timeout=120)
    assert order == ["first released", "second"]
