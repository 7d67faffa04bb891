"""Reward functions for GRPO, in TRL 1.16's reward signature, and their wiring for one trial.

TRL calls each one as `fn(prompts=..., completions=..., completion_ids=..., trainer_state=..., log_extra=...,
log_metric=..., **dataset_columns)` and wants one float (or None: not applicable) per completion. Completions are
strings, or for conversational prompts lists of messages `[{"role": "assistant", "content": "..."}]`. The gold count
arrives as the dataset column `solution`. All answer parsing goes through `evaluator.protocol`, so the rewards pay
exactly what the verifier scores; every function is total on any completion text.

None (only `reasoning_agreement` returns it): TRL turns it into NaN; the logged per-reward mean is a nanmean (over
the completions it applies to), but the weighted total is a nansum, so in training a None counts as 0.0.
"""

from __future__ import annotations

import functools
import re
from typing import Any, Callable

from evaluator.protocol import ANSWER_PATTERN, GENERATION_KWARGS, extract_answer, is_correct, parse_gold

# Completions up to this many tokens get the full brevity reward: an R1-V style answer is under 10 tokens, and
# this leaves room for a one-line thought.
BREVITY_FREE_TOKENS = 32
# The verifier generates at most this many tokens: anything longer loses its answer at evaluation.
VERIFIER_MAX_NEW_TOKENS: int = GENERATION_KWARGS["max_new_tokens"]

# Form checks stricter than the verifier (R1-V's format reward, and locating the reasoning); not answer parsing.
_THINK_FORMAT = re.compile(r"^<think>.*?</think>\s*<answer>.*?</answer>$", re.DOTALL)
_THINK_SECTION = re.compile(r"<think>(.*?)</think>", re.DOTALL)
_INTEGER = re.compile(r"\d+")  # `\d` as the verifier's pattern reads it, so the two compare like for like


def completion_text(completion: Any) -> str:
    """The text of one completion: a string as is, a list of messages as its string contents joined."""
    if isinstance(completion, str):
        return completion
    return "".join(
        message["content"]
        for message in completion
        if isinstance(message, dict) and isinstance(message.get("content"), str)
    )


def _int_or_none(digits: str) -> int | None:
    """`int(digits)`, or None when it is too long for `int()`."""
    try:
        return int(digits)
    except ValueError:
        return None


def accuracy(completions: list, solution: list, **kwargs: Any) -> list[float]:
    """1.0 exactly when the verifier scores the completion correct, else 0.0: the objective itself."""
    rewards = []
    for completion, gold_cell in zip(completions, solution, strict=True):
        gold = parse_gold(gold_cell)  # a malformed gold count is a data bug: it raises
        rewards.append(float(is_correct(completion_text(completion), gold)))
    return rewards


def _is_clean_answer(text: str) -> bool:
    """One `<answer>` tag pair, the verifier parses it, it holds a plain ASCII integer, and only whitespace follows."""
    if text.count("<answer>") != 1 or text.count("</answer>") != 1 or extract_answer(text) is None:
        return False
    match = ANSWER_PATTERN.search(text)
    digits = match.group(1)
    plain = digits.isascii() and (digits == "0" or not digits.startswith("0"))
    return plain and not text[match.end():].strip()


def answer_format(completions: list, **kwargs: Any) -> list[float]:
    """1.0 for a single clean `<answer>N</answer>` ending the completion: no hedging with several tags, padded
    numbers or text after the answer (the verifier takes the first match, so those are ways to game it)."""
    return [float(_is_clean_answer(completion_text(c))) for c in completions]


def think_format(completions: list, **kwargs: Any) -> list[float]:
    """1.0 for R1-V's strict `<think>...</think> <answer>...</answer>` form (after strip), else 0.0."""
    return [float(_THINK_FORMAT.match(completion_text(c).strip()) is not None) for c in completions]


def count_closeness(completions: list, solution: list, **kwargs: Any) -> list[float]:
    """Partial credit max(0, 1 - |pred - gold| / max(gold, 1)) on the verifier's answer; 0.0 when it does not parse.

    Linear in the relative error: an off-by-one costs less on large counts (where counting is hard, CrowdVLM-R1),
    the exact count gets 1.0 like `accuracy`, and answers at twice the gold or more get nothing (an exponential
    decay would still pay absurd guesses).
    """
    rewards = []
    for completion, gold_cell in zip(completions, solution, strict=True):
        gold = parse_gold(gold_cell)
        pred = extract_answer(completion_text(completion))
        if pred is None:
            rewards.append(0.0)
            continue
        scale = max(gold, 1)
        rewards.append(1.0 - min(abs(pred - gold), scale) / scale)  # min first: huge answers overflow a float
    return rewards


def brevity(
    completions: list,
    completion_ids: list,
    max_completion_length: int = VERIFIER_MAX_NEW_TOKENS,
    **kwargs: Any,
) -> list[float]:
    """Pays short answers that parse: 1.0 up to BREVITY_FREE_TOKENS tokens, falling linearly to 0.0 at the cap;
    -1.0 for a completion that reaches the cap or does not parse (the base model's looping lists)."""
    rewards = []
    for completion, ids in zip(completions, completion_ids, strict=True):
        length = len(ids)
        if length >= max_completion_length or extract_answer(completion_text(completion)) is None:
            rewards.append(-1.0)
        elif length <= BREVITY_FREE_TOKENS:
            rewards.append(1.0)
        else:  # here BREVITY_FREE_TOKENS < length < max_completion_length
            rewards.append((max_completion_length - length) / (max_completion_length - BREVITY_FREE_TOKENS))
    return rewards


def reasoning_agreement(completions: list, **kwargs: Any) -> list[float | None]:
    """1.0 when the last integer stated in the `<think>` section equals the verifier's answer, 0.0 when it differs;
    None (not applicable) without a closed `<think>` section holding an integer, or without a parsed answer."""
    rewards: list[float | None] = []
    for completion in completions:
        text = completion_text(completion)
        section = _THINK_SECTION.search(text)
        numbers = _INTEGER.findall(section.group(1)) if section else []
        answer = extract_answer(text)
        stated = _int_or_none(numbers[-1]) if numbers else None
        rewards.append(None if stated is None or answer is None else float(stated == answer))
    return rewards


REWARDS: dict[str, Callable[..., list[float | None]]] = {
    fn.__name__: fn
    for fn in (accuracy, answer_format, think_format, count_closeness, brevity, reasoning_agreement)
}


def build_reward_funcs(config: Any) -> tuple[list[Callable[..., list[float | None]]], list[float]]:
    """The reward callables and their weights for a TrialConfig, in `config.reward_weights` order.

    Zero-weight rewards are kept: they cost nothing, leave the advantage unchanged, and TRL still logs their mean,
    so a round shows e.g. its format rate whatever the search chose to weight. Functions that need the trial's
    settings are bound with `functools.partial` (picklable, named like the reward: TRL logs by that name).
    """
    funcs, weights = [], []
    for name, weight in config.reward_weights.items():
        if name not in REWARDS:
            raise ValueError(f"reward_weights: unknown reward {name!r}; known: {sorted(REWARDS)}")
        fn = REWARDS[name]
        if fn is brevity:
            # The cap that truncates: training's own, or the verifier's when training allows longer completions.
            cap = min(config.max_completion_length, VERIFIER_MAX_NEW_TOKENS)
            fn = functools.partial(brevity, max_completion_length=cap)
            fn.__name__ = name
        funcs.append(fn)
        weights.append(float(weight))
    return funcs, weights
