"""What `wsi-loader features` and `wsi-loader predict` share: the options of one model pass
over an index (`wsi_loader.models.PassOptions`), turning them into the keyword arguments of
`extract` and `predict`, and saying which slides a pass left unwritten."""

from __future__ import annotations

import argparse
import os
import sys
from typing import TYPE_CHECKING, Any

from wsi_loader.cli.common import init_distributed, one_line
from wsi_loader.cli.stain import stain_option
from wsi_loader.errors import ConfigError

if TYPE_CHECKING:
    from wsi_loader.models._pass import PassReport


def batch_size_option(value: str) -> int | str:
    """--batch-size: a whole number above 0, or ``auto``."""
    if value == "auto":
        return value
    try:
        number = int(value)
    except ValueError:
        number = 0
    if number < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number above 0 or auto, got {value!r}")
    return number


MODEL_PASS = argparse.ArgumentParser(add_help=False)
MODEL_PASS.add_argument("--out", required=True, metavar="DIR")
MODEL_PASS.add_argument(
    "--batch-size",
    type=batch_size_option,
    default=64,
    metavar="B",
    help="tiles per batch, or auto (a registry encoder on CUDA: what fits its memory)",
)
MODEL_PASS.add_argument("--device", metavar="D", help="cuda, cuda:1, cpu (default: cuda if there)")
MODEL_PASS.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], default="float32")
MODEL_PASS.add_argument("--workers", type=int, metavar="N", help="DataLoader workers")
MODEL_PASS.add_argument(
    "--timeout",
    type=float,
    default=0,
    metavar="S",
    help="no batch for S seconds (a read that hangs): leave the slides being read for the "
    "next run and go on (needs workers; 0: wait forever)",
)
MODEL_PASS.add_argument("--no-progress", action="store_true")
MODEL_PASS.add_argument(
    "--overwrite",
    action="store_true",
    help="write into DIR even though it holds the outputs of a run with other options "
    "(without it, such a run is refused and DIR left as it is)",
)
MODEL_PASS.add_argument(
    "--ray",
    metavar="ADDRESS",
    help="read on a Ray cluster's CPUs and run the model in its actors (on GPUs when it has "
    "them); the files are written here (pip install 'wsi_loader[ray]')",
)


def start(args: argparse.Namespace) -> None:
    """Before the model is loaded: ``--model mymodels:encoder`` finds mymodels.py in the
    current folder, as ``python -m`` would; under torchrun, join the process group."""
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    init_distributed()


def pass_keywords(args: argparse.Namespace) -> dict[str, Any]:
    """The pass's options as `extract` and `predict` take them (the fields of `PassOptions`):
    the shared reading options (--split, --root, --missing-slides, --quarantine), those of
    `MODEL_PASS`, and the stain transforms (--stain, --stain-target or --config's section)."""
    return {
        "batch_size": args.batch_size,
        "device": args.device,
        "dtype": args.dtype,
        "workers": args.workers,
        "split": args.split,
        "root": args.root,
        "missing_slides": args.missing_slides,
        "quarantine": args.quarantine,
        "timeout": args.timeout,
        "progress": not args.no_progress,
        "stain": stain_option(args),
        "overwrite": args.overwrite,
        **({"runner": ray_runner(args.ray)} if args.ray else {}),
    }


def index_model_and_keywords(args: argparse.Namespace) -> tuple[Any, dict[str, Any]]:
    """What a pass needs, in the order that fails soonest: the pass's keyword arguments (a bad
    stain option is refused before anything is indexed); the index (built first when PATH
    names slides; ``args.index`` becomes its path, which the encoder's resolution check,
    ``--batch-size auto`` and the anndata file read); then the model (``--batch-size auto``
    resolved into the keywords)."""
    from wsi_loader.cli._index_on_the_way import index_for
    from wsi_loader.cli.encoders import pass_model

    keywords = pass_keywords(args)
    args.index = index_for(args)
    model = pass_model(args)
    keywords["batch_size"] = args.batch_size
    return model, keywords


def ray_runner(address: str) -> Any:
    """``--ray ADDRESS``: a `wsi_loader.ray.RayPass` on that cluster."""
    try:
        from wsi_loader.ray import RayPass
    except ImportError as exc:
        raise ConfigError(
            "--ray needs ray: pip install 'wsi_loader[ray]'", path="command line"
        ) from exc
    return RayPass(address)


def unfinished_slides(report: PassReport, dtype: str | None = None) -> int:
    """Print the slides a pass did not write and why; the exit code (1 when there are any).
    ``dtype``: the pass's --dtype (float16 overflows: the advice names it only then)."""
    for entry in report.incomplete:
        print(
            f"  not written: {one_line(entry['slide'])}: {one_line(entry['reason'])}",
            file=sys.stderr,
        )
    for entry in report.failed_slides:
        print(f"  failed: {one_line(entry['slide'])}: {one_line(entry['reason'])}", file=sys.stderr)
    if report.incomplete:
        print("error: some slides could not be read; run the command again", file=sys.stderr)
    if report.failed_slides:
        advice = " (with --dtype float16, try float32 or bfloat16)" if dtype == "float16" else ""
        print(
            f"error: the model's outputs were not finite for some slides{advice}", file=sys.stderr
        )
    return 1 if report.incomplete or report.failed_slides else 0
