"""The evaluation report: completions scored with the verifier's extraction, summed the way the verifier sums them."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from typing import Any

from evaluator.generation import Completion
from evaluator.protocol import extract_answer, is_correct


def build_report(
    problems: Sequence[str],
    golds: Sequence[int],
    completions: Sequence[Completion],
    num_samples: int = 5,
    indices: Sequence[int] | None = None,
) -> dict[str, Any]:
    """accuracy_pct, n, correct, format_rate, mean_completion_tokens, accuracy_by_count, samples and per_row.

    Scored only through `protocol`: a row is correct when `is_correct`; format_rate is the share of completions from
    which `extract_answer` gets a number at all. `per_row` keeps every row's split index (`indices`, default 0..n-1),
    gold count and extracted answer (null when none), in the split's order: two models scored on the same rows compare
    row by row (a paired difference), and a copy of a model can be checked against what it answered.
    """
    if not len(problems) == len(golds) == len(completions) > 0:
        raise ValueError(
            f"need as many problems, golds and completions, and at least one: "
            f"{len(problems)}, {len(golds)}, {len(completions)}"
        )
    answers = [extract_answer(completion.text) for completion in completions]
    hits = [is_correct(completion.text, gold) for completion, gold in zip(completions, golds)]
    by_count: dict[int, list[bool]] = defaultdict(list)
    for gold, hit in zip(golds, hits):
        by_count[gold].append(hit)
    n = len(completions)
    indices = list(range(n)) if indices is None else [int(i) for i in indices]
    if len(indices) != n:
        raise ValueError(f"need one index per completion: {len(indices)} indices, {n} completions")
    return {
        "accuracy_pct": 100.0 * sum(hits) / n,
        "n": n,
        "correct": sum(hits),
        "format_rate": 100.0 * sum(answer is not None for answer in answers) / n,
        "mean_completion_tokens": sum(completion.n_tokens for completion in completions) / n,
        "accuracy_by_count": {str(gold): 100.0 * sum(group) / len(group) for gold, group in sorted(by_count.items())},
        "samples": [
            {"problem": problem, "gold": gold, "completion": completion.text, "answer": answer}
            for problem, gold, completion, answer in list(zip(problems, golds, completions, answers))[:num_samples]
        ],
        "per_row": {"index": indices, "gold": list(golds), "answer": answers},
    }
