"""Whether a round fits its card, known before it is launched.

The trainer fits a round to its GPU by itself (trainer.memory.plan: checkpoint more layers, then split a step into
more micro-batches); a round that no plan fits would load the model, run out of memory and lose its slot's minutes,
again each time the sampler proposed it. The scheduler therefore asks for the same plan first, computed from the
model's config on the meta device (trainer.policy.meta_policy: the same parameters, dtypes and frozen parts as the
round loads, no weights read), and never launches a round whose every plan is over the card: it is told PRUNED with
the reason `does not fit: predicted X GB of Y GB`.

The card is `gpu_memory_gb` when the budget sets it (the trainer caps the card to it), else the smallest GPU of the
round's slot as the driver reports it (nvidia-smi: the scheduler creates no CUDA context of its own).
"""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass
from typing import Callable

from trainer import memory
from trainer.config import TrialConfig
from trainer.layout import batch_layout


@dataclass(frozen=True)
class Fit:
    """A round's memory plan on its card."""

    plan: memory.Plan
    card_bytes: float

    @property
    def fits(self) -> bool:
        return self.plan.fits

    @property
    def predicted_gb(self) -> float:
        return self.plan.peak_bytes / 1e9

    @property
    def usable_gb(self) -> float:
        return memory.HEADROOM * self.card_bytes / 1e9

    def reason(self) -> str:
        return f"does not fit: predicted {self.predicted_gb:.1f} GB of {self.usable_gb:.1f} GB"

    def attrs(self) -> dict:
        """What a trial records of it."""
        return {"predicted_peak_gb": round(self.predicted_gb, 1), "usable_gb": round(self.usable_gb, 1),
                "micro_batches": self.plan.micro_batches, "checkpoint_every": self.plan.checkpoint_every}  # fmt: skip


class FitCheck:
    """`check(config, gpus) -> Fit | None` for rounds of one model: None when there is nothing to check (the CPU, or
    a card whose memory is unknown)."""

    def __init__(self, model_config: Callable[[], object], card_bytes: Callable[[list[int]], float | None]):
        self._model_config = model_config  # called once, at the first check: loading transformers is slow
        self._card_bytes = card_bytes
        self._policies: dict[tuple[bool, bool], object] = {}  # (full fine-tuning, vision trains) -> meta policy

    def __call__(self, config: TrialConfig, gpus: list[int]) -> Fit | None:
        if not gpus:
            return None
        card = self._card_bytes(gpus)
        if card is None:
            return None
        layout = batch_layout(config, len(gpus))
        footprint = memory.round_footprint(config, self.policy(config), layout.per_device_train_batch_size)
        return Fit(memory.plan(footprint, card, every=memory.fixed_interval(config)), card)

    def policy(self, config: TrialConfig):
        """The meta-device policy a round of `config` trains (one per kind of round, built once)."""
        from trainer.policy import meta_policy  # late: it imports transformers' Qwen2-VL classes

        key = (config.full_finetuning, config.train_vision_tower)
        if key not in self._policies:
            self._policies[key] = meta_policy(self._model_config(), config)
        return self._policies[key]


def card_bytes_of(gpu_memory_gb: float | None) -> Callable[[list[int]], float | None]:
    """The card a round of `gpus` gets: `gpu_memory_gb` when set, else the smallest of those GPUs' memories as
    nvidia-smi reports them (None when it cannot tell)."""
    totals: dict[int, float] | None = None

    def card(gpus: list[int]) -> float | None:
        nonlocal totals
        if gpu_memory_gb is not None:
            return gpu_memory_gb * 1e9
        if totals is None:
            totals = _driver_totals()
        known = [totals[gpu] for gpu in gpus if gpu in totals]
        return min(known) if known and len(known) == len(gpus) else None

    return card


def _driver_totals() -> dict[int, float]:
    """Each visible GPU's total memory in bytes, by its index among the visible ones; {} when the driver cannot
    tell."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=index,memory.total", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=30, check=True).stdout  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return {}
    by_index = {}
    for line in out.splitlines():
        index, _, mib = line.partition(",")
        if index.strip().isdigit() and mib.strip().isdigit():
            by_index[index.strip()] = float(mib) * 2**20
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    order = [v.strip() for v in visible.split(",")] if visible else sorted(by_index, key=int)
    return {i: by_index[name] for i, name in enumerate(order) if name in by_index}
