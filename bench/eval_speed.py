"""How fast the evaluator scores on a GPU, against the inherited self-check's way of generating (bench/gpu.py runs it).

With the real Qwen2-VL-2B architecture (random weights: every completion runs to the 256-token cap unless an end
token happens to come, the worst case) and a synthetic split of 480x320 images, side by side in one process:

- plain: `model.generate` on batches of 64 in input order, preprocessing inline, dynamic cache (the self-check);
- evaluator: `generate_completions` (length-sorted batches, the next batch prepared on a thread, a static KV cache
  with a compiled decode step) at each batch size; the first call at a size compiles and is timed apart;
- end to end: `python -m evaluator` in a fresh process on all rows, timed from outside (imports, model load,
  compilation, generation), once with an empty inductor cache and once with the cache the first run left.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from evaluator.data import load_split
from evaluator.evaluation import load_model
from evaluator.generation import build_inputs, generate_completions
from evaluator.protocol import GENERATION_KWARGS

PLAIN_BATCH_SIZE = 64  # the brief's measured self-check setting
REPO = Path(__file__).resolve().parents[1]


def measure(model_dir: Path, split_dir: Path, plain_rows: int, batch_sizes: list[int]) -> dict[str, Any]:
    rows = load_split(split_dir)
    model, processor = load_model(model_dir, "cuda:0")
    generate_completions(model, processor, rows.select(range(8)), batch_size=8, max_new_tokens=8)  # warm-up
    figures: dict[str, Any] = {"rows": len(rows)}

    plain = [rows[index] for index in range(min(plain_rows, len(rows)))]
    seconds, _ = _timed(lambda: _plain(model, processor, plain))
    figures["plain"] = _speed(PLAIN_BATCH_SIZE, len(plain), seconds)

    for batch_size in batch_sizes:
        first, _ = _timed(lambda: generate_completions(model, processor, rows.select(range(batch_size)), batch_size,
                                                       static_cache=True))  # fmt: skip
        seconds, completions = _timed(lambda: generate_completions(model, processor, rows, batch_size,
                                                                   static_cache=True))  # fmt: skip
        figures[f"evaluator_static_{batch_size}"] = {
            **_speed(batch_size, len(rows), seconds),
            "compile_call_seconds": first,
            "mean_completion_tokens": sum(c.n_tokens for c in completions) / len(completions),
        }
    del model
    torch.cuda.empty_cache()

    best = max(batch_sizes, key=lambda size: figures[f"evaluator_static_{size}"]["examples_per_s"])
    figures["best_batch_size"] = best
    figures["speedup"] = figures[f"evaluator_static_{best}"]["examples_per_s"] / figures["plain"]["examples_per_s"]
    with tempfile.TemporaryDirectory() as inductor_cache:
        for name in ("end_to_end_cold", "end_to_end_warm"):
            figures[name] = _end_to_end(model_dir, split_dir, best, inductor_cache)
    return figures


def _end_to_end(model_dir: Path, split_dir: Path, batch_size: int, inductor_cache: str) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as scratch:
        report_path = Path(scratch) / "report.json"
        command = [sys.executable, "-m", "evaluator", str(model_dir), str(split_dir), "--batch-size", str(batch_size),
                   "--out", str(report_path)]  # fmt: skip
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": inductor_cache}
        start = time.perf_counter()
        subprocess.run(command, cwd=REPO, env=env, check=True, stdout=subprocess.DEVNULL)
        seconds = time.perf_counter() - start
        report = json.loads(report_path.read_text())
    return {"n": report["n"], "seconds": seconds, "examples_per_s": report["n"] / seconds,
            "static_cache": report["static_cache"], "inside_seconds": report["seconds"]}  # fmt: skip


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


def decode_profile(model_dir: Path, split_dir: Path, batch_size: int, new_tokens: int = 32) -> dict[str, Any]:
    """Where a compiled static-cache decode step's time goes at `batch_size`: the CUDA time per decode step, and the
    top operators by CUDA time over one batch of `new_tokens` steps, after a warm-up call that compiles."""
    from torch.profiler import ProfilerActivity, profile

    rows = load_split(split_dir).select(range(batch_size))
    model, processor = load_model(model_dir, "cuda:0")
    generate_completions(model, processor, rows, batch_size, max_new_tokens=new_tokens, static_cache=True)
    wall, _ = _timed(lambda: generate_completions(model, processor, rows, batch_size, max_new_tokens=new_tokens,
                                                  static_cache=True))  # fmt: skip
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        generate_completions(model, processor, rows, batch_size, max_new_tokens=new_tokens, static_cache=True)
    torch.cuda.synchronize()
    events = prof.key_averages()
    cuda_total = sum(e.self_device_time_total for e in events) / 1e6
    top = sorted(events, key=lambda e: e.self_device_time_total, reverse=True)[:15]
    del model
    torch.cuda.empty_cache()
    return {
        "batch_size": batch_size,
        "new_tokens": new_tokens,
        "wall_ms_per_token": 1000 * wall / new_tokens,
        "gpu_busy_ms_per_token": 1000 * cuda_total / new_tokens,
        "top_gpu_ops": [
            {"name": e.key[:80], "ms_per_token": e.self_device_time_total / 1e3 / new_tokens, "calls": e.count}
            for e in top
        ],
    }
