"""The verifier's protocol: the one place that defines how a model is asked and scored.

Everything that judges or rewards a completion imports from here, so the search optimizes exactly what the
verifier measures. Changing one character here changes the objective.
"""

from __future__ import annotations

import re
from typing import Any

# The verifier's prompt: the question, ONE space, then the instruction.
EVAL_TEMPLATE = (
    "{question} First output the thinking process in <think> </think> and final answer (number) "
    "in <answer> </answer> tags."
)

# The inherited trainer's phrasing: TWO spaces and no "First". Kept to train robustness to phrasing.
INHERITED_TEMPLATE = (
    "{question}  Output the thinking process in <think> </think> and final answer (number) "
    "in <answer> </answer> tags."
)

# The verifier takes the FIRST match; `\d` is Python's Unicode digit class and `int()` accepts every such digit.
ANSWER_PATTERN = re.compile(r"<answer>\s*(\d+)\s*</answer>")

# Greedy decoding exactly as the verifier runs it.
GENERATION_KWARGS: dict[str, Any] = {"do_sample": False, "max_new_tokens": 256}

# Gold answers in the data look like "<answer> 5 </answer>", or a bare " 5 ".
_GOLD_PATTERN = re.compile(r"^\s*(?:<answer>\s*(\d+)\s*</answer>|(\d+))\s*$")


def format_prompt(question: str, template: str = EVAL_TEMPLATE) -> str:
    """The user text for one question."""
    return template.format(question=question)


def build_messages(image: Any, question: str, template: str = EVAL_TEMPLATE) -> list[dict[str, Any]]:
    """One user turn, image first then text, no system message (the chat template adds its default one)."""
    return [
        {
            "role": "user",
            "content": [
                {"type": "image", "image": image},
                {"type": "text", "text": format_prompt(question, template)},
            ],
        }
    ]


def extract_answer(text: str) -> int | None:
    """The verifier's extraction: the first `<answer>N</answer>` as an int, or None. There is no fallback."""
    match = ANSWER_PATTERN.search(text)
    if match is None:
        return None
    try:
        return int(match.group(1))
    except ValueError:
        # Python refuses to convert more than 4300 digits; the verifier's int() would raise there, which can only
        # count as wrong, so such an answer is unparseable.
        return None


def is_correct(text: str, gold: int) -> bool:
    """Correct only on exact equality of the extracted integer with the gold count."""
    answer = extract_answer(text)
    return answer is not None and answer == gold


def parse_gold(solution: Any) -> int:
    """The gold count of a `solution` cell: `<answer> 5 </answer>`, `5`, ` 5 ` or an int."""
    if isinstance(solution, bool):
        raise ValueError(f"solution must hold one integer count, got {solution!r}")
    if isinstance(solution, int):
        return solution
    match = _GOLD_PATTERN.match(str(solution))
    if match is None:
        raise ValueError(f"solution must hold one integer count like '<answer> 5 </answer>' or '5', got {solution!r}")
    return int(match.group(1) or match.group(2))
