"""What runs a round for the scheduler, and the clock it runs on.

The scheduler decides what runs and when; a backend starts it and reports back (`Backend`, `RoundHandle`,
`RoundOutcome`): `LocalBackend` as processes on this machine's GPUs, `SimulatedBackend` as a model of them on a
`VirtualClock` (`--simulate`). `FitCheck` predicts, before a launch, whether a round fits its card.
"""

from search.backends.base import TIMING_KEYS, Backend, RoundHandle, RoundOutcome
from search.backends.clock import Clock, VirtualClock, WallClock
from search.backends.fit import Fit, FitCheck, card_bytes_of
from search.backends.local import LocalBackend, model_config, reap_processes, threads_per_round
from search.backends.simulated import SimulatedBackend

__all__ = [
    "TIMING_KEYS", "Backend", "Clock", "Fit", "FitCheck", "LocalBackend", "RoundHandle", "RoundOutcome",
    "SimulatedBackend", "VirtualClock", "WallClock", "card_bytes_of", "model_config", "reap_processes",
    "threads_per_round",
]  # fmt: skip
