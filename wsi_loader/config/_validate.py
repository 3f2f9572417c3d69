"""Validation of a section, and pydantic's errors turned into a `ConfigError` that names the
key (a misspelt one with the known key it is closest to), the value and the file."""

from __future__ import annotations

import difflib
import reprlib
import types
import typing
from collections.abc import Iterable
from typing import Any

from pydantic import BaseModel, ValidationError

from wsi_loader.config._base import Strict
from wsi_loader.errors import ConfigError


class OptionValueError(ValueError):
    """What a validator of a section raises about one of its keys (``key``, dotted, relative
    to the section; its ``value``, said as invalid when ``invalid``): the error then names
    that key, not the whole section, and says the problem in words."""

    def __init__(self, message: str, *, key: str, value: Any = None, invalid: bool = False) -> None:
        super().__init__(message)
        self.key = key
        self.value = value
        self.invalid = invalid


# what error messages render of a value: bounded, so a YAML alias bomb (a few hundred bytes
# that expand to gigabytes when printed) cannot exhaust memory through a message
_SHORT = reprlib.Repr()
_SHORT.maxlevel, _SHORT.maxstring, _SHORT.maxother = 3, 80, 80
_SHORT.maxlist = _SHORT.maxdict = _SHORT.maxtuple = _SHORT.maxset = 6


def close_key(key: str, known: Iterable[str], cutoff: float = 0.6) -> str:
    """`` (did you mean 'tile_size'?)`` for a misspelt key (difflib's closest of ``known``
    with a similarity of at least ``cutoff``), or nothing when none is close."""
    close = difflib.get_close_matches(key, list(known), n=1, cutoff=cutoff)
    return f" (did you mean {close[0]!r}?)" if close else ""


def check_keywords(function: str, given: Iterable[str], known: Iterable[str]) -> None:
    """Raise Python's ``TypeError`` for a keyword ``function`` does not take, naming
    ``function`` (not the inner function the keywords are passed on to) and the close key."""
    choices = sorted(known)
    for key in given:
        if key not in choices:
            raise TypeError(
                f"{function}() got an unexpected keyword argument {key!r}" + close_key(key, choices)
            )


def _describe(
    error: ValidationError, source: str | None, model: type[BaseModel] | None = None
) -> ConfigError:
    first = error.errors(include_input=True, include_url=False)[0]
    key = ".".join(str(part) for part in first["loc"]) or None
    value = first.get("input")
    if first["type"] == "extra_forbidden":
        message = f"unknown key {key!r}"
        if model is not None and first["loc"]:
            message += close_key(str(first["loc"][-1]), _keys_at(model, first["loc"][:-1]))
    elif first["type"] == "value_error":  # a validator's own words, without pydantic's
        problem = first.get("ctx", {}).get("error")
        text = str(problem) if problem is not None else first["msg"]
        invalid = not isinstance(value, dict)  # a field's value, not a whole section's
        if isinstance(problem, OptionValueError):
            key = f"{key}.{problem.key}" if key else problem.key
            value, invalid = problem.value, problem.invalid
        if key and invalid:
            message = f"invalid value {_SHORT.repr(value)} for {key!r}: {text}"
        else:  # a rule of a section: its key, never a dump of the section
            message = f"{key!r}: {text}" if key else text
            value = None if isinstance(value, dict) else value
    elif key:
        message = f"invalid value {_SHORT.repr(value)} for {key!r}: {first['msg']}"
    else:
        message = first["msg"]
    more = len(error.errors()) - 1
    if more:
        message += f" (and {more} more problem{'s' if more > 1 else ''})"
    return ConfigError(message, path=source, key=key, value=value)


def _keys_at(model: type[BaseModel], loc: tuple[int | str, ...]) -> list[str]:
    """The keys the section at ``loc`` (a pydantic error location) accepts."""
    current: type[BaseModel] | None = model
    for part in loc:
        if isinstance(part, int):  # an item of a list: the model is the list's item type
            continue
        field = current.model_fields.get(part) if current is not None else None
        if field is None:
            return []
        current = _model_in(field.annotation)
    return list(current.model_fields) if current is not None else []


def _model_in(annotation: Any) -> type[BaseModel] | None:
    """The model inside ``X``, ``X | None`` or ``list[X]``."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    if typing.get_origin(annotation) in (list, typing.Union, types.UnionType):
        for arg in typing.get_args(annotation):
            found = _model_in(arg)
            if found is not None:
                return found
    return None


def validate(model: type[Strict], data: Any, source: str | None = None, prefix: str = "") -> Any:
    """Validate ``data`` into ``model``; raise `ConfigError` naming key, value and ``source``
    (an unknown key with the known one it is closest to)."""
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        err = _describe(exc, source, model)
        if prefix and err.key:
            err.key = f"{prefix}.{err.key}"
        raise err from None
