"""What the commands share: parent parsers of common options, index opening, a Dask client,
and printing of untrusted text (slide names, labels) so that it cannot drive the terminal."""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import re
import socket
import struct
import time
from collections.abc import Iterator, Sequence
from typing import Any, TypeAlias

from wsi_loader.config import magnification
from wsi_loader.errors import ConfigError
from wsi_loader.index import SlideIndex

SCHEDULER_TIMEOUT_S = 10

# argparse's action is generic only to type checkers, hence the string
Subparsers: TypeAlias = "argparse._SubParsersAction[argparse.ArgumentParser]"

COMMON = argparse.ArgumentParser(add_help=False)
COMMON.add_argument("-v", "--verbose", action="count", default=0, help="more log output")


# options of every command that reads an index
READS = argparse.ArgumentParser(add_help=False)
READS.add_argument("--root", metavar="DIR", help="remap the slide root")
READS.add_argument("--split", metavar="NAME", help="only the slides of this split")


QUARANTINE_HELP = (
    "the file failed reads are appended to and read from, instead of the index's "
    "quarantine.jsonl (an index on a read-only mount)"
)
READS.add_argument("--quarantine", metavar="FILE", help=QUARANTINE_HELP)

# ... of those that read tiles
TILES = argparse.ArgumentParser(add_help=False)
TILES.add_argument(
    "--missing-slides",
    choices=["raise", "exclude"],
    default="raise",
    help="slides that cannot be read: stop (default) or leave them out with a warning",
)


def config_flag(p: argparse.ArgumentParser, name: str, text: str) -> None:
    """A flag that sets its config key to True when given; absent, the config file decides."""
    p.add_argument(name, action="store_const", const=True, help=text)


def class_names(value: str) -> list[str]:
    """A comma-separated list of class names."""
    names = [part.strip() for part in value.split(",") if part.strip()]
    if not names:
        raise argparse.ArgumentTypeError(f"no class names in {value!r}")
    return names


