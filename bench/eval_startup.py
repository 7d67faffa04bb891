"""Where the seconds of a fresh `python -m evaluator` process go: imports, model load, each batch's preparation and
generation, what dynamo spent compiling, and optionally one batch's prefill taken apart.

    python bench/eval_startup.py MODEL_DIR SPLIT_DIR [--batch-size 256] [--prefill] > startup.json

Run it in a fresh process, twice with one TORCHINDUCTOR_CACHE_DIR for the warm figures, and time the whole process
from outside to get the exit's share. Warm it with its own first run: inductor does not reuse for this script the
graphs `python -m evaluator` compiled (bench/results/2026-12-04-h200.json, call14). The batches' preparation runs
on the evaluator's own thread while the previous batch generates: a `prepare` that lasts longer than the `generate`
beside it means the GPU waited for the CPU. The seconds are wall-clock marks from the start of the interpreter
(`marks`) and per call (`events`: [what, start, seconds]).
"""

from __future__ import annotations

import time

STARTED = time.perf_counter()  # before the imports it measures

import argparse  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import threading  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model_dir", type=Path)
    parser.add_argument("split_dir", type=Path)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--prefill", action="store_true", help="also take one batch's prefill apart")
    args = parser.parse_args(argv)
    print(json.dumps(measure(args.model_dir, args.split_dir, args.batch_size, args.prefill), indent=1))
    return 0


def measure(model_dir: Path, split_dir: Path, batch_size: int, prefill: bool = False) -> dict[str, Any]:
    marks: dict[str, float] = {}

    def mark(name: str) -> None:
        marks[name] = round(time.perf_counter() - STARTED, 3)

    import torch

    mark("import_torch")
    import datasets  # noqa: F401
    import transformers  # noqa: F401

    mark("import_transformers_datasets")
    from evaluator import evaluation, generation

    mark("import_evaluator")

    # The evaluator's own steps, wrapped to time them (and to keep the loaded model for the prefill's figures).
    events: list[tuple[str, float, float]] = []
    lock = threading.Lock()
    loaded: dict[str, Any] = {}
    prepare, generate, load_model = generation._prepare, generation._generate, evaluation.load_model

    def timed(name: str, work: Any) -> Any:
        def run(*args: Any, **kwargs: Any) -> Any:
            began = time.perf_counter()
            result = work(*args, **kwargs)
            with lock:
                events.append((name, round(began - STARTED, 3), round(time.perf_counter() - began, 3)))
            return result

        return run

    def load(*args: Any, **kwargs: Any) -> Any:
        mark("load_model_start")
        loaded["model"], loaded["processor"] = load_model(*args, **kwargs)
        _sync(torch)
        mark("load_model_end")
        return loaded["model"], loaded["processor"]

    generation._prepare, generation._generate = timed("prepare", prepare), timed("generate", generate)
    evaluation.load_model = load
    try:
        mark("evaluate_start")
        report = evaluation.evaluate(model_dir, split_dir, batch_size=batch_size, devices=[_device(torch)])
        mark("evaluate_end")
    finally:
        generation._prepare, generation._generate, evaluation.load_model = prepare, generate, load_model
    from torch._dynamo.utils import compile_times

    figures: dict[str, Any] = {"n": report["n"], "batch_size": batch_size, "evaluate_seconds": report["seconds"],
                               "marks": marks, "events": sorted(events, key=lambda event: event[1]),
                               "dynamo_compile_seconds": _dynamo_seconds(compile_times(repr="csv"))}  # fmt: skip
    if prefill:
        figures["prefill"] = _prefill(torch, loaded["model"], loaded["processor"], split_dir, batch_size, prepare)
    return figures


def _prefill(torch: Any, model: Any, processor: Any, split_dir: Path, batch_size: int, prepare: Any) -> dict:
    """One batch's preparation on the CPU, its vision tower, and its prefill (a 1-token generation), each the best of
    two after a warm-up; with the profiler's top operators of the prefill (CPU time shows the host's syncs)."""
    from torch.profiler import ProfilerActivity, profile

    from bench.eval_speed import _timed
    from evaluator.data import load_split

    rows = load_split(split_dir)
    indices = list(range(min(batch_size, len(rows))))
    began = time.perf_counter()
    inputs = prepare(processor, rows, indices, None)
    figures: dict[str, Any] = {"prepare_seconds": time.perf_counter() - began}
    inputs = inputs.to(model.device)
    figures["prompt_tokens"] = int(inputs["input_ids"].shape[1])
    figures["patches"] = int(inputs["pixel_values"].shape[0])

    def best(work: Any) -> float:
        work()  # warm-up
        return min(_timed(work, str(model.device))[0] for _ in range(2))

    def one_token() -> Any:
        return model.generate(**inputs, do_sample=False, max_new_tokens=1)

    with torch.inference_mode():
        pixels = inputs["pixel_values"].to(model.dtype)
        figures["tower_seconds"] = best(lambda: model.model.visual(pixels, grid_thw=inputs["image_grid_thw"]))
        figures["prefill_seconds"] = best(one_token)
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
        with profile(activities=activities) as prof:
            one_token()
            _sync(torch)
    events = prof.key_averages()
    figures["top_cpu_ms"] = [[e.key[:70], round(e.cpu_time_total / 1e3, 1), e.count]
                             for e in sorted(events, key=lambda e: -e.cpu_time_total)[:15]]  # fmt: skip
    figures["top_gpu_ms"] = [[e.key[:70], round(e.self_device_time_total / 1e3, 1), e.count]
                             for e in sorted(events, key=lambda e: -e.self_device_time_total)[:15]]  # fmt: skip
    return figures


def _dynamo_seconds(csv: Any) -> dict[str, float]:
    """compile_times' CSV ([names], [seconds per call]) as {name: total seconds} for the main phases."""
    names, values = csv
    wanted = ("_compile.compile_inner", "bytecode_tracing", "OutputGraph.call_user_compiler", "build_guards",
              "CUDAGraphNode.record")  # fmt: skip
    totals = {}
    for name, value in zip(names, values):
        if name in wanted:
            totals[name] = round(sum(float(part) for part in str(value).split(",") if part.strip()), 3)
    return totals


def _device(torch: Any) -> str:
    return "cuda:0" if torch.cuda.is_available() else "cpu"


def _sync(torch: Any) -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


if __name__ == "__main__":
    sys.exit(main())
