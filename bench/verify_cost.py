"""What a promotion's check costs with the real 2B architecture (random weights): the seconds of
`search.promotion.verification.verify` as the search runs it (a checker interpreter started ahead, loading the model as the
verifier does, then 50 recorded ood_val rows generated again) with its parts, against the load check alone, on the
GPU a finished round leaves free; with --generation-parts, where the generation of those rows goes, in this process.

    python bench/verify_cost.py --work built/verify-cost --out bench/results/<date>-h200-verify.json

Random weights never stop before the 256-token cap, so the generation part is an upper bound: a trained model
answers in about 10 tokens.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
READY_S = 15  # before each check: a round runs between two checks of a search, while the next checker imports
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--work", type=Path, default=ROOT / "built" / "verify-cost")
    parser.add_argument("--model", type=Path, help="the 2B model folder (default: built under --work)")
    parser.add_argument("--rows", type=int, default=50)
    parser.add_argument("--generation-parts", action="store_true",
                        help="also time the check's generation in this process, taken apart (generation_parts)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)

    import torch

    from evaluator.evaluation import evaluate
    from search.promotion import expected_answers, keep_a_checker_ready, verify
    from synthetic.models import build_model
    from synthetic.splits import write_split

    model, split = args.model or args.work / "model-2b", args.work / "ood"
    if not (model / "config.json").is_file():
        build_model(model, size="2b", seed=0)
    if not split.is_dir():
        write_split(split, "other", args.rows, seed=0, image_size=(480, 320), count_range=(1, 10))
    began = time.perf_counter()
    report = evaluate(model, split, batch_size=64, static_cache=True)  # as a round is scored on the box
    record_s = time.perf_counter() - began
    expected = expected_answers(report["per_row"], rows=args.rows)
    gpus = [0] if torch.cuda.is_available() else []
    keep_a_checker_ready()  # as the search does
    try:
        time.sleep(READY_S)
        began = time.perf_counter()
        load_only = verify(model, gpus=gpus)
        load_s = time.perf_counter() - began
        time.sleep(READY_S)
        began = time.perf_counter()
        checked = verify(model, split, expected, gpus=gpus, batch_size=64)
        check_s = time.perf_counter() - began
    finally:
        keep_a_checker_ready(False)
    result = {
        "machine": torch.cuda.get_device_name() if gpus else "cpu",
        "rows": args.rows,
        "record_s": round(record_s, 1),
        "verify_load_only_s": round(load_s, 1),
        "verify_s": round(check_s, 1),
        "verify_load_only_parts": load_only["seconds"],
        "verify_parts": checked["seconds"],
        "differ": checked["differ"],
        "mean_completion_tokens": report["mean_completion_tokens"],
        "torch": torch.__version__,
    }
    if args.generation_parts and gpus:
        result["generation"] = generation_parts(model, split, args.rows)
    print(json.dumps(result))
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    return 0 if load_only["rows"] == 0 else 1


def generation_parts(model_dir: Path, split_dir: Path, rows: int) -> dict[str, float]:
    """Seconds of one `generate` of the first `rows` rows with the protocol's settings, inputs prepared beforehand, on
    the model loaded as the evaluator loads it: with the dynamic cache, the first time in this process and again
    (every attention shape seen before), and with cuDNN's attention off; then with transformers' static cache
    uncompiled (one cache length for every step, as the check decodes over its repeated-KV one), first and again."""
    import torch

    from bench.eval_speed import _timed
    from evaluator.data import load_split
    from evaluator.evaluation import load_model
    from evaluator.generation import _generation_kwargs, build_inputs
    from evaluator.protocol import GENERATION_KWARGS

    model, processor = load_model(model_dir, "cuda:0")
    split = load_split(split_dir)
    inputs = build_inputs(processor, [split[index] for index in range(rows)]).to(model.device)

    def generate(static_cache: bool) -> float:
        kwargs = _generation_kwargs(GENERATION_KWARGS["max_new_tokens"], static_cache, compiled_decode=False)
        with torch.inference_mode():
            return _timed(lambda: model.generate(**inputs, **kwargs))[0]

    parts = {"dynamic_first_s": generate(False), "dynamic_again_s": generate(False)}
    torch.backends.cuda.enable_cudnn_sdp(False)
    try:
        parts["dynamic_cudnn_attention_off_s"] = generate(False)
    finally:
        torch.backends.cuda.enable_cudnn_sdp(True)
    parts["static_uncompiled_first_s"] = generate(True)
    parts["static_uncompiled_again_s"] = generate(True)
    return {name: round(seconds, 2) for name, seconds in parts.items()}


if __name__ == "__main__":
    sys.exit(main())
