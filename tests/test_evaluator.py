"""The evaluator prompts exactly as the verifier does, batching does not change answers, and the report adds up.

A random tiny model on the CPU: it scores ~0 and rarely writes answer tags, so the scoring rules are checked on
hand-written completions (`build_report`) and the end-to-end runs on consistency.
"""

from __future__ import annotations

import copy
import io
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from qwen_vl_utils import process_vision_info

from evaluator import Split, evaluate, evaluate_splits, evaluation, vision_attention
from evaluator.__main__ import READY_LINE, _parser, main
from evaluator.data import DataError, load_split, subset_indices, validate_solutions
from evaluator.evaluation import load_model
from evaluator.generation import Completion, build_inputs, generate_completions, tokens_until_eos
from evaluator.protocol import EVAL_TEMPLATE, extract_answer
from evaluator.repeated_kv_cache import use_repeated_kv_attention
from evaluator.report import build_report
from evaluator.text_attention import use_folded_gqa_attention
from evaluator.vision_attention import use_batched_vision_attention
from synthetic.splits import iter_scenes, write_parquet_split

REPO = Path(__file__).resolve().parents[1]
# Written out here rather than imported: the verifier's prompt, one space after the question.
VERIFIER_PROMPT = (
    "{Question} First output the thinking process in <think> </think> and final answer (number) in <answer> </answer> "
    "tags."
)
DEFAULT_SYSTEM_TURN = "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
SHORT = 8  # new tokens where the test is about batching or bookkeeping, not the protocol's 256


@pytest.fixture(scope="module")
def rows() -> list[dict[str, Any]]:
    """Rows with images of several sizes and questions of several lengths, so that batches need padding."""
    sizes = [(56, 56), (112, 56), (56, 112), (84, 140), (112, 112), (56, 84), (140, 56), (84, 84)]
    out = []
    for index, size in enumerate(sizes):
        ((image, scene),) = iter_scenes("val", 1, seed=index, image_size=size, count_range=(1, 3))
        out.append({"image": image, "problem": scene.question, "solution": f"<answer> {scene.count} </answer>"})
    out[2]["problem"] = "How many large metal cubes are there left of the small rubber cylinder behind the sphere?"
    return out


@pytest.fixture(scope="module")
def processor(tiny_model_dir: Path) -> Any:
    return load_model(tiny_model_dir, "cpu")[1]


@pytest.fixture(scope="module")
def lively_model(tiny_model_dir: Path) -> Any:
    """The tiny model with larger random weights, no way to the unused token ids and more weight on the end tokens:
    the saved one repeats a single token whatever the input, which would make any two runs agree."""
    model, processor = load_model(tiny_model_dir, "cpu")
    vocab_ids = processor.tokenizer.get_vocab().values()
    unused = range(max(i for i in vocab_ids if i < 151643) + 1, 151643)  # the gap before the special tokens
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.dim() > 1:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.3)
        embeddings = model.get_input_embeddings().weight  # tied: its rows are also the output layer's
        embeddings[unused] = 0
        embeddings[model.generation_config.eos_token_id] *= 3
    return model


def test_prompt_tokens_are_the_verifiers(processor: Any, rows: list[dict[str, Any]]) -> None:
    batch = build_inputs(processor, rows)
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), batch["image_grid_thw"].prod(dim=1).cumsum(0)])
    for index, row in enumerate(rows):
        # The verifier's steps, one row at a time.
        message = [
            {
                "role": "user",
                "content": [
                    {"type": "image", "image": row["image"]},
                    {"type": "text", "text": VERIFIER_PROMPT.format(Question=row["problem"])},
                ],
            }
        ]
        text = processor.apply_chat_template(message, tokenize=False, add_generation_prompt=True)
        image_inputs, video_inputs = process_vision_info([message])
        expected = processor(text=[text], images=image_inputs, videos=video_inputs, padding=True, return_tensors="pt")

        mask = batch["attention_mask"][index].bool()
        assert not mask[-1:].logical_not().any() and torch.equal(mask, mask.sort().values), "padding must be left"
        assert torch.equal(batch["input_ids"][index][mask], expected["input_ids"][0])
        assert torch.equal(batch["image_grid_thw"][index], expected["image_grid_thw"][0])
        pixels = batch["pixel_values"][offsets[index] : offsets[index + 1]]
        assert torch.equal(pixels, expected["pixel_values"])
        decoded = processor.tokenizer.decode(expected["input_ids"][0])
        assert decoded.startswith(DEFAULT_SYSTEM_TURN + "<|im_start|>user\n<|vision_start|><|image_pad|>")
        rendered = EVAL_TEMPLATE.format(question=row["problem"])
        assert decoded.endswith(f"<|vision_end|>{rendered}<|im_end|>\n<|im_start|>assistant\n")


GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")


# On a GPU (the device machine runs it) the static cache really compiles the decode step; on a CPU it is only used.
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=GPU)])
def test_batched_completions_equal_one_row_at_a_time(
    lively_model: Any, processor: Any, rows: list, device: str
) -> None:
    lively_model = copy.deepcopy(lively_model).to(device)
    alone = [generate_completions(lively_model, processor, [row], 1, SHORT)[0] for row in rows]
    assert len({completion.text for completion in alone}) > 1, "the model must answer differently to some rows"
    assert {completion.n_tokens < SHORT for completion in alone} == {True, False}, "some rows must end early"
    batched = generate_completions(lively_model, processor, rows, batch_size=3, max_new_tokens=SHORT)
    assert batched == alone
    # The static cache fills the last batch up with copies; their completions must not leak into the result.
    assert generate_completions(lively_model, processor, rows, 3, SHORT, static_cache=True) == alone


# On a GPU the float32 model takes the grouped-SDPA path; tests/test_vision_attention.py checks the bfloat16 kernel.
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=GPU)])
def test_batched_vision_attention_gives_the_per_image_answers_row_for_row(
    lively_model: Any, processor: Any, rows: list, device: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The verifier's path runs the vision tower's attention once per image; all of a batch's images in one call
    (evaluator.vision_attention) give the same completions, row for row."""
    per_image = copy.deepcopy(lively_model).to(device)
    batched = copy.deepcopy(per_image)
    use_batched_vision_attention(batched)
    expected = generate_completions(per_image, processor, rows, batch_size=4, max_new_tokens=SHORT)
    assert len({completion.text for completion in expected}) > 1, "the model must answer differently to some rows"
    images_per_call = []
    grouped = vision_attention._grouped_sdpa
    monkeypatch.setattr(vision_attention, "_grouped_sdpa",
                        lambda *args: images_per_call.append(len(args[4]) - 1) or grouped(*args))  # fmt: skip
    assert generate_completions(batched, processor, rows, batch_size=4, max_new_tokens=SHORT) == expected
    assert images_per_call == [4] * 2 * batched.config.vision_config.depth  # 2 batches of 4 images, every layer


# The tiny model has 4 query heads on 2 key/value heads, so its attention folds as the 2B's 12 on 2 do.
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=GPU)])
def test_folded_gqa_attention_gives_the_sdpa_answers_row_for_row(
    lively_model: Any, processor: Any, rows: list, device: str
) -> None:
    """Left-padded batches attend through a mask, where transformers' sdpa copies the cache per query head; folding
    the query heads onto their key/value head (evaluator.text_attention) gives the same completions, row for row,
    with the dynamic cache and with the static one (compiled on a GPU)."""
    sdpa = copy.deepcopy(lively_model).to(device)
    folded = copy.deepcopy(sdpa)
    use_folded_gqa_attention(folded)
    assert folded.config.text_config.num_attention_heads > folded.config.text_config.num_key_value_heads
    for static_cache in (False, True):
        expected = generate_completions(sdpa, processor, rows, 3, SHORT, static_cache=static_cache)
        assert len({completion.text for completion in expected}) > 1, "the model must answer differently to some rows"
        assert generate_completions(folded, processor, rows, 3, SHORT, static_cache=static_cache) == expected


@pytest.mark.parametrize(
    ("device", "dtype"),
    [("cpu", torch.float32), ("cpu", torch.bfloat16), pytest.param("cuda", torch.bfloat16, marks=GPU)],
)
def test_the_repeated_kv_cache_gives_the_static_caches_answers_row_for_row(
    lively_model: Any, processor: Any, rows: list, device: str, dtype: torch.dtype
) -> None:
    """A static cache that stores each key/value head once per query head (evaluator.repeated_kv_cache) gives the
    ordinary static cache's completions row for row, also in bfloat16 (compiled on a GPU), over several batches
    that share the cache."""
    ordinary = copy.deepcopy(lively_model).to(device=device, dtype=dtype)
    repeated = copy.deepcopy(ordinary)
    use_repeated_kv_attention(repeated)
    expected = generate_completions(ordinary, processor, rows, 3, SHORT, static_cache=True)
    assert len({completion.text for completion in expected}) > 1, "the model must answer differently to some rows"
    assert generate_completions(repeated, processor, rows, 3, SHORT, static_cache=True,
                                repeated_kv_cache=True) == expected  # fmt: skip
    with pytest.raises(ValueError, match="use_repeated_kv_attention"):
        generate_completions(ordinary, processor, rows, 3, SHORT, static_cache=True, repeated_kv_cache=True)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=GPU)])
def test_an_eager_decode_over_the_static_cache_gives_the_compiled_answers_row_for_row(
    lively_model: Any, processor: Any, rows: list, device: str
) -> None:
    """What the promotion's check runs (`compiled_decode=False`): transformers is told not to compile the decode
    step, nothing is compiled, and the completions are the compiled decode step's (on a CPU neither compiles)."""
    from torch._dynamo.utils import counters

    model = copy.deepcopy(lively_model).to(device)
    use_repeated_kv_attention(model)
    compiled = generate_completions(model, processor, rows, 3, SHORT, static_cache=True, repeated_kv_cache=True)
    assert len({completion.text for completion in compiled}) > 1, "the model must answer differently to some rows"
    told, generate = [], model.generate
    model.generate = lambda **kwargs: told.append(kwargs.get("disable_compile")) or generate(**kwargs)
    graphs = counters["stats"]["unique_graphs"]
    eager = generate_completions(model, processor, rows, 3, SHORT, static_cache=True, repeated_kv_cache=True,
                                 compiled_decode=False)  # fmt: skip
    assert eager == compiled
    assert told == [True] * -(-len(rows) // 3) and counters["stats"]["unique_graphs"] == graphs


def test_completion_tokens_count_up_to_the_first_end_of_sequence() -> None:
    im_end, end_of_text = 151645, 151643  # Qwen2-VL's end-of-sequence ids; end_of_text also pads finished rows
    new_tokens = torch.tensor([[5, im_end, end_of_text, end_of_text], [5, 6, 7, 8], [end_of_text, 9, 9, 9]])
    assert tokens_until_eos(new_tokens, [im_end, end_of_text]) == [2, 4, 1]
    assert tokens_until_eos(new_tokens, im_end) == [2, 4, 4]


def test_report_scores_with_the_verifiers_rules() -> None:
    texts_and_golds = [
        ("<think>three</think> <answer> 3 </answer>", 3),  # right
        ("<answer>4</answer> then <answer>3</answer>", 3),  # the first answer counts: wrong
        ("The answer is 5.", 5),  # no tags: no answer, wrong
        ("<answer>٥</answer>", 5),  # a Unicode digit is a digit to `\d` and int(): right
        ("<answer>02</answer>", 2),  # right
        ("<answer>2.0</answer>", 2),  # not an integer: no answer
    ]
    completions = [Completion(text, n_tokens) for n_tokens, (text, _) in enumerate(texts_and_golds, start=1)]
    golds = [gold for _, gold in texts_and_golds]
    report = build_report([f"q{i}" for i in range(6)], golds, completions, num_samples=2)
    assert (report["n"], report["correct"]) == (6, 3)
    assert report["accuracy_pct"] == pytest.approx(50.0)
    assert report["format_rate"] == pytest.approx(100 * 4 / 6)
    assert report["mean_completion_tokens"] == pytest.approx(3.5)
    assert report["accuracy_by_count"] == {"2": 50.0, "3": 50.0, "5": 50.0}
    assert list(report["accuracy_by_count"]) == ["2", "3", "5"]
    assert report["samples"] == [
        {"problem": "q0", "gold": 3, "completion": texts_and_golds[0][0], "answer": 3},
        {"problem": "q1", "gold": 3, "completion": texts_and_golds[1][0], "answer": 4},
    ]


def test_evaluate_reports_consistent_scores(tiny_model_dir: Path, tiny_split_dir: Path) -> None:
    report = evaluate(tiny_model_dir, tiny_split_dir, batch_size=3, devices=["cpu"], num_samples=8,
                      max_new_tokens=SHORT)
    golds = validate_solutions(load_split(tiny_split_dir))
    assert report["n"] == len(golds) == len(report["samples"]) == 8
    assert [sample["gold"] for sample in report["samples"]] == golds
    answers = [extract_answer(sample["completion"]) for sample in report["samples"]]
    assert [sample["answer"] for sample in report["samples"]] == answers
    assert report["correct"] == sum(answer == gold for answer, gold in zip(answers, golds))
    assert report["accuracy_pct"] == pytest.approx(100 * report["correct"] / 8)
    assert report["format_rate"] == pytest.approx(100 * sum(a is not None for a in answers) / 8)
    by_count = {str(gold): golds.count(gold) for gold in set(golds)}
    assert set(report["accuracy_by_count"]) == set(by_count)
    assert sum(report["accuracy_by_count"][key] * size / 100 for key, size in by_count.items()) == pytest.approx(
        report["correct"]
    )
    assert 1 <= report["mean_completion_tokens"] <= SHORT
    assert report["examples_per_s"] == pytest.approx(8 / report["seconds"])
    assert (report["model"], report["data"], report["devices"]) == (str(tiny_model_dir), str(tiny_split_dir), ["cpu"])
    assert report["batched_vision_attention"] is False  # the default
    assert report["static_cache"] is False and report["repeated_kv_cache"] is False  # a static cache only on a GPU


def test_per_row_answers_name_the_rows_of_the_split(tiny_model_dir: Path, tiny_split_dir: Path) -> None:
    """A report keeps every row's split index, gold and answer; `indices` scores exactly those rows again."""
    subset = evaluate(tiny_model_dir, tiny_split_dir, limit=5, seed=3, batch_size=2, devices=["cpu"],
                      max_new_tokens=SHORT)  # fmt: skip
    per_row = subset["per_row"]
    golds = validate_solutions(load_split(tiny_split_dir))
    assert per_row["index"] == subset_indices(8, 5, 3) and len(set(per_row["index"])) == 5
    assert per_row["gold"] == [golds[i] for i in per_row["index"]]
    assert sum(a == g for a, g in zip(per_row["answer"], per_row["gold"])) == subset["correct"]
    again = evaluate(tiny_model_dir, tiny_split_dir, indices=per_row["index"][1:3], batch_size=2, devices=["cpu"],
                     max_new_tokens=SHORT, batched_vision_attention=True)  # fmt: skip
    assert again["batched_vision_attention"] is True and again["folded_gqa_attention"] is False
    assert again["per_row"]["index"] == per_row["index"][1:3]
    assert again["per_row"]["answer"] == per_row["answer"][1:3]
    for bad in ([], [8], [-1]):
        with pytest.raises(DataError, match="indices must be non-empty row numbers below 8"):
            evaluate(tiny_model_dir, tiny_split_dir, indices=bad, devices=["cpu"])


@pytest.fixture(scope="module")
def lively_model_dir(lively_model: Any, processor: Any, tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("lively_model")
    lively_model.save_pretrained(folder)
    processor.save_pretrained(folder)
    return folder


def test_splits_scored_together_get_the_answers_each_gets_alone(
    lively_model_dir: Path, tiny_split_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two splits from one load of the model, their rows batched together: each report is what scoring its split
    alone gives. The second split stores its text as large_string, so its rows are cast to the first's column types
    to go together, in memory: nothing is written into either split's folder."""
    import datasets

    parquet = write_parquet_split(tmp_path / "parquet", "other", 5, seed=4, image_size=(84, 56), count_range=(1, 3))
    other = tmp_path / "other"
    load_split(parquet).cast_column("problem", datasets.Value("large_string")).save_to_disk(str(other))
    assert load_split(other).features["problem"] != load_split(tiny_split_dir).features["problem"]
    files = {folder: sorted(folder.rglob("*")) for folder in (tiny_split_dir, other)}
    loads = []
    real_load = evaluation.load_model
    monkeypatch.setattr(evaluation, "load_model",
                        lambda *args, **kwargs: loads.append(args) or real_load(*args, **kwargs))  # fmt: skip
    options = {"batch_size": 3, "devices": ["cpu"], "max_new_tokens": SHORT, "num_samples": 8}
    together = evaluate_splits(lively_model_dir, [Split(tiny_split_dir, limit=6, seed=1), Split(other)], **options)
    assert len(loads) == 1
    alone = [evaluate(lively_model_dir, tiny_split_dir, limit=6, seed=1, **options),
             evaluate(lively_model_dir, other, **options)]  # fmt: skip
    completions = [sample["completion"] for report in together for sample in report["samples"]]
    assert len(completions) == 11 and len(set(completions)) > 1, "the model must answer differently to some rows"
    for report, expected in zip(together, alone):
        for key in ("n", "correct", "accuracy_pct", "format_rate", "mean_completion_tokens", "accuracy_by_count",
                    "samples", "per_row", "data", "limit", "seed"):  # fmt: skip
            assert report[key] == expected[key], key
        assert report["call_rows"] == 11 and report["call_splits"] == [str(tiny_split_dir), str(other)]
        assert report["examples_per_s"] == pytest.approx(11 / report["seconds"])
    assert together[0]["seconds"] == together[1]["seconds"]
    assert {folder: sorted(folder.rglob("*")) for folder in files} == files
    with pytest.raises(DataError, match="no such folder"):  # every split is read before the model loads
        evaluate_splits(lively_model_dir, [Split(tiny_split_dir), Split(tmp_path / "absent")], **options)
    assert len(loads) == 3


def test_two_worker_processes_give_the_same_completions_as_one(tiny_model_dir: Path, tiny_split_dir: Path) -> None:
    kwargs = {"limit": 5, "seed": 3, "batch_size": 2, "num_samples": 5, "max_new_tokens": SHORT}
    one = evaluate(tiny_model_dir, tiny_split_dir, devices=["cpu"], **kwargs)
    two = evaluate(tiny_model_dir, tiny_split_dir, devices=["cpu", "cpu"], **kwargs)
    assert two["devices"] == ["cpu", "cpu"]
    assert two["samples"] == one["samples"]
    assert two["mean_completion_tokens"] == one["mean_completion_tokens"]


def test_the_command_line_writes_a_report_per_split(tiny_model_dir: Path, tiny_split_dir: Path, tmp_path: Path) -> None:
    outs = [tmp_path / "runs" / "first.json", tmp_path / "runs" / "second.json"]
    command = [sys.executable, "-m", "evaluator", str(tiny_model_dir), str(tiny_split_dir), str(tiny_split_dir),
               "--limit", "2", "1", "--batch-size", "2", "--out", *map(str, outs)]  # fmt: skip
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    reports = [json.loads(out.read_text()) for out in outs]
    assert [report["n"] for report in reports] == [2, 1] and [report["limit"] for report in reports] == [2, 1]
    assert all(report["max_new_tokens"] == 256 for report in reports)  # the command line runs the protocol as it is
    assert reports[0]["call_rows"] == 3 and reports[0]["seconds"] == reports[1]["seconds"]  # one call scored both
    lines = done.stdout.strip().splitlines()
    assert len(lines) == 2
    for line, report in zip(lines, reports):
        assert line.startswith(f"{tiny_split_dir}: accuracy {report['accuracy_pct']:.2f}%")


def test_the_model_is_looked_at_only_after_the_wait_and_its_seconds_are_not_counted(
    tiny_model_dir: Path, tiny_split_dir: Path, tmp_path: Path
) -> None:
    model = tmp_path / "merged"  # written while the evaluator waits, as a trainer saves it
    waits = []

    def save_the_model() -> None:
        waits.append(time.perf_counter())
        assert not model.exists()
        time.sleep(1.0)
        shutil.copytree(tiny_model_dir, model)

    began = time.perf_counter()
    report = evaluate(model, tiny_split_dir, limit=2, batch_size=2, devices=["cpu"], max_new_tokens=SHORT,
                      wait_for_model=save_the_model)  # fmt: skip
    assert len(waits) == 1 and report["n"] == 2 and report["model"] == str(model)
    assert report["seconds"] <= time.perf_counter() - began - 1.0  # the clock starts when the wait is over
    with pytest.raises(DataError, match="no such folder"):  # a bad split fails before the wait
        evaluate(model, tmp_path / "absent", wait_for_model=lambda: waits.append("called"))
    assert len(waits) == 1


def test_the_command_line_waits_for_a_line_before_it_reads_the_model(
    tiny_model_dir: Path, tiny_split_dir: Path, tmp_path: Path
) -> None:
    model, out = tmp_path / "merged", tmp_path / "report.json"
    command = [sys.executable, "-m", "evaluator", str(model), str(tiny_split_dir), "--limit", "2", "--batch-size", "2",
               "--out", str(out), "--wait-for-input"]  # fmt: skip
    process = subprocess.Popen(command, cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert process.stderr.readline().strip() == READY_LINE
        time.sleep(0.2)
        assert process.poll() is None and not out.exists()
        shutil.copytree(tiny_model_dir, model)  # the model folder did not exist until now
        stdout, stderr = process.communicate("go\n", timeout=120)
    finally:
        process.kill()
    assert process.returncode == 0, stderr
    report = json.loads(out.read_text())
    assert report["n"] == 2 and report["model"] == str(model) and stdout.startswith("accuracy ")


def test_the_command_line_scores_nothing_when_its_input_ends_before_a_line(
    tiny_split_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "report.json"
    monkeypatch.setattr(sys, "stdin", io.StringIO(""))
    assert main([str(tmp_path / "never_saved"), str(tiny_split_dir), "--out", str(out), "--wait-for-input"]) == 3
    assert not out.exists()
    assert capsys.readouterr().err.splitlines() == [
        READY_LINE, "evaluator: standard input ended before a line asked for the evaluation; nothing scored"]
    # A bad split fails before the wait, as without it.
    assert main([str(tmp_path / "never_saved"), str(tmp_path / "absent"), "--wait-for-input"]) == 2
    assert READY_LINE not in capsys.readouterr().err


def test_the_command_line_gives_each_split_its_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    passed = []
    monkeypatch.setattr("evaluator.__main__.evaluate_splits",
                        lambda model, splits, **kwargs: passed.append(splits) or [])  # fmt: skip
    assert main(["m", "a", "b", "--limit", "all", "5", "--seed", "7"]) == 0
    assert passed.pop() == [Split(Path("a"), None, 7), Split(Path("b"), 5, 7)]
    assert main(["m", "a", "b", "--limit", "3"]) == 0  # one value: every split
    assert passed.pop() == [Split(Path("a"), 3, None), Split(Path("b"), 3, None)]
    assert main(["m", "a"]) == 0
    assert passed.pop() == [Split(Path("a"), None, None)]


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (["--limit", "1", "2", "3"], "--limit: one value, or one per split (2), got 3"),
        (["--out", "one.json"], "--out: one path per split (2), got 1"),
        (["--limit", "none"], "--limit: must be a positive integer or 'all', got 'none'"),
        (["--limit", "0"], "must be a positive integer, got 0"),
    ],
)
def test_the_command_line_refuses_limits_and_reports_that_do_not_match_the_splits(
    arguments: list[str], message: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr("evaluator.__main__.evaluate_splits", lambda *args, **kwargs: pytest.fail("it scored"))
    with pytest.raises(SystemExit) as exited:
        main(["m", "a", "b", *arguments])
    assert exited.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize(
    ("option", "default"),
    [("batched_vision_attention", False), ("folded_gqa_attention", False), ("repeated_kv_cache", True)],
)
def test_the_command_line_turns_an_attention_option_on_and_off(
    option: str, default: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert getattr(_parser().parse_args(["m", "d"]), option) is default
    passed = []
    monkeypatch.setattr("evaluator.__main__.evaluate_splits", lambda *args, **kwargs: passed.append(kwargs) or [])
    flag = "--" + option.replace("_", "-")
    for argument, value in ((flag, True), (flag.replace("--", "--no-", 1), False)):
        assert main(["m", "d", argument]) == 0
        assert passed.pop()[option] is value


def test_the_command_line_rejects_bad_input_in_one_line(
    tiny_model_dir: Path, tiny_split_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    done = subprocess.run([sys.executable, "-m", "evaluator", str(tmp_path / "absent"), str(tiny_split_dir)],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [f"evaluator: {tmp_path / 'absent'}: no such model folder"]
    # The rest in-process: the exit code is what main() returns.
    (tmp_path / "other_model").mkdir()
    (tmp_path / "other_model" / "config.json").write_text(json.dumps({"model_type": "qwen2_5_vl"}))
    cases = {
        (str(tmp_path / "other_model"), str(tiny_split_dir)): "model_type is 'qwen2_5_vl'",
        (str(tiny_model_dir), str(tmp_path / "absent")): "no such folder",
        (str(tiny_model_dir), str(tiny_model_dir)): "neither a save_to_disk folder nor",
    }
    for (model_dir, data_dir), message in cases.items():
        assert main([model_dir, data_dir]) == 2
        captured = capsys.readouterr()
        assert captured.out == "" and len(captured.err.strip().splitlines()) == 1 and message in captured.err
