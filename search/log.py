"""The one place the search prints a line: to stdout or stderr, and, during a search, with its time into `search.log`
(`recording`), where Optuna's own lines go too.

A search's first lines come before its input is checked (the demo's build), and bad input must write nothing: so
lines are held in memory until `Recording.open` names the file, and dropped if it never does.
"""

from __future__ import annotations

import contextlib
import logging
import sys
from logging.handlers import MemoryHandler
from pathlib import Path
from typing import Callable, Iterator

from search import interrupts

LOG_NAME = "search.log"
_TIME_FORMAT = "%Y-%m-%d %H:%M:%S"

_logger = logging.getLogger(__name__)
_logger.setLevel(logging.INFO)
_logger.propagate = False  # the lines are already printed; a root handler would print them twice
_logger.addHandler(logging.NullHandler())  # and no handler at all would print warnings again (logging.lastResort)


def _as_is(text: str) -> str:
    return text


_redact: Callable[[str], str] = _as_is  # a recording's, while one runs


def say(line: str) -> None:
    """Print `line` (one or several lines) to stdout, and log it. A closed stdout (`| head`) raises OutputClosed, which
    ends the run as an interrupt does (search.interrupts); the line is logged first."""
    line = _redact(line)
    _logger.info(line)
    try:
        print(line, flush=True)
    except BrokenPipeError:
        raise interrupts.stdout_closed() from None


def warn(line: str) -> None:
    """Print `line` to stderr, and log it."""
    line = _redact(line)
    print(line, file=sys.stderr, flush=True)
    _logger.warning(line)


class _EachLineTimed(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        stamp = self.formatTime(record, _TIME_FORMAT)
        text = _redact(record.getMessage())  # Optuna's lines too
        return "\n".join(f"{stamp} {line}" for line in text.splitlines() or [""])


# Whose lines a recording keeps: the search's, and Optuna's own (printed by Optuna's handler).
_SOURCES = (_logger, logging.getLogger("optuna"))


class Recording:
    def __init__(self) -> None:
        self._held = MemoryHandler(capacity=1 << 30, flushLevel=logging.CRITICAL + 1)  # flushed by `open` only
        self._file: logging.FileHandler | None = None
        self.path: Path | None = None

    def open(self, path: Path) -> None:
        """Append the lines held so far, and every later one, to `path` (its folder is created)."""
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file = logging.FileHandler(path, encoding="utf-8")
        self._file.setFormatter(_EachLineTimed())
        self._held.setTarget(self._file)
        self._held.flush()
        for source in _SOURCES:
            source.removeHandler(self._held)
            source.addHandler(self._file)
        self.path = path

    def _close(self) -> None:
        for handler in (self._held, self._file):
            if handler is not None:
                for source in _SOURCES:
                    source.removeHandler(handler)
                handler.close()


@contextlib.contextmanager
def recording(redact: Callable[[str], str] = _as_is) -> Iterator[Recording]:
    """Hold the lines said and warned inside (printed `redact`ed, as they are logged) until `Recording.open` names
    their file; dropped if it never does."""
    global _redact
    record = Recording()
    for source in _SOURCES:
        source.addHandler(record._held)
    _redact = redact
    try:
        yield record
    finally:
        record._close()
        _redact = _as_is


def minutes(seconds: float) -> str:
    """A duration as the printed lines show it: `42 min`, `1h05`."""
    seconds = max(0.0, seconds)
    hours, whole = divmod(int(round(seconds / 60)), 60)
    return f"{hours}h{whole:02d}" if hours else f"{whole} min"
