"""The one error tree of wsi_loader.

Every error carries structured fields (``path``, coordinates, ``cause``) so callers can record
failures as data instead of parsing messages. Standard-library bases are added where they fit,
so ``except FileNotFoundError`` or ``except ValueError`` keep working.

::

    WsiLoaderError
     +-- ConfigError (ValueError)            bad YAML / option: path, key, value
     |    +-- WeightsError                    encoder weights missing, gated, not fitting: repo
     +-- InputError (ValueError)             bad manifest / labels CSV: path, line
     |    +-- AnnotationError                 bad annotation file: path, element
     +-- IndexFormatError                    missing, corrupt or incompatible index directory: path
     +-- OutputError (OSError)               an output could not be written (full disk): path, errno
     +-- ForkUnsafeError                     obstore inherited through fork(): use forkserver/spawn
     +-- ModelOutputError (ValueError)       model output of the wrong type or shape: model, slides
     +-- LoaderTimeoutError (TimeoutError)   no batch within a loader's timeout: slide_ids, paths
     +-- LoaderWorkerDiedError (RuntimeError) a loader's worker process died: worker_id, pid
     +-- UnitsNotDoneError                   units of an export given up: units, reasons
     |    +-- WorkerDiedError                 their worker process died (out of memory)
     |    +-- UnitTimeoutError                not done within unit_timeout
     +-- SlideError                          anything about one slide: path
          +-- SlideNotFoundError (FileNotFoundError)
          +-- SlideChangedError                 another file than the one indexed is there
          +-- TransientReadError                 EMFILE, ENOMEM, EIO, timeouts: never quarantined
          +-- SlideOpenError                 no backend could open it
          +-- ResolutionError                no usable MPP, missing level, target not reachable
          +-- TileReadError                  one region failed: l0_x, l0_y, level, cause
"""

from __future__ import annotations

import errno
import os
from typing import Any

__all__ = [
    "AnnotationError",
    "ConfigError",
    "ForkUnsafeError",
    "IndexFormatError",
    "InputError",
    "LoaderTimeoutError",
    "LoaderWorkerDiedError",
    "ModelOutputError",
    "OutputError",
    "ResolutionError",
    "SlideChangedError",
    "SlideError",
    "SlideNotFoundError",
    "SlideOpenError",
    "TileReadError",
    "TransientReadError",
    "UnitTimeoutError",
    "UnitsNotDoneError",
    "WeightsError",
    "WorkerDiedError",
    "WsiLoaderError",
    "is_transient",
]


