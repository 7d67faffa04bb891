"""The scheduler's printed lines: a round described in a few words, the status line."""

from __future__ import annotations

from typing import TYPE_CHECKING

from trainer.run_folder import Phase

if TYPE_CHECKING:
    from search.merge import Candidate
    from trainer.config import TrialConfig

STATUS_EVERY_S = 60.0  # a status line at least this often while nothing changes


def describe(config: TrialConfig) -> str:
    kind = f"LoRA r{config.lora_rank}" if config.lora_rank else "full"
    rewards = "+".join(name for name, w in config.reward_weights.items() if w > 0)
    return f"{kind} lr {config.learning_rate:.2g} beta {config.beta:.2g} G{config.num_generations} [{rewards}]"


def describe_merge(candidate: Candidate) -> str:
    what = f"{candidate.kind} soup of rounds {'+'.join(map(str, candidate.ingredients))}"
    return what if candidate.eta == 1.0 else f"{what} at eta {candidate.eta:g} from the base"


def gpus_text(gpus: list[int]) -> str:
    return f"gpu {','.join(map(str, gpus))}" if gpus else "cpu"


class StatusLine:
    """One line on the running rounds, when they change and at least every STATUS_EVERY_S while they do not."""

    def __init__(self):
        self._at = float("-inf")
        self._key: tuple = ()

    def due(self, rounds: list, now: float) -> str | None:
        """The line for `rounds` (the scheduler's running rounds, by trial number) at `now`, or None when not due."""
        key = tuple((r.trial.number, r.handle.phase(), r.pruned, r.stopped) for r in rounds)
        if key == self._key and now - self._at < STATUS_EVERY_S:
            return None
        self._key, self._at = key, now
        parts = []
        for r in rounds:
            if r.merge is not None and r.handle.phase() == Phase.TRAINING:
                text = "building a merge"
            elif r.handle.phase() == Phase.TRAINING:
                line = r.latest
                text = f"step {line.get('step', 0)}/{r.config.steps}"
                if isinstance(line.get("reward"), (int, float)):
                    text += f" reward {line['reward']:.2f}"
                if r.latest_ood is not None:
                    text += f" ood {r.latest_ood:.1f}"
            else:
                text = Phase.EVALUATING
            parts.append(f"#{r.trial.number} {gpus_text(r.gpus)} {text}")
        return " | ".join(parts)
