"""The ``wsi-loader`` command: a thin layer over the library, one module per subcommand.

Exit codes: 0 success, 1 the work ran but produced nothing usable (e.g. no slide indexed),
2 usage or input errors (bad option, config, manifest or index directory).
"""

from __future__ import annotations

import argparse
import io
import logging
import os
import sys
import traceback
from collections.abc import Callable, Sequence
from typing import Any

from wsi_loader.cli import (
    bench,
    demo,
    encoders,
    export,
    features,
    index,
    info,
    predict,
    quarantine,
    serve,
    slide_embeddings,
    split,
    stain,
    view,
)
from wsi_loader.cli.common import PrintableFormatter, printable
from wsi_loader.errors import OutputError, WsiLoaderError


def _versions() -> str:
    """This package's version and those a bug report needs (the OpenSlide library too)."""
    import platform
    from importlib import metadata

    import openslide

    from wsi_loader import __version__

    def version(package: str) -> str:
        try:
            return metadata.version(package)
        except metadata.PackageNotFoundError:
            return "not installed"

    parts = [f"OpenSlide {openslide.__library_version__}"]
    parts += [f"{name} {version(name)}" for name in _REPORTED]
    parts.append(f"Python {platform.python_version()}")
    return f"wsi-loader {__version__} ({', '.join(parts)})"


_REPORTED = ("openslide-python", "tifffile", "imagecodecs", "numpy", "torch")


class _VersionAction(argparse.Action):
    """``--version``, whose versions are looked up only when asked for."""

    def __init__(self, option_strings: Sequence[str], dest: str, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, *args: object, **kwargs: object) -> None:
        print(_versions())
        parser.exit()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="wsi-loader",
        description="Whole-slide image tiles for training: build a tile index of an archive, "
        "inspect it, stream or export its tiles, extract per-slide features.",
    )
    parser.add_argument(
        "--version", action=_VersionAction, help="show the versions a bug report needs and exit"
    )
    sub = parser.add_subparsers(dest="command", required=True)
    commands = (
        index,
        split,
        info,
        quarantine,
        stain,
        view,
        export,
        features,
        slide_embeddings,
        predict,
        encoders,
        serve,
    )
    for command in (*commands, bench, demo):
        command.register(sub)  # each sets `run`, the function that carries it out
    return parser


def _details(args: argparse.Namespace) -> None:
    """With -v, the traceback of the error about to be reported in one line."""
    if args.verbose:
        traceback.print_exc()


def main(argv: Sequence[str] | None = None) -> int:
    # slide paths that are not UTF-8 (held as lone surrogates) print as their own bytes, as
    # ls prints them, instead of failing the command in a UTF-8 locale
    if isinstance(sys.stdout, io.TextIOWrapper):
        sys.stdout.reconfigure(errors="surrogateescape")
    parser = build_parser()
    args = parser.parse_args(argv)
    handler = logging.StreamHandler()
    handler.setFormatter(PrintableFormatter("%(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=logging.WARNING - 10 * min(args.verbose, 2), handlers=[handler])
    try:
        run: Callable[[argparse.Namespace], int] = args.run
        return run(args)
    except BrokenPipeError:
        # the reader went away (`wsi-loader info idx | head -1`): end quietly, as cat does
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 0
    except OutputError as exc:  # a full disk: finished work is kept (written atomically)
        _details(args)
        print(
            f"error: {printable(str(exc))}. What was finished is kept: make room (or fix the "
            "folder) and run the same command again",
            file=sys.stderr,
        )
        return 1
    except (WsiLoaderError, ValueError) as exc:  # ValueError: an option the library rejected
        _details(args)
        print(f"error: {printable(str(exc))}", file=sys.stderr)
        return 2
    except OSError as exc:  # the machine, not the data: a folder that went away, a full disk
        _details(args)
        where = f"{exc.filename}: " if exc.filename else ""
        print(f"error: {printable(f'{where}{exc.strerror or exc}')}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
