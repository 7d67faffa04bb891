"""The reward functions: reward-hacking cases, totality, agreement with the verifier, and the trial wiring."""

from __future__ import annotations

import math
import pickle
import random

import pytest

from evaluator.protocol import is_correct
from trainer.config import ConfigError, TrialConfig
from trainer.rewards import (
    BREVITY_FREE_TOKENS,
    REWARDS,
    VERIFIER_MAX_NEW_TOKENS,
    accuracy,
    answer_format,
    brevity,
    build_reward_funcs,
    completion_text,
    count_closeness,
    reasoning_agreement,
    think_format,
)

LONG = "<think>" + "one, two, three, " * 580 + "</think><answer>3</answer>"  # ~10,000 characters
HUGE_NUMBER = "<answer>" + "3" * 10_000 + "</answer>"  # more digits than int() converts


def call(fn, texts, gold=3, lengths=None, **kwargs):
    """Call a reward as TRL does, with a batch of completions for one gold count."""
    lengths = lengths or [10] * len(texts)
    return fn(
        prompts=[[{"role": "user", "content": "How many?"}]] * len(texts),
        completions=texts,
        completion_ids=[[7] * n for n in lengths],
        trainer_state=None,
        solution=[f"<answer> {gold} </answer>"] * len(texts),
        problem=["How many?"] * len(texts),
        **kwargs,
    )


def one(fn, text, gold=3, length=10, **kwargs):
    return call(fn, [text], gold, [length], **kwargs)[0]


# ---------------------------------------------------------------- hacking cases, gold = 3
# text -> (accuracy, answer_format, count_closeness)
CASES = {
    "<answer>3</answer>": (1.0, 1.0, 1.0),
    "<answer> 3 </answer>": (1.0, 1.0, 1.0),
    "<answer>\n3\n</answer>\n": (1.0, 1.0, 1.0),
    "<think>a red cube and two spheres</think><answer>3</answer>": (1.0, 1.0, 1.0),
    "<answer>3</answer><answer>4</answer>": (1.0, 0.0, 1.0),  # first tag counts for the verifier; hedging
    "<answer>4</answer><answer>3</answer>": (0.0, 0.0, 2 / 3),
    "<answer>3</answer> or maybe 4": (1.0, 0.0, 1.0),  # text after the tag
    "<answer>03</answer>": (1.0, 0.0, 1.0),  # int('03') == 3 for the verifier, but not a clean integer
    "<answer>0</answer>": (0.0, 1.0, 0.0),
    "<answer>3.0</answer>": (0.0, 0.0, 0.0),
    "<answer>three</answer>": (0.0, 0.0, 0.0),
    "<answer>-3</answer>": (0.0, 0.0, 0.0),
    "<answer>٣</answer>": (1.0, 0.0, 1.0),  # Arabic-Indic 3: `\d` and int() accept it
    "<answer>３</answer>": (1.0, 0.0, 1.0),  # fullwidth 3
    "<answer>3 4</answer>": (0.0, 0.0, 0.0),
    "<answer>3": (0.0, 0.0, 0.0),  # truncated
    "3": (0.0, 0.0, 0.0),  # no fallback
    "": (0.0, 0.0, 0.0),
    "<think>maybe <answer>2</answer></think><answer>3</answer>": (0.0, 0.0, 2 / 3),  # the verifier reads the 2
    "<answer>5</answer>": (0.0, 1.0, 1 / 3),
    "<answer>6</answer>": (0.0, 1.0, 0.0),
    "<answer>1000000</answer>": (0.0, 1.0, 0.0),
    LONG: (1.0, 1.0, 1.0),
    HUGE_NUMBER: (0.0, 0.0, 0.0),  # the verifier's int() refuses it; no reward raises
}


@pytest.mark.parametrize("text", list(CASES), ids=lambda t: repr(t[:40]))
def test_hacking_cases(text):
    expected_accuracy, expected_format, expected_closeness = CASES[text]
    assert one(accuracy, text) == expected_accuracy
    assert one(answer_format, text) == expected_format
    assert one(count_closeness, text) == pytest.approx(expected_closeness)


def test_accuracy_is_the_verifier_on_the_cases():
    for text, (expected, _, _) in CASES.items():
        if text != HUGE_NUMBER:  # the verifier's own is_correct raises there (int() digit limit)
            assert float(is_correct(text, 3)) == expected


def test_gold_forms_and_bad_gold():
    texts = ["<answer>5</answer>"] * 3
    assert accuracy(completions=texts, solution=["<answer> 5 </answer>", " 5 ", 5]) == [1.0, 1.0, 1.0]
    with pytest.raises(ValueError, match="solution"):
        accuracy(completions=texts[:1], solution=["five"])


