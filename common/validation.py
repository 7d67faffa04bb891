"""Values checked before anything is written: their type first, then their range; errors that name the key.

The one validation layer of the project: the trial configuration (trainer/config.py), the search space
(search/space.py), the budget and the command line (search/settings.py) all check their values with these functions
and raise `InvalidValue` or a subclass of it. Its `key` is the value's path ("space.beta.low",
"warm_starts[0].params.lora_rank"); `under()` moves an error below a parent key, so that no caller edits another's
message. Every message is one line of at most `MAX_MESSAGE` characters, values shown shortened: a budget value may be
a megabyte of text or a billion-element YAML alias expansion.
"""

from __future__ import annotations

import difflib
import math
import reprlib
import unicodedata
from typing import Any, Iterable, Mapping

MAX_MESSAGE = 400  # characters of one error message; the rest is cut
_SHORT = reprlib.Repr()  # Python 3.11's Repr takes its limits as attributes only
_SHORT.maxlevel, _SHORT.maxstring, _SHORT.maxother, _SHORT.maxlong = 3, 80, 80, 40
_SHORT.maxlist = _SHORT.maxtuple = _SHORT.maxdict = _SHORT.maxset = _SHORT.maxfrozenset = _SHORT.maxdeque = 6


class InvalidValue(ValueError):
    """A value that cannot be used; `key` is its path (empty for the whole document), the message one line."""

    def __init__(self, key: str, message: str):
        self.key = key
        self.message = message
        super().__init__(one_line(f"{key}: {message}" if key else message))

    def under(self, parent: str, kind: type[InvalidValue] | None = None) -> InvalidValue:
        """This error with its key below `parent`, as an error of `kind` (default: its own)."""
        return (kind or type(self))(join_key(parent, self.key), self.message)


def join_key(parent: str, key: str) -> str:
    if not key:
        return parent
    if not parent:
        return key
    return f"{parent}{key}" if key.startswith("[") else f"{parent}.{key}"


def show(value: Any) -> str:
    """A value as Python writes it, shortened: long strings, big containers and deep nesting are cut."""
    return _SHORT.repr(value)


def show_key(key: Any) -> str:
    """A mapping key for a key path: a string as it is (cut if long), anything else shortened as `show` does."""
    return _SHORT.repr(key)[1:-1] if isinstance(key, str) and key.isprintable() else show(key)


def one_line(text: Any) -> str:
    """`text` on one line, cut to MAX_MESSAGE characters: every error of the search's CLI is one stderr line."""
    line = " ".join(str(text).split())
    return line if len(line) <= MAX_MESSAGE else line[: MAX_MESSAGE - 3] + "..."


def did_you_mean(name: Any, known: Iterable[str]) -> str:
    """' (did you mean 'x'?)' for a close known name, else ''."""
    if not isinstance(name, str):
        return ""
    close = difflib.get_close_matches(name, list(known), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def unknown_keys(mapping: Mapping, known: Iterable[Any]) -> list[Any]:
    """The keys of `mapping` not in `known`, in the mapping's order (YAML keys need not be strings, nor sortable)."""
    known = set(known)
    return [key for key in mapping if not (isinstance(key, str) and key in known)]


# ---------------------------------------------------------------------------------------------------------- checks
def is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def number(
    key: str,
    value: Any,
    *,
    low: float | None = None,
    high: float | None = None,
    low_open: bool = False,
    high_open: bool = False,
    error: type[InvalidValue] = InvalidValue,
) -> int | float:
    """A finite int or float (not a bool) within the bounds; returned as given."""
    if not is_number(value):
        raise error(key, f"must be a number, got {show(value)}")
    if not math.isfinite(value):
        raise error(key, f"must be a finite number, got {show(value)}")
    too_low = low is not None and (value <= low if low_open else value < low)
    too_high = high is not None and (value >= high if high_open else value > high)
    if too_low or too_high:
        raise error(key, f"must be {_bounds(low, high, low_open, high_open)}, got {show(value)}")
    return value


def integer(
    key: str, value: Any, *, low: int | None = None, high: int | None = None, error: type[InvalidValue] = InvalidValue
) -> int:
    """An int (not a bool, not a float with an integral value) within the bounds."""
    if not isinstance(value, int) or isinstance(value, bool):
        raise error(key, f"must be an integer, got {show(value)}")
    if (low is not None and value < low) or (high is not None and value > high):
        raise error(key, f"must be an integer {_bounds(low, high, False, False)}, got {show(value)}")
    return value


def boolean(key: str, value: Any, *, error: type[InvalidValue] = InvalidValue) -> bool:
    if not isinstance(value, bool):
        raise error(key, f"must be true or false, got {show(value)}")
    return value


def text(key: str, value: Any, *, max_length: int | None = None, error: type[InvalidValue] = InvalidValue) -> str:
    """A non-empty, non-blank string of UTF-8 text without control characters (C0, DEL and C1: a newline or NEL would
    break a one-line message, a CSI rewrite the terminal, a NUL every path and database call; nor the line and
    paragraph separators), of at most `max_length` characters. Bytes of the command line that are not UTF-8 arrive as
    lone surrogates (Python's surrogateescape), which no file or database takes: refused too."""
    if not isinstance(value, str) or not value.strip():
        raise error(key, f"must be a non-empty string, got {show(value)}")
    if any(unicodedata.category(c) == "Cs" for c in value):
        raise error(key, f"must be UTF-8 text, got bytes that are not: {show(value)}")
    if any(unicodedata.category(c) in ("Cc", "Zl", "Zp") for c in value):
        raise error(key, f"must not hold control characters, got {show(value)}")
    if max_length is not None and len(value) > max_length:
        raise error(key, f"must be at most {max_length} characters, got {len(value)}")
    return value


def one_of(key: str, value: Any, choices: Iterable[Any], *, error: type[InvalidValue] = InvalidValue) -> Any:
    """`value` if it equals one of `choices` and has its type (a YAML `true` is not the choice 1)."""
    choices = list(choices)
    for choice in choices:
        if type(choice) is type(value) and choice == value:
            return value
    raise error(key, f"must be one of {choices}, got {show(value)}")


def mapping(key: str, value: Any, what: str, *, error: type[InvalidValue] = InvalidValue) -> Mapping:
    if not isinstance(value, Mapping):
        raise error(key, f"must be a mapping of {what}, got {show(value)}")
    return value


def _bounds(low: float | None, high: float | None, low_open: bool, high_open: bool) -> str:
    if low is not None and high is not None:
        return f"in {'(' if low_open else '['}{low}, {high}{')' if high_open else ']'}"
    if low is not None:
        return f"{'>' if low_open else '>='} {low}"
    return f"{'<' if high_open else '<='} {high}"
