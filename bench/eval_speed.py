"""How fast the evaluator scores on a GPU, against the inherited self-check's way of generating.

On a GPU box, with the real Qwen2-VL-2B architecture (random weights: every completion runs to the 256-token cap
unless an end token happens to come, the worst case) and a synthetic split of 480x320 images, in one run:

- plain: `model.generate` on batches of 64 in input order, preprocessing inline, dynamic cache (the self-check);
- evaluator: `generate_completions` on the same rows (length-sorted batches, next batch prepared on a thread),
  with the dynamic cache and, unless --no-static, with the static cache (first call compiles; the second is timed);
- end to end: `evaluate()` on N rows, model loading (and compiling) included;
- preprocessing alone: seconds for one batch's images through process_vision_info and the processor.

    python bench/eval_speed.py [--model DIR] [--cache DIR] [--rows 256] [--plain-rows 128] [--out figures.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from evaluator.data import load_split  # noqa: E402
from evaluator.evaluation import evaluate, load_model  # noqa: E402
from evaluator.generation import build_inputs, generate_completions  # noqa: E402
from evaluator.protocol import GENERATION_KWARGS  # noqa: E402

PLAIN_BATCH_SIZE = 64  # the brief's measured self-check setting


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, help="a Qwen2-VL-2B folder (default: build random weights in --cache)")
    parser.add_argument("--cache", type=Path, default=Path("~/.cache/count-grpo-bench").expanduser())
    parser.add_argument("--rows", type=int, default=256, help="rows for the evaluator path and end to end")
    parser.add_argument("--plain-rows", type=int, default=128, help="rows for the plain path (it is slow)")
    parser.add_argument("--batch-size", type=int, default=128, help="the evaluator's batch size")
    parser.add_argument("--no-static", action="store_true", help="skip the static-cache measurements")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("eval_speed: needs a GPU")

    model_dir = args.model or _built_model(args.cache / "qwen2-vl-2b-random")
    split_dir = _built_split(args.cache / f"split-{args.rows}", args.rows)
    os.sync()  # a freshly written 4.4 GB model is still being flushed to disk; that slowed the first timings
    rows = load_split(split_dir)
    model, processor = load_model(model_dir, "cuda:0")
    generate_completions(model, processor, rows.select(range(8)), batch_size=8, max_new_tokens=8)  # warm-up
    figures: dict[str, Any] = {"gpu": torch.cuda.get_device_name(0), "rows": args.rows, "image_size": [480, 320]}

    plain_rows = [rows[index] for index in range(min(args.plain_rows, len(rows)))]
    plain_seconds, plain_texts = _timed(lambda: _plain(model, processor, plain_rows))
    figures["plain"] = _speed(PLAIN_BATCH_SIZE, len(plain_rows), plain_seconds)

    seconds, completions = _timed(lambda: generate_completions(model, processor, rows, args.batch_size))
    figures["evaluator"] = _speed(args.batch_size, len(rows), seconds)
    figures["evaluator"]["mean_completion_tokens"] = sum(c.n_tokens for c in completions) / len(completions)
    # bf16 greedy over random weights flips on near-ties when the batch changes, so this is a noise floor, not a test.
    same = sum(a == c.text for a, c in zip(plain_texts, completions))
    figures["evaluator"]["identical_to_plain"] = same / len(plain_texts)
    figures["speedup"] = figures["evaluator"]["examples_per_s"] / figures["plain"]["examples_per_s"]

    if not args.no_static:
        first, _ = _timed(lambda: generate_completions(model, processor, rows, args.batch_size, static_cache=True))
        seconds, _ = _timed(lambda: generate_completions(model, processor, rows, args.batch_size, static_cache=True))
        figures["evaluator_static"] = {**_speed(args.batch_size, len(rows), seconds), "first_call_seconds": first}
        figures["speedup_static"] = figures["evaluator_static"]["examples_per_s"] / figures["plain"]["examples_per_s"]

    batch = [rows[index] for index in range(min(args.batch_size, len(rows)))]
    figures["preprocess_seconds_per_batch"], _ = _timed(lambda: build_inputs(processor, batch))

    del model
    torch.cuda.empty_cache()
    for name, static in [("end_to_end", False)] + ([] if args.no_static else [("end_to_end_static", True)]):
        report = evaluate(model_dir, split_dir, batch_size=args.batch_size, devices=["cuda:0"], static_cache=static)
        figures[name] = {key: report[key] for key in ("n", "seconds", "examples_per_s", "mean_completion_tokens")}

    text = json.dumps(figures, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


def _plain(model: Any, processor: Any, rows: list[dict[str, Any]]) -> list[str]:
    """The self-check: fixed batches in input order, each prepared then generated, dynamic cache."""
    texts = []
    with torch.inference_mode():
        for start in range(0, len(rows), PLAIN_BATCH_SIZE):
            inputs = build_inputs(processor, rows[start : start + PLAIN_BATCH_SIZE]).to("cuda:0")
            output = model.generate(**inputs, **GENERATION_KWARGS)
            new_tokens = output[:, inputs["input_ids"].shape[1] :]
            texts += processor.batch_decode(new_tokens, skip_special_tokens=True, clean_up_tokenization_spaces=False)
    return texts


def _timed(work: Any) -> tuple[float, Any]:
    torch.cuda.synchronize()
    start = time.perf_counter()
    result = work()
    torch.cuda.synchronize()
    return time.perf_counter() - start, result


def _speed(batch_size: int, n: int, seconds: float) -> dict[str, float]:
    return {"batch_size": batch_size, "n": n, "seconds": seconds, "examples_per_s": n / seconds}


def _built_model(folder: Path) -> Path:
    if not (folder / "config.json").exists():
        from synthetic.models import build_model

        build_model(folder, size="2b")
    return folder


def _built_split(folder: Path, rows: int) -> Path:
    if not folder.exists():
        from synthetic.splits import write_split

        write_split(folder, "other", rows, seed=0, image_size=(480, 320))
    return folder


if __name__ == "__main__":
    main()