def test_count_closeness_gold_zero_and_large_counts():
    assert one(count_closeness, "<answer>0</answer>", gold=0) == 1.0
    assert one(count_closeness, "<answer>1</answer>", gold=0) == 0.0
    assert one(count_closeness, "<answer>9</answer>", gold=10) == pytest.approx(0.9)
    assert one(count_closeness, "<answer>" + "9" * 4000 + "</answer>", gold=10) == 0.0  # no float overflow


def test_think_format():
    assert one(think_format, "<think>two cubes, one sphere</think>\n<answer>3</answer>") == 1.0
    assert one(think_format, "  <think>\nx\n</think><answer>3</answer>\n") == 1.0  # stripped first
    assert one(think_format, "<answer>3</answer>") == 0.0  # R1-V's form needs the reasoning
    assert one(think_format, "<think>x</think><answer>3</answer> done") == 0.0
    assert one(think_format, "Sure! <think>x</think><answer>3</answer>") == 0.0
    assert one(think_format, "<think>x</think>") == 0.0
    assert one(think_format, "") == 0.0


def test_brevity_shape():
    cap = 256
    parse = "<answer>3</answer>"
    got = call(brevity, [parse] * 5, lengths=[5, BREVITY_FREE_TOKENS, 144, cap - 1, cap], max_completion_length=cap)
    assert got[:2] == [1.0, 1.0]
    assert got[2] == pytest.approx((cap - 144) / (cap - BREVITY_FREE_TOKENS))
    assert 0.0 < got[3] < 0.01
    assert got[4] == -1.0  # hit the cap
    assert call(brevity, ["3", "", "<answer>three</answer>"], max_completion_length=cap) == [-1.0] * 3
    assert one(brevity, parse, length=5000, max_completion_length=cap) == -1.0
    assert one(brevity, parse, length=VERIFIER_MAX_NEW_TOKENS) == -1.0  # default cap: the verifier's
    assert one(brevity, parse, length=5, max_completion_length=8) == 1.0  # a cap below the free length


def test_reasoning_agreement():
    assert one(reasoning_agreement, "<think>1, 2, 3 objects</think><answer>3</answer>") == 1.0
    assert one(reasoning_agreement, "<think>I count 4</think><answer>3</answer>") == 0.0
    assert one(reasoning_agreement, "<think>maybe <answer>2</answer></think><answer>3</answer>") == 1.0  # 2 == 2
    assert one(reasoning_agreement, "<answer>3</answer>") is None  # no reasoning
    assert one(reasoning_agreement, "<think>some cubes</think><answer>3</answer>") is None  # no number stated
    assert one(reasoning_agreement, "<think>I count 3</think>") is None  # no answer
    assert one(reasoning_agreement, "<think>3</think><answer>٣</answer>") == 1.0
    assert one(reasoning_agreement, "<think>" + "7" * 5000 + "</think><answer>3</answer>") is None


def test_conversational_completions():
    chat = [[{"role": "assistant", "content": text}] for text in CASES]
    plain = list(CASES)
    for name, fn in REWARDS.items():
        assert call(fn, chat) == call(fn, plain), name
    split = [{"role": "assistant", "content": "<answer>"}, {"role": "assistant", "content": "3</answer>"}]
    assert completion_text(split) == "<answer>3</answer>"
    assert completion_text([{"role": "assistant", "content": None}]) == ""


NASTY = [
    "",
    " ",
    "\x00",
    LONG,
    HUGE_NUMBER,
    "x" * 10_000,
    "<answer>" * 3000,
    "</answer><answer>",
    "<think><think></think></think><answer></answer>",
    "<answer>٣</answer>",
    "<answer>\u00a03\u2003</answer>",
    "<answer>𝟑</answer>",  # mathematical bold digit
    "<think>" + "٣" * 5000 + "</think>",
    "\ud800",  # a lone surrogate
    "<ANSWER>3</ANSWER>",
]


@pytest.mark.parametrize("name", sorted(REWARDS))
def test_every_reward_is_total(name):
    got = call(REWARDS[name], NASTY, lengths=list(range(1, len(NASTY) + 1)))
    assert len(got) == len(NASTY)
    for value in got:
        assert value is None or (isinstance(value, float) and math.isfinite(value) and -1.0 <= value <= 1.0)


# ---------------------------------------------------------------- property: accuracy == the verifier
DIGITS = "0123456789" + "٠١٢٣٤٥٦٧٨٩" + "０１２３" + "३"
SPACES = ["", " ", "  ", "\n", "\t"]


