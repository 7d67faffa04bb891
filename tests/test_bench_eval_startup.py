"""bench/eval_startup.py on the CPU: a fresh evaluator process's seconds, taken apart, on the tiny model."""

from __future__ import annotations

from bench import eval_startup
from evaluator import evaluation, generation


def test_every_batch_is_prepared_and_generated_once_and_the_evaluator_is_left_as_it_was(tiny_model_dir,
                                                                                         tiny_split_dir):  # fmt: skip
    steps = (generation._prepare, generation._generate, evaluation.load_model)
    figures = eval_startup.measure(tiny_model_dir, tiny_split_dir, batch_size=4, prefill=True)
    assert figures["n"] == 8
    kinds = [event[0] for event in figures["events"]]
    assert kinds.count("prepare") == 2 and kinds.count("generate") == 2
    marks = figures["marks"]
    assert marks["load_model_start"] < marks["load_model_end"] <= marks["evaluate_end"]
    first_generate = next(event for event in figures["events"] if event[0] == "generate")
    assert first_generate[1] >= marks["load_model_end"]  # generation starts on the loaded model
    prefill = figures["prefill"]
    assert prefill["prompt_tokens"] > 0 and prefill["patches"] > 0 and prefill["prefill_seconds"] > 0
    assert (generation._prepare, generation._generate, evaluation.load_model) == steps
