"""How an exception that ended a round becomes its failure: a kind the search acts on, and a reason a person reads."""

from __future__ import annotations

import traceback

import torch

from trainer.run_folder import FailureKind

TRACEBACK_LINES = 8


def describe_exception(exc: BaseException) -> tuple[FailureKind, str]:
    """The kind, and `<Type>: <message>` plus the last traceback lines (prefixed "out of memory: " for one)."""
    tail = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)).strip().splitlines()
    summary = f"{type(exc).__name__}: {exc}"
    kind = FailureKind.OUT_OF_MEMORY if _is_out_of_memory(exc) else FailureKind.ERROR
    if kind == FailureKind.OUT_OF_MEMORY:
        summary = f"out of memory: {summary}"
    return kind, summary + "\n" + "\n".join(tail[-TRACEBACK_LINES:])


def _is_out_of_memory(exc: BaseException) -> bool:
    # torch.OutOfMemoryError is torch.cuda.OutOfMemoryError; a CPU allocation failure is a RuntimeError/MemoryError.
    if isinstance(exc, (torch.OutOfMemoryError, MemoryError)):
        return True
    return isinstance(exc, RuntimeError) and "out of memory" in str(exc).lower()