def _fragment(rng: random.Random, gold: int) -> str:
    choices = [
        lambda: f"<answer>{gold}</answer>",
        lambda: f"<answer>{rng.choice(SPACES)}{gold}{rng.choice(SPACES)}</answer>",
        lambda: f"<answer>{rng.randint(0, 12)}</answer>",
        lambda: f"<answer>{'0' * rng.randint(1, 3)}{gold}</answer>",
        lambda: f"<answer>{''.join(rng.choice(DIGITS) for _ in range(rng.randint(0, 3)))}</answer>",
        lambda: f"<answer>{rng.choice(['-', '+', '.', 'three', ' ', ''])}{gold}</answer>",
        lambda: rng.choice(["<answer>", "</answer>", "<think>", "</think>", "<answer ", "answer>", "<>"]),
        lambda: "".join(rng.choice(DIGITS) for _ in range(rng.randint(1, 4))),
        lambda: rng.choice([" ", "\n", "\t", "\u3000", "the count is ", "I see cubes. ", "٣", ""]),
    ]
    return rng.choice(choices)()


def _completion(rng: random.Random, gold: int) -> str:
    text = "".join(_fragment(rng, gold) for _ in range(rng.randint(0, 6)))
    if rng.random() < 0.2:
        text = text[: rng.randint(0, len(text))]  # truncation
    if rng.random() < 0.2:
        text = f"<think>{text}</think>{_fragment(rng, gold)}"  # nesting
    return text


def test_accuracy_agrees_with_the_verifier_everywhere():
    rng = random.Random(1234)
    golds = [rng.randint(0, 12) for _ in range(4000)]
    texts = [_completion(rng, gold) for gold in golds]
    solutions = [rng.choice([f"<answer> {g} </answer>", f" {g} ", g]) for g in golds]
    completions = [[{"role": "assistant", "content": t}] if i % 2 else t for i, t in enumerate(texts)]

    got = accuracy(completions=completions, solution=solutions, completion_ids=[[0]] * len(texts))
    expected = [float(is_correct(text, gold)) for text, gold in zip(texts, golds)]

    assert got == expected
    assert 500 < sum(expected) < len(expected) - 500  # both outcomes are common: the check can fail
    assert any(not c.isascii() and e == 1.0 for c, e in zip(texts, expected))  # unicode-digit answers were scored


# ---------------------------------------------------------------- wiring
def _config(**changes) -> TrialConfig:
    return TrialConfig(model_path="m", train_path="t", output_dir="o", **changes)


def test_build_reward_funcs_names_and_weights_in_order():
    from trl.trainer.utils import get_callable_name  # here: importing trl takes seconds

    weights = {"brevity": 0.25, "accuracy": 1.0, "answer_format": 0.0, "reasoning_agreement": 0.5}
    funcs, got_weights = build_reward_funcs(_config(reward_weights=weights))
    assert [f.__name__ for f in funcs] == list(weights)
    assert [get_callable_name(f) for f in funcs] == list(weights)  # the names TRL logs under
    assert got_weights == list(weights.values())
    assert all(isinstance(w, float) for w in got_weights)


def test_build_reward_funcs_binds_the_cap():
    def brevity_of(config, length):
        (fn,), _ = build_reward_funcs(config)
        return one(fn, "<answer>3</answer>", length=length)

    assert brevity_of(_config(reward_weights={"brevity": 1.0}, max_completion_length=64), 64) == -1.0
    assert brevity_of(_config(reward_weights={"brevity": 1.0}, max_completion_length=64), 48) == pytest.approx(0.5)
    # Longer training completions than the verifier generates are still cut at the verifier's cap.
    assert brevity_of(_config(reward_weights={"brevity": 1.0}, max_completion_length=1024), 256) == -1.0


def test_built_funcs_survive_pickling():
    funcs, _ = build_reward_funcs(_config(reward_weights={name: 1.0 for name in REWARDS}))
    for fn in funcs:
        clone = pickle.loads(pickle.dumps(fn))
        assert clone.__name__ == fn.__name__
        assert call(clone, list(CASES)) == call(fn, list(CASES))


def test_unknown_reward_names_are_rejected():
    with pytest.raises(ConfigError, match="unknown reward 'accurcy'"):
        _config(reward_weights={"accurcy": 1.0})
    config = _config()
    config.reward_weights["bogus"] = 1.0  # mutated after validation
    with pytest.raises(ValueError, match="unknown reward 'bogus'"):
        build_reward_funcs(config)
