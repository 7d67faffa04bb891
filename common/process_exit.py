"""The end of a command-line process that has nothing left to do: its output flushed, then no interpreter teardown.

A process that held a compiled model on a GPU spends seconds after its last line in Python's teardown (collecting the
model's modules, CUDA graphs and caches, shutting inductor's compile workers down), while its caller waits for it to
end. Every file it wrote is closed by then, so the operating system can reclaim the rest at once.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import NoReturn


def exit_now(code: int) -> NoReturn:
    """Flush stdout, stderr and the logging handlers, then end the process with `code`, skipping the teardown (and
    atexit handlers: call it only where the process has finished its work)."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed or broken pipe: nothing more can reach the reader
            pass
    os._exit(code)