class WsiLoaderError(Exception):
    """Base class of every error raised by wsi_loader."""

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickle by fields, not by constructor arguments: an error raised in a worker process
        (an export unit on a full disk) reaches the parent as itself. By default pickle calls
        ``cls(*args)``, which fails for errors whose fields are required keywords, and the
        process pool reported that as its workers dying."""
        state = dict(self.__dict__)
        if isinstance(self, OSError):  # fields OSError keeps outside __dict__
            fields = {"errno": self.errno, "strerror": self.strerror, "filename": self.filename}
            state.update({name: value for name, value in fields.items() if value is not None})
        return (_unpickle, (type(self), self.args, state))


def _unpickle(cls: type[WsiLoaderError], args: tuple[Any, ...], state: dict[str, Any]) -> Any:
    error = cls.__new__(cls, *args)
    Exception.__init__(error, *args)
    for name, value in state.items():
        setattr(error, name, value)
    return error


class ConfigError(WsiLoaderError, ValueError):
    """An option or configuration file is invalid.

    ``path`` is the config file (None for options given in code), ``key`` the dotted option
    name, ``value`` the offending value.
    """

    def __init__(
        self, message: str, *, path: str | None = None, key: str | None = None, value: Any = None
    ) -> None:
        self.path = path
        self.key = key
        self.value = value
        where = f"{path}: " if path else ""
        super().__init__(f"{where}{message}")


class WeightsError(ConfigError):
    """An encoder's weights are missing, gated, unreadable or do not fit its architecture.
    ``encoder`` is the registry name, ``repo`` the Hugging Face repo id that serves them,
    ``path`` the file or folder looked at (None when none was given)."""

    def __init__(
        self, message: str, *, encoder: str, repo: str | None, path: str | None = None
    ) -> None:
        self.encoder = encoder
        self.repo = repo
        super().__init__(message, key="weights", value=path)
        self.path = path


class ForkUnsafeError(WsiLoaderError):
    """A library this process inherited through fork() cannot work in it (obstore's runtime
    after the parent used it): start worker processes with 'forkserver' or 'spawn'. Not a
    slide or tile fault: it propagates."""


class ModelOutputError(WsiLoaderError, ValueError):
    """A model returned something that is not one row of numbers per tile (a tuple, integers,
    another batch size, a width that changes): every slide would fail alike, so the run stops.
    ``model`` is its spec, ``slides`` the slides of the batch it happened on."""

    def __init__(self, message: str, *, model: str, slides: list[str]) -> None:
        self.model = model
        self.slides = slides
        batch = f" (slides of the batch: {', '.join(slides)})" if slides else ""
        super().__init__(f"model {model}: {message}{batch}")


class InputError(WsiLoaderError, ValueError):
    """A manifest, labels file or other user-supplied table is malformed."""

    def __init__(self, message: str, *, path: str | None = None, line: int | None = None) -> None:
        self.path = path
        self.line = line
        where = f"{path}:{line}: " if path and line else (f"{path}: " if path else "")
        super().__init__(f"{where}{message}")


class AnnotationError(InputError):
    """A region annotation file (QuPath GeoJSON, ASAP XML, Aperio XML) is malformed.

    ``element`` names the part at fault: ``feature 3``, ``Annotation 'Tumor' Region 2``...
    """

    def __init__(
        self, message: str, *, path: str | None = None, element: str | None = None
    ) -> None:
        self.element = element
        super().__init__(f"{element}: {message}" if element else message, path=path)


class IndexFormatError(WsiLoaderError):
    """An index directory is missing, corrupt, or written by an incompatible version."""

    def __init__(self, message: str, *, path: str | None = None) -> None:
        self.path = path
        super().__init__(f"{path}: {message}" if path else message)


class OutputError(WsiLoaderError, OSError):
    """A file could not be written: a full disk, a quota, a folder that is read-only or gone.
    ``path`` is the file, ``errno`` the system's reason. Nothing is left half-written under
    ``path`` (see `wsi_loader.files`), and work finished before is kept."""

    def __init__(self, message: str, *, path: str, code: int | None = None) -> None:
        self.message = f"cannot write {path}: {message}"
        super().__init__(self.message)
        self.path = path
        self.errno, self.strerror, self.filename = code, message, path

    def __str__(self) -> str:  # not OSError's "[Errno N] ...", which these fields would give
        return self.message


class LoaderTimeoutError(WsiLoaderError, TimeoutError):
    """No batch came within a loader's ``timeout`` (``seconds``): a read hangs (a network
    share that stopped answering, a file that blocks). ``slide_ids`` and ``paths`` are the
    slides its workers were reading then (empty: stuck elsewhere)."""

    def __init__(
        self, message: str, *, seconds: float, slide_ids: list[int], paths: list[str]
    ) -> None:
        super().__init__(message)
        self.seconds = seconds
        self.slide_ids = slide_ids
        self.paths = paths


class LoaderWorkerDiedError(WsiLoaderError, RuntimeError):
    """A DataLoader worker process of `make_loader` died (``worker_id``, ``pid``, and
    ``exitcode``: negative for the signal that killed it, as in `multiprocessing`)."""

    def __init__(self, message: str, *, worker_id: int, pid: int, exitcode: int | None) -> None:
        super().__init__(message)
        self.worker_id = worker_id
        self.pid = pid
        self.exitcode = exitcode


class UnitsNotDoneError(WsiLoaderError):
    """Units of work were given up (``units``); what the other workers finished is kept, so
    the same command run again does only those. ``reasons``: why each was given up."""

    def __init__(
        self, message: str, *, units: list[int], reasons: dict[int, str] | None = None
    ) -> None:
        super().__init__(message)
        self.units = units
        self.reasons = reasons or {}


class WorkerDiedError(UnitsNotDoneError):
    """A worker process died under units of work (killed by the out-of-memory killer, a crash
    in a library)."""


class UnitTimeoutError(UnitsNotDoneError):
    """Units were not done within their time limit (a read that hangs on a mount that stopped
    answering), so their workers were ended."""


class SlideError(WsiLoaderError):
    """Something went wrong with one slide file."""

    def __init__(self, message: str, *, path: str | None = None) -> None:
        self.path = path
        super().__init__(f"{path}: {message}" if path else message)


class SlideNotFoundError(SlideError, FileNotFoundError):
    """The slide file does not exist (or vanished after indexing)."""


class TransientReadError(SlideError):
    """A read failed for want of a resource, not because of the data: too many open files,
    no memory, an I/O error or a timeout. Retried with backoff, then reported; never
    quarantined (the slide and its tiles are fine)."""


class SlideChangedError(SlideError):
    """The file at the slide's path is not the slide that was indexed (rewritten, replaced)."""


