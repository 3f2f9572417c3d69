"""The files of a model pass: each slide's file written under a temporary name (host and
process in it) and renamed when complete, files of killed runs removed, JSON summaries, and
each torchrun rank's part of a summary gathered on rank 0."""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path
from typing import Any

import torch.distributed as dist

from wsi_loader.files import replacing

TMP_MARK = ".tmp-"


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
