"""How a search or a leaderboard ends when its user stops it: Ctrl-C (SIGINT), SIGTERM, or a closed stdout pipe.

Each ends the program through the same path as Ctrl-C (KeyboardInterrupt, which the scheduler's cleanup and
`search.run` handle: one line, no traceback), with its own exit code: 130 and 143 as a shell reports a process ended
by SIGINT or SIGTERM, 141 (SIGPIPE's) for a closed pipe. `handled()` installs the handlers around a run; while it is
on, a second signal is ignored (the cleanup the first one started runs to its end), and `deferred()` holds a signal
until a short section is over (a new trial recorded as this worker's, so that the cleanup finds it).
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from typing import Iterator


class Terminated(KeyboardInterrupt):
    """SIGTERM."""


class OutputClosed(KeyboardInterrupt):
    """The reader of stdout went away (`| head`)."""


EXIT_CODES = {Terminated: 143, OutputClosed: 141, KeyboardInterrupt: 130}

_installed = False
_raised = False  # a signal has been turned into an exception: later ones are ignored
_deferring = 0
_pending: type[KeyboardInterrupt] | None = None


def exit_code(interrupt: KeyboardInterrupt) -> int:
    return EXIT_CODES.get(type(interrupt), 130)


def _on_signal(signum: int, frame: object) -> None:
    global _raised, _pending
    if _raised:
        return
    kind = Terminated if signum == signal.SIGTERM else KeyboardInterrupt
    if _deferring:
        _pending = _pending or kind
        return
    _raised = True
    raise kind


@contextlib.contextmanager
def handled() -> Iterator[None]:
    """SIGINT and SIGTERM raise KeyboardInterrupt and Terminated inside; the handlers before are restored after. Only
    in the main thread (where Python runs signal handlers); elsewhere nothing changes."""
    global _installed, _raised, _pending
    if threading.current_thread() is not threading.main_thread() or _installed:
        yield
        return
    previous = {signum: signal.signal(signum, _on_signal) for signum in (signal.SIGINT, signal.SIGTERM)}
    _installed, _raised, _pending = True, False, None
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        _installed = False


@contextlib.contextmanager
def deferred() -> Iterator[None]:
    """A signal that arrives inside is raised when the section ends (at once without `handled`)."""
    global _deferring, _pending, _raised
    _deferring += 1
    try:
        yield
    finally:
        _deferring -= 1
        if not _deferring and _pending is not None:
            kind, _pending = _pending, None
            _raised = True
            raise kind


def stdout_closed() -> OutputClosed:
    """Point stdout at /dev/null (so that the interpreter's last flush does not fail again) and say why the run ends."""
    with contextlib.suppress(OSError, ValueError):
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    return OutputClosed()
