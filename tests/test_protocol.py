"""The verifier's protocol, character for character."""

import random

import pytest

from evaluator import protocol


def test_eval_template_is_the_verifiers_prompt():
    assert protocol.format_prompt("How many items are there in the image?") == (
        "How many items are there in the image? First output the thinking process in <think> </think> and "
        "final answer (number) in <answer> </answer> tags."
    )


def test_inherited_template_has_two_spaces_and_no_first():
    text = protocol.format_prompt("Q?", protocol.INHERITED_TEMPLATE)
    assert text.startswith("Q?  Output the thinking process")
    assert "First" not in text


def test_messages_are_one_user_turn_image_then_text():
    messages = protocol.build_messages("IMG", "Q?")
    assert len(messages) == 1 and messages[0]["role"] == "user"
    assert [part["type"] for part in messages[0]["content"]] == ["image", "text"]
    assert messages[0]["content"][0]["image"] == "IMG"
    assert messages[0]["content"][1]["text"] == protocol.format_prompt("Q?")


def test_generation_is_greedy_with_256_new_tokens():
    assert protocol.GENERATION_KWARGS == {"do_sample": False, "max_new_tokens": 256}


@pytest.mark.parametrize(
    "text, expected",
    [
        ("<answer>3</answer>", 3),
        ("<answer> 12 </answer>", 12),
        ("<think>x</think><answer>\n7\n</answer>", 7),
        ("<answer>03</answer>", 3),
        ("<answer>2</answer><answer>3</answer>", 2),  # the first match counts
        ("<answer>٣</answer>", 3),  # Arabic-Indic digit: `\d` and int() accept it
        ("<answer>３</answer>", 3),  # fullwidth digit
        ("<answer>3.0</answer>", None),
        ("<answer>three</answer>", None),
        ("<answer>-3</answer>", None),
        ("<answer>3", None),
        ("3", None),
        ("", None),
        ("<ANSWER>3</ANSWER>", None),
        ("<answer>" + "9" * 5000 + "</answer>", None),  # over int()'s digit limit: unscorable
    ],
)
def test_extract_answer(text, expected):
    assert protocol.extract_answer(text) == expected


def test_is_correct_needs_exact_equality():
    assert protocol.is_correct("<answer>4</answer>", 4)
    assert not protocol.is_correct("<answer>5</answer>", 4)
    assert not protocol.is_correct("4", 4)


@pytest.mark.parametrize("solution, gold", [("<answer> 5 </answer>", 5), ("5", 5), (" 5 ", 5), (7, 7), ("<answer>10</answer>", 10)])
def test_parse_gold(solution, gold):
    assert protocol.parse_gold(solution) == gold


@pytest.mark.parametrize("solution", ["", "five", "<answer> </answer>", "<answer> 5 </answer> 6", "5.0", True, None])
def test_parse_gold_rejects_solutions_without_one_integer(solution):
    with pytest.raises(ValueError, match="solution"):
        protocol.parse_gold(solution)


def test_extract_answer_matches_a_reference_reading_on_generated_completions():
    """Generated completions against an independent reading of the verifier's rule (scan for the tag by hand)."""
    rng = random.Random(0)
    pieces = ["<answer>", "</answer>", " ", "\n", "3", "12", "٣", "x", "<think>", "</think>", "-", "."]

    def reference(text):
        start = 0
        while True:
            i = text.find("<answer>", start)
            if i < 0:
                return None
            j = i + len("<answer>")
            k = j
            while k < len(text) and text[k].isspace():
                k += 1
            m = k
            while m < len(text) and text[m].isdecimal():
                m += 1
            n = m
            while n < len(text) and text[n].isspace():
                n += 1
            if m > k and text.startswith("</answer>", n):
                return int(text[k:m])
            start = i + 1

    seen = {True: 0, False: 0}
    for _ in range(3000):
        parts = [rng.choice(pieces) for _ in range(rng.randint(0, 12))]
        if rng.random() < 0.5:  # plant a well-formed answer among the noise
            parts.insert(rng.randint(0, len(parts)), f"<answer>{rng.choice(['', ' '])}{rng.randint(0, 20)}</answer>")
        text = "".join(parts)
        expected = reference(text)
        assert protocol.extract_answer(text) == expected, text
        seen[expected is not None] += 1
    assert seen[True] > 500 and seen[False] > 500
