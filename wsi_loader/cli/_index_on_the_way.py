"""`predict` and `features` over slides: when PATH is slide files, a folder of slides, a glob
or a CSV manifest instead of an index, the index is built first, in the same process (one
start-up, as with one command), into ``--index-out`` (default OUT/index) with the `index`
command's defaults and its grid options. A rerun updates that index incrementally: unchanged
slides are carried over without being opened, and the pass then skips complete slides. Under
torchrun, rank 0 builds it and the other ranks wait."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from wsi_loader.cli.common import one_line
from wsi_loader.cli.index import GRID_KEYS, add_grid_options
from wsi_loader.errors import ConfigError, InputError

if TYPE_CHECKING:
    from wsi_loader.config import IndexConfig

# the files a `predict` or `features` run writes into its output folder
RUN_MARKERS = ("predict.json", "features.json")

INDEX_ON_THE_WAY = argparse.ArgumentParser(add_help=False)
_group = INDEX_ON_THE_WAY.add_argument_group(
    "when PATH is slides (files, folders, globs or CSV manifests), they are indexed first"
)
_group.add_argument(
    "--index-out",
    metavar="DIR",
    help="where that index is written, and updated by a rerun (default: OUT/index)",
)
add_grid_options(_group)


def is_index(path: str) -> bool:
    """Whether ``path`` is an index directory (it has the CURRENT pointer)."""
    from wsi_loader.index._table_files import CURRENT

    return os.path.isdir(path) and os.path.isfile(os.path.join(path, CURRENT))


def index_for(args: argparse.Namespace) -> str:
    """The index the pass reads: ``args.index`` when it is one index, else the index built
    (or brought up to date) from the slides it names, in ``--index-out``."""
    paths: list[str] = args.index
    given = [f"--{key.replace('_', '-')}" for key in GRID_KEYS if getattr(args, key) is not None]
    if args.index_out is not None:
        given.insert(0, "--index-out")
    if len(paths) == 1 and is_index(paths[0]):
        if given:
            raise ConfigError(
                f"{', '.join(given)} go with slides, but {paths[0]} is an index (its grid is "
                "already laid): leave them out, or give the slides",
                path="command line",
            )
        return paths[0]
    for path in paths:
        if is_index(path):
            raise ConfigError(
                f"{path} is an index, given beside other paths: give one index, or slides only",
                path="command line",
            )
    _check_slides(paths)
    out = Path(args.out)
    index_out = Path(args.index_out) if args.index_out is not None else out / "index"
    _check_index_out(index_out, out, f"{args.command}.json" if not args.overwrite else None)
    if not args.overwrite:
        _check_grid(index_out, args)
    return _build(paths, index_out, args)


def _check_slides(paths: list[str]) -> None:
    from wsi_loader.index._inputs import SLIDE_SUFFIXES, discover

    for path in paths:
        if os.path.isdir(path) or any(ch in path for ch in "*?["):
            if not discover([path]):
                raise InputError(
                    "neither an index (no CURRENT file) nor a folder with slide files", path=path
                )
            continue
        if not os.path.exists(path):
            raise InputError("no such file or folder (expected an index or slides)", path=path)
        suffix = Path(path).suffix.lower()
        if suffix != ".csv" and suffix not in SLIDE_SUFFIXES:
            raise InputError(
                f"neither an index nor a slide file ({suffix or 'no suffix'} is not a slide "
                "format)",
                path=path,
            )


def _check_index_out(index_out: Path, out: Path, own: str | None) -> None:
    """Refuse an index folder that is the pass's output folder, holds it, or lies inside the
    output of another run (its files would be taken for, or mixed with, those outputs). ``own``:
    the marker this command writes (OUT may hold it: a rerun); None, OUT's outputs are to be
    replaced (--overwrite)."""
    where = index_out.resolve()
    mine = out.resolve()
    if where == mine or where in mine.parents:
        raise ConfigError(
            f"--index-out {index_out} is (or holds) the output folder {out}: give the index a "
            "folder of its own (the default is OUT/index)",
            path="command line",
        )
    for folder in (where, *where.parents):
        for marker in RUN_MARKERS:
            if folder == mine and (own is None or marker == own):
                continue
            if (folder / marker).is_file():
                raise ConfigError(
                    f"--index-out {index_out} is inside {folder}, the output of another run "
                    f"(it holds {marker}): give the index a folder of its own"
                    + (", or pass --overwrite to replace that run" if folder == mine else ""),
                    path="command line",
                )


def _check_grid(index_out: Path, args: argparse.Namespace) -> None:
    """One folder, one run: an index already at ``index_out`` laid with other grid options
    would be rebuilt and every output recomputed, so the run is refused, naming each option
    with its value then and now, before anything changes (--overwrite rebuilds it)."""
    from wsi_loader.index import SlideIndex
    from wsi_loader.index._incremental import changed_grid

    if not is_index(str(index_out)):
        return
    changed = changed_grid(SlideIndex.open(index_out).params, _config(args))
    if changed:
        shown = "; ".join(
            f"--{key.replace('_', '-')} {_value(was)} -> {_value(now)}" for key, was, now in changed
        )
        raise ConfigError(
            f"{index_out} holds an index built with other grid options ({shown}): give the "
            "options it was built with, write elsewhere (--out, --index-out), or pass "
            "--overwrite to rebuild it and redo the outputs",
            path="command line",
        )


def _value(value: object) -> str:
    """A grid option's value as typed on a command line (none: not given)."""
    if value is None:
        return "none"
    if isinstance(value, list):
        return ",".join(_value(v) for v in value)
    return str(value).lower() if isinstance(value, bool) else str(value)


def _config(args: argparse.Namespace) -> IndexConfig:
    """The `IndexConfig` of the index built on the way: the `index` command's defaults, the
    grid options given, and --root."""
    from wsi_loader.config import IndexConfig, with_overrides

    overrides = {key: getattr(args, key) for key in GRID_KEYS}
    # --root: the slide paths are stored relative to it (the pass opens the index with it;
    # an index of absolute paths cannot be remapped)
    overrides["root"] = args.root
    return with_overrides(IndexConfig(), source="command line", **overrides)


def _build(paths: list[str], index_out: Path, args: argparse.Namespace) -> str:
    """Build the index; under torchrun, rank 0 builds it while the others wait for it (two
    builds into one folder refuse each other), and a failure is every rank's."""
    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
    if not distributed:
        _build_here(paths, index_out, args)
        return str(index_out)
    import torch.distributed as dist

    failure: list[str | None] = [None]
    if dist.get_rank() == 0:
        try:
            _build_here(paths, index_out, args)
        except BaseException as exc:
            failure = [str(exc)]
            dist.broadcast_object_list(failure, src=0)
            raise
    dist.broadcast_object_list(failure, src=0)
    if failure[0] is not None:
        raise ConfigError(f"rank 0 could not index the slides: {failure[0]}", path=str(index_out))
    return str(index_out)


def _build_here(paths: list[str], index_out: Path, args: argparse.Namespace) -> None:
    from wsi_loader.index import build_index

    index = build_index(paths, index_out, _config(args), progress=not args.no_progress)
    ok = sum(s.status == "ok" for s in index.slides)
    build = index.meta.get("build") or {}
    reused = f", {build['unchanged']} unchanged" if build.get("unchanged") else ""
    print(
        f"indexed {len(index.slides)} slides ({ok} ok{reused}), {len(index)} tiles -> "
        f"{one_line(index_out)}",
        file=sys.stderr,
    )