def magnification_arg(value: str) -> float:
    """``20``, ``20x`` or ``40X`` as a magnification (``--mag``)."""
    try:
        number: float = magnification(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if not number > 0:
        raise argparse.ArgumentTypeError(f"{value!r} is not a magnification above 0")
    return number


def open_index(args: argparse.Namespace) -> SlideIndex:
    return SlideIndex.open(args.index, root=args.root, split=args.split, quarantine=args.quarantine)


@contextlib.contextmanager
def dask_client(address: str | None) -> Iterator[Any]:
    """A Dask Client on ``address`` for the duration of a command (None without one)."""
    if not address:
        yield None
        return
    try:
        from dask.distributed import Client
    except ImportError as exc:
        raise ConfigError(
            "--scheduler needs dask: pip install 'wsi_loader[dask]'", path="command line"
        ) from exc
    check_scheduler(address, SCHEDULER_TIMEOUT_S)
    try:
        client = Client(address, timeout=SCHEDULER_TIMEOUT_S)  # type: ignore[no-untyped-call]
    except (OSError, TimeoutError) as exc:
        raise _unreachable(address, f"{exc} (within {SCHEDULER_TIMEOUT_S} s)") from exc
    with client:
        yield client


@contextlib.contextmanager
def ray_executor(address: str | None) -> Iterator[Any]:
    """A `wsi_loader.ray.RayExecutor` on the Ray cluster at ``address`` for the duration of a
    command (None without one). A process connected to Ray already keeps its connection."""
    if not address:
        yield None
        return
    try:
        import ray

        from wsi_loader.ray import RayExecutor
    except ImportError as exc:
        raise ConfigError(
            "--ray needs ray: pip install 'wsi_loader[ray]'", path="command line"
        ) from exc
    connected = ray.is_initialized()
    if not connected:
        try:
            ray.init(address=address, log_to_driver=False)
        except (ConnectionError, ValueError, RuntimeError) as exc:
            raise ConfigError(
                f"cannot reach a Ray cluster at {address}: {exc}",
                path="command line",
                key="ray",
                value=address,
            ) from exc
    try:
        with RayExecutor() as executor:
            yield executor
    finally:
        if not connected:
            ray.shutdown()  # this driver's connection; the cluster goes on


DASK_DEFAULT_PORT = 8786
# a scheduler's first frame is its handshake (compression, Python and pickle versions), about
# 60 bytes: a length much larger is another protocol's text read as a number
HANDSHAKE_MAX_BYTES = 1 << 16


def _unreachable(address: str, why: str) -> ConfigError:
    return ConfigError(
        f"cannot reach a Dask scheduler at {address}: {why}",
        path="command line",
        key="scheduler",
        value=address,
    )


def check_scheduler(address: str, timeout: float) -> None:
    """Raise `ConfigError` unless what answers at ``address`` (a ``tcp://`` address; other
    schemes are left to Dask) begins as a Dask scheduler does.

    Dask's Client does not check: an HTTP service (the dashboard's port, a proxy) left it
    waiting forever, and one that answered at once had its status line read as a frame
    length ("Unable to allocate 3.07 EiB"). A scheduler sends its handshake as soon as a
    client connects, a frame whose first 8 bytes are its length; this reads those and hangs
    up (the scheduler logs, at INFO, a connection closed before its handshake completed)."""
    from distributed.comm.addressing import parse_address, parse_host_port

    try:
        scheme, location = parse_address(address)
        if scheme != "tcp":  # tls:// needs its certificates; ucx:// and inproc:// are no sockets
            return
        host, port = parse_host_port(location, DASK_DEFAULT_PORT)
    except ValueError as exc:
        raise _unreachable(address, f"not an address ({exc})") from exc
    first = b""
    try:
        sock = socket.create_connection((host, port), timeout=timeout)
    except TimeoutError as exc:
        raise _unreachable(address, f"no connection within {timeout:g} s") from exc
    except OSError as exc:  # refused, no route, unknown host
        raise _unreachable(address, exc.strerror or str(exc)) from exc
    try:
        with sock:
            deadline = time.monotonic() + timeout
            while len(first) < 8 and time.monotonic() < deadline:
                sock.settimeout(max(0.01, deadline - time.monotonic()))
                part = sock.recv(8 - len(first))
                if not part:
                    raise _unreachable(address, "it hung up without a Dask handshake")
                first += part
    except TimeoutError:
        pass  # judged below by what came
    except OSError as exc:  # reset
        raise _unreachable(address, exc.strerror or str(exc)) from exc
    not_dask = (
        "is it an HTTP service, such as the dashboard? (a scheduler's port is 8786 by default)"
    )
    if len(first) < 8:
        raise _unreachable(
            address,
            f"something listens there but sent no Dask handshake within {timeout:g} s: {not_dask}",
        )
    (length,) = struct.unpack("Q", first)  # native order, as Dask's tcp comm writes it
    if not 0 < length <= HANDSHAKE_MAX_BYTES:
        raise _unreachable(address, f"it answered {first!r}, not a Dask handshake: {not_dask}")


def init_distributed() -> None:
    """Join the process group torchrun describes (RANK, WORLD_SIZE, MASTER_ADDR...)."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return
    import torch
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))


def labels_line(report: dict[str, Any]) -> str:
    """One line on how the labels CSV matched (counts and first names)."""
    parts = []
    for key, what in (
        ("unmatched", "labels rows match no slide"),
        ("unlabelled", "slides have no label"),
    ):
        count = report[f"{key}_rows" if key == "unmatched" else f"{key}_slides"]
        if count:
            first = ", ".join(
                one_line(os.path.basename(str(n))) for n in report[f"{key}_examples"][:3]
            )
            parts.append(f"{count} {what} ({first}{', ...' if count > 3 else ''})")
    return "labels: " + ("; ".join(parts) if parts else "every slide matched a labels row")


def counts_line(counts: dict[str, dict[str, int]], shown: int = 12) -> str:
    """'normal: 3 slides / 102 tiles, tumour: 1 slide / 34 tiles' (the first ``shown``)."""
    parts = [
        f"{name}: {c['slides']} slide{'s' * (c['slides'] != 1)} / {c['tiles']} tiles"
        for name, c in list(counts.items())[:shown]
    ]
    more = f" and {len(counts) - shown} more" if len(counts) > shown else ""
    return ", ".join(parts) + more


def tiles(n: int) -> str:
    return f"{n} tile{'s' * (n != 1)}"


def qc_counts_text(
    flagged: dict[str, Any], excluded: dict[str, Any], kept: int, option: str
) -> str:
    """What quality control did to ``kept`` tiles (a slide's, or an index's): ``3 of 120 tiles
    flagged (pen 2, ...)``, or, when ``option`` (``--qc-exclude``) left tiles out, those first
    and then what the tiles kept are flagged for (the excluded rules flag none of them)."""
    rules = ", ".join(
        f"{name} {n}" for name, n in flagged.items() if name not in ("any", "excluded")
    )
    n = int(flagged["any"])
    left_out = int(excluded.get("any", 0)) if excluded else 0
    if not left_out:
        return f"{n} of {tiles(kept)} flagged ({rules})"
    parts = ", ".join(f"{name} {k}" for name, k in excluded.items() if name != "any")
    return (
        f"{tiles(left_out)} left out by {option} ({parts}); of the {tiles(kept)} kept, "
        f"{n} {'is' if n == 1 else 'are'} flagged ({rules})"
    )


# C0 and C1 control characters: from a slide name or a label they could drive the terminal
# (escape sequences that clear it, retitle it, or rewrite what was printed)
_CONTROLS = re.compile("[\x00-\x1f\x7f-\x9f]")


_CONTROLS_BUT_LINES = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def _escaped(match: re.Match[str]) -> str:
    return repr(match.group())[1:-1]  # '\x1b', '\n'


def one_line(text: object) -> str:
    """``text`` with every control character escaped: a value inside a line of output."""
    return _CONTROLS.sub(_escaped, str(text))


def not_he_text(paths: object, before: str = "") -> str:
    """``before`` and how many slides' stain does not look like H&E, with their file names
    (the first three); nothing when none (or an older index's summary without the list)."""
    if not isinstance(paths, list) or not paths:
        return ""
    names = ", ".join(one_line(os.path.basename(str(p))) for p in paths[:3])
    more = f" and {len(paths) - 3} more" if len(paths) > 3 else ""
    slides = "slide" if len(paths) == 1 else "slides"
    return f"{before}{len(paths)} {slides} not H&E ({names}{more})"


def printable(text: str) -> str:
    """``text`` with control characters escaped but its line and tab breaks kept."""
    return _CONTROLS_BUT_LINES.sub(_escaped, text)


class PrintableFormatter(logging.Formatter):
    """Log lines whose untrusted parts (slide names, labels) cannot drive the terminal, nor
    start a line that looks like another record: a message is one line (its newlines
    escaped); a traceback (``-v``) keeps its line breaks."""

    def formatMessage(self, record: logging.LogRecord) -> str:  # noqa: N802 (logging's name)
        return one_line(super().formatMessage(record))

    def format(self, record: logging.LogRecord) -> str:
        return printable(super().format(record))


def print_columns(lines: Sequence[Sequence[str]]) -> None:
    """Rows of text cells (the first the header) printed in aligned columns."""
    widths = [max(len(line[i]) for line in lines) for i in range(len(lines[0]))]
    for line in lines:
        print("  ".join(cell.ljust(w) for cell, w in zip(line, widths, strict=True)).rstrip())