class SlideOpenError(SlideError):
    """No backend could open the slide; the message lists each backend's reason."""


class ResolutionError(SlideError):
    """The requested resolution cannot be served by this slide (no MPP, no such level...)."""


class TileReadError(SlideError):
    """Reading one region failed.

    ``l0_x``/``l0_y`` are the level-0 top-left corner, ``level`` the read level, ``cause`` the
    backend's error text.
    """

    def __init__(
        self,
        message: str,
        *,
        path: str | None = None,
        l0_x: int | None = None,
        l0_y: int | None = None,
        level: int | None = None,
        cause: str | None = None,
    ) -> None:
        self.l0_x = l0_x
        self.l0_y = l0_y
        self.level = level
        self.cause = cause
        super().__init__(message, path=path)

    @classmethod
    def for_region(
        cls, path: str, l0_x: int, l0_y: int, level: int, l_w: int, l_h: int, exc: BaseException
    ) -> TileReadError:
        """The error a backend raises when reading one region failed with ``exc``."""
        text = describe(exc)
        return cls(
            f"read failed at level-0 ({l0_x}, {l0_y}), level {level}, {l_w}x{l_h}: {text}",
            path=path,
            l0_x=l0_x,
            l0_y=l0_y,
            level=level,
            cause=f"{type(exc).__name__}: {text}",
        )


# resource errors: the data is not at fault, a later attempt may work
TRANSIENT_ERRNOS = frozenset(
    {
        errno.EMFILE,
        errno.ENFILE,
        errno.ENOMEM,
        errno.EIO,
        errno.ETIMEDOUT,
        errno.EAGAIN,
        errno.EINTR,
        errno.ENOBUFS,
        errno.ECONNRESET,
        errno.ESTALE,
    }
)
_TRANSIENT_TEXTS = tuple(os.strerror(e) for e in TRANSIENT_ERRNOS)


def is_transient(exc: BaseException) -> bool:
    """True when ``exc`` (or what caused it) is a resource error, not a data error: an OSError
    with one of `TRANSIENT_ERRNOS`, a timeout, or a library message quoting one (OpenSlide
    reports ``strerror`` text only)."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, TransientReadError | MemoryError | TimeoutError):
            return True
        if isinstance(current, OSError) and current.errno in TRANSIENT_ERRNOS:
            return True
        if any(text in str(current) for text in _TRANSIENT_TEXTS):
            return True
        current = current.__cause__ or current.__context__
    return False


def describe(exc: BaseException) -> str:
    """An exception's message, never empty: a bare ``AssertionError`` from a library says
    where it was raised."""
    text = str(exc)
    if text:
        return text
    tb = exc.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    where = f" at {tb.tb_frame.f_code.co_filename}:{tb.tb_lineno}" if tb is not None else ""
    return f"{type(exc).__name__} (no message){where}"
