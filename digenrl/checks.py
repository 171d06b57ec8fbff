"""Checking a value before any work starts, in one way everywhere.

Every check raises one line that names the field (a config path, a command-line flag,
a profile's field), what it expected and what arrived: ``FIELD: expected WHAT, got
VALUE``. The config, the cost profiles, the network study's settings, the deployment
renderer and the reward server's flags all check with these. ``error`` is the exception
a check raises: :class:`ConfigError` unless the caller's layer has its own.
"""

from __future__ import annotations

import math
from typing import Any, Iterable, NoReturn

__all__ = ["ConfigError", "fail", "require", "is_int", "positive_int", "finite", "choice",
           "sub_path"]


class ConfigError(ValueError):
    """A configuration value is invalid. The message names the field."""


def fail(path: str, expected: str, got: Any, error: type[Exception] = ConfigError) -> NoReturn:
    """Raise ``error``: ``path: expected EXPECTED, got repr(GOT)``."""
    raise error(f"{path}: expected {expected}, got {got!r}")


def require(ok: Any, path: str, expected: str, got: Any,
            error: type[Exception] = ConfigError) -> None:
    """:func:`fail` unless ``ok``."""
    if not ok:
        fail(path, expected, got, error)


def is_int(v: Any) -> bool:
    """An integer, and not a bool."""
    return isinstance(v, int) and not isinstance(v, bool)


def positive_int(v: Any, path: str, minimum: int = 1,
                 error: type[Exception] = ConfigError) -> None:
    require(is_int(v) and v >= minimum, path, f"an integer >= {minimum}", v, error)


def finite(v: Any, path: str, lo: float | None = None, hi: float | None = None,
           lo_open: bool = False, hi_open: bool = False,
           error: type[Exception] = ConfigError) -> None:
    """A finite number (not a bool) within the bounds, each closed unless ``*_open``."""
    ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
    if ok and lo is not None:
        ok = v > lo if lo_open else v >= lo
    if ok and hi is not None:
        ok = v < hi if hi_open else v <= hi
    bounds = []
    if lo is not None:
        bounds.append(f"{'>' if lo_open else '>='} {lo}")
    if hi is not None:
        bounds.append(f"{'<' if hi_open else '<='} {hi}")
    require(ok, path, "a finite number" + (" " + " and ".join(bounds) if bounds else ""), v,
            error)


def choice(v: Any, path: str, options: Iterable[str],
           error: type[Exception] = ConfigError) -> None:
    """One of ``options`` (named sorted in the message)."""
    options = sorted(options)
    require(v in options, path, f"one of {options}", v, error)


def sub_path(path: str, key: Any) -> str:
    """The dotted path of ``key`` under ``path``; a key that is not a plain word (spaces,
    line breaks, an empty string, not a string) is shown quoted, ``path['a b']``."""
    if isinstance(key, str) and key and key.isprintable() and not any(
            c.isspace() or c in ".[]'\"" for c in key):
        return f"{path}.{key}" if path else key
    return f"{path}[{key!r}]"
