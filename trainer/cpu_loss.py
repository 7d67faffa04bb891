"""Off CUDA, the GRPO loss scores only the completion positions, as TRL already does on CUDA.

TRL 1.16's fused LM-head loss scores only the completion positions on CUDA (Triton), but every position of prompt and
completion on any other device (to keep its tile shapes fixed for compilers such as Neuron's). On a CPU, with the
counting model's 151,936-row LM head and ~80-token prompts ahead of ~9-token completions, that is ~9x the head's work
in the loss forward and backward: 77% of a step. Scoring only the completion positions gives the same
log-probabilities, loss and gradients (tests/test_trainer.py) at ~3.2 s a step instead of ~19.5 s (2 cores). The
switch is TRL's own `compact` path, chosen by `trl.trainer.utils._use_triton`; only that module's name is rebound, so
the kernel's own Triton choice stays. Written here because TRL exposes no option for it.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def completion_positions_only() -> Iterator[None]:
    import trl.trainer.utils as trl_utils

    original = getattr(trl_utils, "_use_triton", None)
    if original is None:  # a TRL without the switch: nothing to rebind
        yield
        return
    trl_utils._use_triton = lambda device: True
    try:
        yield
    finally:
        trl_utils._use_triton = original
