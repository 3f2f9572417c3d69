"""What the browser is told of an error: a short reason, never the error's full text.

Errors of a slide name its file (the server's absolute path) and may quote the file's first
bytes (a slide replaced by a link to another file: ``header=b'root'``). The page gets the
slide's id and a short reason made from the error's type and structured fields (a tile's
coordinates, a table's line); the full text goes to the server's log. Texts stored in the
index or its quarantine (why a slide failed to index, a tile's recorded error) are sent with
paths and quoted bytes taken out (`scrub`).
"""

from __future__ import annotations

import logging
import os
import re

from wsi_loader.errors import (
    AnnotationError,
    InputError,
    ResolutionError,
    SlideChangedError,
    SlideError,
    SlideNotFoundError,
    SlideOpenError,
    TileReadError,
    TransientReadError,
)

log = logging.getLogger(__name__)

MAX_TEXT = 240  # characters of a stored text sent at most
SEE_LOG = "(the server's log has the details)"
# a Python bytes literal, as error texts quote file contents
_BYTES = re.compile(r"""b(['"])(?:\\.|(?!\1).)*\1""")
# an absolute POSIX path, a Windows one, or a URL: what follows up to a separator
_PATH = re.compile(
    r"""(?:(?<![\w.~-])/|\b[A-Za-z]:\\|\b[a-z][a-z0-9+.-]*://)[^\s'",;()\[\]]*(?<!:)"""
)


def reason(error: BaseException) -> str:
    """A short reason for ``error`` that quotes nothing of files or paths."""
    if isinstance(error, SlideNotFoundError | FileNotFoundError):
        return "the file does not exist"
    if isinstance(error, TransientReadError):
        return "a read failed for want of a resource (it may work when asked again)"
    if isinstance(error, SlideChangedError):
        return "the file is not the one indexed"
    if isinstance(error, TileReadError):
        where = ""
        if error.l0_x is not None and error.l0_y is not None:
            where = f" at level-0 ({error.l0_x}, {error.l0_y}), level {error.level}"
        return f"the pixels{where} cannot be decoded"
    if isinstance(error, SlideOpenError):
        return "no reader can open the slide file"
    if isinstance(error, ResolutionError):
        return "the slide lacks the resolution asked for"
    if isinstance(error, SlideError):
        return "the slide cannot be read"
    if isinstance(error, AnnotationError):
        return "the annotation file cannot be read"
    if isinstance(error, InputError):  # the file's name and line, and what is wrong there
        text = str(error)
        where = ""
        if error.path:
            where = os.path.basename(error.path) + (f":{error.line}" if error.line else "")
            prefix = f"{error.path}:{error.line}: " if error.line else f"{error.path}: "
            text = text.removeprefix(prefix)
        said = scrub(text) or ""
        return f"{where}: {said}" if where else said
    if isinstance(error, OSError):
        return f"the file cannot be read ({error.strerror or type(error).__name__})"
    return type(error).__name__


def told(error: BaseException, slide_id: int, what: str) -> str:
    """`reason`, with the full text logged (a WARNING naming the slide and ``what`` failed)."""
    log.warning("slide %d: %s: %s", slide_id, what, error)
    return f"{reason(error)} {SEE_LOG}"


def scrub(text: str | None) -> str | None:
    """A stored text fit for the page: absolute paths and URLs as ``…``, quoted bytes as
    ``b'…'``, at most `MAX_TEXT` characters."""
    if text is None:
        return None
    text = _BYTES.sub("b'…'", text)
    text = _PATH.sub("…", text)
    return text if len(text) <= MAX_TEXT else text[: MAX_TEXT - 1] + "…"
