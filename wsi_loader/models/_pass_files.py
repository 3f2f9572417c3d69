"""The files of a model pass: the output folder held by one run at a time and kept to one
run's options (`claim_folder`), each slide's file written under a temporary name (host and
process in it) and renamed when complete, files of killed runs removed, JSON summaries, and
each torchrun rank's part of a summary gathered on rank 0."""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch.distributed as dist

from wsi_loader.errors import ConfigError
from wsi_loader.files import NO_LOCKS, lock, replacing

TMP_MARK = ".tmp-"
RUN_FILE = ".wsi-loader-run.json"  # the command and options of the outputs in a folder
LOCK_FILE = ".wsi-loader.lock"  # held (flock) by the run writing the folder


@contextmanager
def claim_folder(
    out: Path,
    command: str,
    options: dict[str, Any],
    overwrite: bool,
    clear: Callable[[], None],
) -> Iterator[None]:
    """Hold ``out`` for one run of ``command`` with ``options`` (JSON values: what its outputs
    depend on) for the block: two runs writing one folder would mix their outputs (softmax
    files beside sigmoid ones, the summary of the second).

    A folder whose outputs were written with other options (its `RUN_FILE`) is refused, a
    `ConfigError` naming the options that differ, before anything in it changes; with
    ``overwrite`` the run goes on, ``clear()`` first removes the outputs that this run will
    not write again. A folder another process is writing (its `LOCK_FILE` locked) is refused
    too.
    Under torchrun, rank 0 takes the lock and records the options."""
    rank, _ = rank_and_world()
    _check_options(out, command, options, overwrite)
    out.mkdir(parents=True, exist_ok=True)
    fd = os.open(out / LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o666)
    try:
        if rank == 0:
            if not _lock_for_this_process(fd, out / LOCK_FILE):
                raise ConfigError(
                    f"another run is writing {out}: wait for it, or write elsewhere",
                    key="out",
                    value=str(out),
                )
            if _check_options(out, command, options, overwrite):  # again, holding the lock
                clear()
            write_json(out / RUN_FILE, {"command": command, "options": options})
        yield
    finally:
        os.close(fd)


def _lock_for_this_process(fd: int, path: Path) -> bool:
    """A POSIX record lock on the whole file (``lockf``), not ``flock``: the pass's forked
    reading workers inherit the descriptor, and a worker left hanging on a read (``timeout``)
    would hold a ``flock`` after the run; a record lock belongs to this process alone. False
    when another process holds it; True (said once) where the file system has no locks."""
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        if exc.errno in (errno.EACCES, errno.EAGAIN):
            return False
        if exc.errno not in NO_LOCKS:
            raise
        try:  # flock, where record locks are not (it says so when it is not either)
            lock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB, path)
        except BlockingIOError:
            return False
    return True


def _check_options(out: Path, command: str, options: dict[str, Any], overwrite: bool) -> bool:
    """Whether ``out`` holds outputs of other options (then refused without ``overwrite``)."""
    try:
        recorded = json.loads((out / RUN_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False  # none (a new folder, or one written before runs were recorded)
    if not isinstance(recorded, dict):
        return False
    found = recorded.get("options")
    before: dict[str, Any] = found if isinstance(found, dict) else {}
    # each with its value there and now: `--threshold 0.7` changes the key slide_rule
    differ = [
        f"{key}: {_shown(before.get(key))} -> {_shown(options.get(key))}"
        for key in sorted({*before, *options})
        if before.get(key) != options.get(key)
    ]
    if recorded.get("command") != command:  # its options are another command's
        differ = [f"the command: {recorded.get('command')} -> {command}"]
    if not differ:
        return False
    if not overwrite:
        raise ConfigError(
            f"{out} holds the outputs of a {recorded.get('command')} run with other options "
            f"({'; '.join(differ)}): write elsewhere, or pass --overwrite "
            "(overwrite=True) to replace them",
            key="overwrite",
            value=str(out),
        )
    return True


def temporary_path(path: Path) -> Path:
    """Where a slide's file is written before it is renamed to ``path``: hidden, and named by
    host and process, so that `remove_stale_files` knows a killed run's file."""
    return path.with_name(f".{path.name}{TMP_MARK}{socket.gethostname()}-{os.getpid()}")


def remove_stale_files(folder: Path) -> None:
    """Files of runs killed on this machine (their process is gone): a killed run leaves its
    slide under a temporary name, never under the final one."""
    host = socket.gethostname()
    for path in folder.glob(f".*{TMP_MARK}{host}-*"):
        try:
            pid = int(path.name.rsplit("-", 1)[1])
            os.kill(pid, 0)
        except ProcessLookupError:
            path.unlink(missing_ok=True)
        except (ValueError, PermissionError):
            continue


def write_json(path: Path, payload: Any) -> None:
    with replacing(path) as tmp:
        tmp.write_text(json.dumps(payload, indent=1, sort_keys=True))


def gather_parts(out: Path, stem: str, part: dict[str, Any]) -> list[dict[str, Any]] | None:
    """Each rank writes its part of a summary; rank 0 gets them all once every rank is done
    (the others get None)."""
    rank, world = rank_and_world()
    write_json(out / f".{stem}-rank{rank}.json", {**part, "rank": rank})
    if world > 1:
        dist.barrier()
    if rank != 0:
        return None
    parts = [json.loads((out / f".{stem}-rank{r}.json").read_text()) for r in range(world)]
    for r in range(world):
        (out / f".{stem}-rank{r}.json").unlink(missing_ok=True)
    return parts


def rank_and_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _shown(value: Any) -> str:
    """An option's recorded value, short enough for a one-line error."""
    text = json.dumps(value, default=str)
    return text if len(text) <= 80 else text[:77] + "..."
