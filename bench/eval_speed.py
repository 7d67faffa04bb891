"""How fast the evaluator scores on a GPU, against the inherited self-check's way of generating (bench/gpu.py runs it).

With the real Qwen2-VL-2B architecture (random weights: every completion runs to the 256-token cap unless an end
token happens to come, the worst case) and a synthetic split of 480x320 images, side by side in one process:

- plain: `model.generate` on batches of 64 in input order, preprocessing inline, dynamic cache (the self-check);
- evaluator: `generate_completions` with `evaluate`'s defaults (length-sorted batches, the next batch prepared on a
  thread, a static KV cache holding each key/value head per query head, a compiled decode step) at each batch size,
  and at the best with each of `OPTIONS` (the ordinary cache, other attention kernels), with how many rows'
  completions differ from the defaults'; the first call of each compiles and is timed apart;
- end to end (`_end_to_end`, run by bench/gpu.py's eval_1k): `python -m evaluator` in a fresh process on all rows,
  timed from outside (imports, model load, compilation, generation, exit), with the defaults or one of
  `END_TO_END_VARIANTS`.

`decode_profile` splits one batch's generation into prefill and decode steps and lists the top GPU operators.

`vision_attention` compares the vision tower's attention once per image (transformers' sdpa loop) with the batched
one (`evaluator.vision_attention`) in one process: the tower's prefill seconds and the evaluator's examples/s.
`vision_tower_speed` times the tower alone on random weights, without a model folder (a one-line GPU check).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from transformers import AttentionInterface

from evaluator.data import load_split
from evaluator.evaluation import load_model, use_attention_options
from evaluator.generation import build_inputs, generate_completions
from evaluator.protocol import GENERATION_KWARGS
from evaluator import vision_attention as batched

PLAIN_BATCH_SIZE = 64  # the brief's measured self-check setting
REPO = Path(__file__).resolve().parents[1]


# The evaluator's default settings (`evaluate`'s), and the options measured at the best batch size against them.
DEFAULTS = {"repeated_kv_cache": True, "folded_gqa_attention": False, "batched_vision_attention": False}
OPTIONS = {
    # The defaults run again: how many rows' completions two runs of the same settings differ in, the floor that the
    # options' differing rows are read against.
    "defaults_again": {},
    # The ordinary static cache, copied per query head at every decode step.
    "copied_kv_cache": {"repeated_kv_cache": False},
    "folded_gqa_batched_vision": {"repeated_kv_cache": False, "folded_gqa_attention": True,
                                  "batched_vision_attention": True},
}
# What else a fresh evaluator process can be run with, measured end to end beside the defaults (`_end_to_end`).
END_TO_END_VARIANTS: dict[str, dict[str, Any]] = {
    # inductor's compile workers started when a kernel must be compiled, not at the first compile call.
    "compile_pool_on_demand": {"environment": {"TORCH_WARM_POOL": "0"}},
    # Nothing compiled: the dynamic cache.
    "dynamic_cache": {"arguments": ["--dynamic-cache"]},
    # dynamo's traced bytecode and guards saved to disk and loaded by the next process (torch's experimental
    # caching precompile): the first run saves, the second is the figure.
    "dynamo_precompile": {"environment": {"TORCH_CACHING_PRECOMPILE": "1"}, "runs": 2},
    # The process as the search starts a round's evaluator: beside the trainer, with --wait-for-input; timed from the
    # line that tells it to go, its imports and the reading of the split done by then.
    "started_ahead": {"arguments": ["--wait-for-input"], "started_ahead": True},
}


def measure(model_dir: Path, split_dir: Path, plain_rows: int, batch_sizes: list[int],
            record: Any = lambda figures: None, device: str = "cuda:0",
            max_new_tokens: int = GENERATION_KWARGS["max_new_tokens"],
            options: list[str] | None = None) -> dict[str, Any]:  # fmt: skip
    """The evaluator's examples/s with `DEFAULTS` at each of `batch_sizes`, and at the best of them with each of
    `options` (names in `OPTIONS`, default all; with how many rows' completions differ from the defaults'), against
    plain batch-64 `generate` on `plain_rows` rows, all on one loaded model. `record` gets the figures so far after
    each measurement. `defaults` are the default settings at the fastest batch size (bench/gpu.py's eval_1k runs with
    them), `defaults_speedup` their examples/s over plain's; `best` and `speedup` the same for the fastest settings,
    options included."""
    rows = load_split(split_dir)
    on_gpu = torch.device(device).type == "cuda"
    model, processor = load_model(model_dir, device)
    use_attention_options(model, **DEFAULTS)
    generate_completions(model, processor, rows.select(range(8)), batch_size=8, max_new_tokens=8)  # warm-up
    figures: dict[str, Any] = {"rows": len(rows)}

    plain = [rows[index] for index in range(min(plain_rows, len(rows)))]
    seconds, _ = _timed(lambda: _plain(model, processor, plain, max_new_tokens), device)
    figures["plain"] = _speed(PLAIN_BATCH_SIZE, len(plain), seconds)
    record(figures)

    def evaluator_speed(batch_size: int, settings: dict[str, bool]) -> tuple[dict[str, Any], list[str]]:
        kwargs = {"static_cache": on_gpu, "repeated_kv_cache": on_gpu and settings["repeated_kv_cache"]}
        first, _ = _timed(lambda: generate_completions(model, processor, rows.select(range(batch_size)), batch_size,
                                                       max_new_tokens, **kwargs), device)  # fmt: skip
        seconds, completions = _timed(lambda: generate_completions(model, processor, rows, batch_size, max_new_tokens,
                                                                   **kwargs), device)  # fmt: skip
        return {**_speed(batch_size, len(rows), seconds), "compile_call_seconds": first,
                "mean_completion_tokens": sum(c.n_tokens for c in completions) / len(completions)}, [
                    c.text for c in completions]  # fmt: skip

    texts = {}
    for batch_size in batch_sizes:
        figures[f"evaluator_static_{batch_size}"], texts[batch_size] = evaluator_speed(batch_size, DEFAULTS)
        record(figures)
    best_size = max(batch_sizes, key=lambda size: figures[f"evaluator_static_{size}"]["examples_per_s"])
    settings = {f"evaluator_static_{size}": {"batch_size": size, **DEFAULTS} for size in batch_sizes}
    unknown = sorted(set(options or ()) - set(OPTIONS))
    if unknown:
        raise ValueError(f"unknown option {unknown[0]!r}; known: {', '.join(OPTIONS)}")
    for name in OPTIONS if options is None else options:
        option_settings = {**DEFAULTS, **OPTIONS[name]}
        use_attention_options(model, **option_settings)
        speed, option_texts = evaluator_speed(best_size, option_settings)
        speed["rows_with_other_completions"] = sum(a != b for a, b in zip(option_texts, texts[best_size]))
        figures[f"evaluator_static_{best_size}_{name}"] = speed
        settings[f"evaluator_static_{best_size}_{name}"] = {"batch_size": best_size, **option_settings}
        use_attention_options(model, **DEFAULTS)
        record(figures)
    del model
    if on_gpu:
        torch.cuda.empty_cache()

    plain = figures["plain"]["examples_per_s"]
    figures["defaults"] = settings[f"evaluator_static_{best_size}"]
    figures["defaults_speedup"] = figures[f"evaluator_static_{best_size}"]["examples_per_s"] / plain
    best = max(settings, key=lambda name: figures[name]["examples_per_s"])
    figures["best"] = settings[best]
    figures["speedup"] = figures[best]["examples_per_s"] / plain
    return figures


def _end_to_end(model_dir: Path, split_dir: Path, inductor_cache: str, batch_size: int, variant: str | None = None,
                **options: bool) -> dict[str, Any]:  # fmt: skip
    """`python -m evaluator` on every row of the split in a fresh process, with `options` (`evaluate`'s flags) and
    the arguments and environment of `END_TO_END_VARIANTS[variant]`. `exit_seconds`: from the report's appearance on
    disk to the process's end; `answers`: the report's, row by row."""
    from bench.round_evaluation import start_waiting

    changes = END_TO_END_VARIANTS[variant] if variant else {}
    with tempfile.TemporaryDirectory() as scratch:
        report_path = Path(scratch) / "report.json"
        command = [sys.executable, "-m", "evaluator", str(model_dir), str(split_dir), "--batch-size", str(batch_size),
                   "--out", str(report_path), *changes.get("arguments", ())]  # fmt: skip
        command += [f"--{'' if on else 'no-'}{name.replace('_', '-')}" for name, on in options.items()]
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": inductor_cache, **changes.get("environment", {})}
        if changes.get("started_ahead"):  # the clock starts at the go line
            process = start_waiting(command, env, Path(scratch) / "stderr.log")
            start = time.perf_counter()
            process.stdin.write("go\n")
            process.stdin.close()
        else:
            start = time.perf_counter()
            process = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.DEVNULL)
        written = None
        while process.poll() is None:
            if written is None and report_path.exists():  # written whole under a temporary name, then renamed
                written = time.perf_counter()
            time.sleep(0.02)
        ended = time.perf_counter()
        if process.returncode != 0:
            raise subprocess.CalledProcessError(process.returncode, command)
        report = json.loads(report_path.read_text())
    seconds = ended - start
    return {"n": report["n"], "seconds": seconds, "examples_per_s": report["n"] / seconds,
            "static_cache": report["static_cache"], "inside_seconds": report["seconds"],
            "exit_seconds": ended - written if written else None, "variant": variant, **options,
            "answers": report["per_row"]["answer"]}  # fmt: skip


def _plain(model: Any, processor: Any, rows: list[dict[str, Any]],
           max_new_tokens: int = GENERATION_KWARGS["max_new_tokens"]) -> list[str]:  # fmt: skip
    """The self-check: fixed batches in input order, each prepared then generated, dynamic cache."""
    texts = []
    with torch.inference_mode():
        for start in range(0, len(rows), PLAIN_BATCH_SIZE):
            inputs = build_inputs(processor, rows[start : start + PLAIN_BATCH_SIZE]).to(model.device)
            output = model.generate(**inputs, **{**GENERATION_KWARGS, "max_new_tokens": max_new_tokens})
            new_tokens = output[:, inputs["input_ids"].shape[1] :]
            texts += processor.batch_decode(new_tokens, skip_special_tokens=True, clean_up_tokenization_spaces=False)
    return texts


def _timed(work: Any, device: str = "cuda") -> tuple[float, Any]:
    on_gpu = torch.device(device).type == "cuda"
    if on_gpu:
        torch.cuda.synchronize()
    start = time.perf_counter()
    result = work()
    if on_gpu:
        torch.cuda.synchronize()
    return time.perf_counter() - start, result


def _speed(batch_size: int, n: int, seconds: float) -> dict[str, float]:
    return {"batch_size": batch_size, "n": n, "seconds": seconds, "examples_per_s": n / seconds}


def decode_profile(model_dir: Path, split_dir: Path, batch_size: int, new_tokens: int = 32) -> dict[str, Any]:
    """Where a compiled static-cache generation of one batch of `batch_size` rows spends its time: prefill (a
    generation of one token, which runs no decode step) against the decode steps (the rest of a `new_tokens`
    generation, per step), and the top operators by CUDA time over the whole generation, after a warm-up call
    that compiles."""
    from torch.profiler import ProfilerActivity, profile

    rows = load_split(split_dir).select(range(batch_size))
    model, processor = load_model(model_dir, "cuda:0", repeated_kv_cache=True)

    def generate(tokens: int) -> Any:
        return generate_completions(model, processor, rows, batch_size, max_new_tokens=tokens, static_cache=True,
                                    repeated_kv_cache=True)  # fmt: skip

    generate(new_tokens)
    generate(1)
    prefill, _ = _timed(lambda: generate(1))
    wall, _ = _timed(lambda: generate(new_tokens))
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        generate(new_tokens)
    torch.cuda.synchronize()
    events = prof.key_averages()
    cuda_total = sum(e.self_device_time_total for e in events) / 1e6
    top = sorted(events, key=lambda e: e.self_device_time_total, reverse=True)[:15]
    del model
    torch.cuda.empty_cache()
    return {
        "batch_size": batch_size,
        "new_tokens": new_tokens,
        "wall_seconds": wall,
        "prefill_seconds": prefill,
        "prefill_fraction": prefill / wall,
        "decode_ms_per_step": 1000 * (wall - prefill) / max(new_tokens - 1, 1),
        "wall_ms_per_token": 1000 * wall / new_tokens,
        "gpu_busy_ms_per_token": 1000 * cuda_total / new_tokens,
        "top_gpu_ops": [
            {"name": e.key[:80], "ms_per_token": e.self_device_time_total / 1e3 / new_tokens, "calls": e.count}
            for e in top
        ],
    }


def vision_attention(model_dir: Path, split_dir: Path, device: str = "cuda:0", batch_size: int = 256,
                     rows: int | None = 512, max_new_tokens: int = GENERATION_KWARGS["max_new_tokens"],
                     repeats: int = 3, record: Any = lambda figures: None) -> dict[str, Any]:  # fmt: skip
    """Per-image vision attention against the batched one, side by side on one loaded model: the vision tower's
    seconds for one batch of `batch_size` rows' images (the median of `repeats` after a warm-up), and the evaluator's
    examples/s on `rows` rows (static cache on a GPU, compiled by an untimed first pass). Also how far
    the tower's outputs and the completions of the two are apart. `record` gets the figures after the tower's."""
    split = load_split(split_dir)
    split = split.select(range(min(rows or len(split), len(split))))
    on_gpu = torch.device(device).type == "cuda"
    model, processor = load_model(model_dir, device, repeated_kv_cache=on_gpu)
    inputs = build_inputs(processor, [split[i] for i in range(min(batch_size, len(split)))]).to(device)
    pixels, grid = inputs["pixel_values"].to(model.dtype), inputs["image_grid_thw"]
    tower = model.model.visual

    def generate() -> list:
        return generate_completions(model, processor, split, batch_size, max_new_tokens=max_new_tokens,
                                    static_cache=on_gpu, repeated_kv_cache=on_gpu)  # fmt: skip

    if on_gpu:  # compiles the static-cache decode step for these rows' cache length; both ways share it
        generate()
    figures: dict[str, Any] = {"device": device, "batch_size": batch_size, "rows": len(split),
                               "images_in_tower_batch": int(grid.shape[0]), "patches": int(pixels.shape[0]),
                               "max_new_tokens": max_new_tokens}  # fmt: skip
    modes = {"per_image": False, "batched": True}
    outputs, seconds, completions = {}, {name: [] for name in modes}, {}
    with torch.inference_mode():
        for name, enabled in modes.items():  # warm-up
            batched.use_batched_vision_attention(model, enabled)
            outputs[name] = tower(pixels, grid_thw=grid).pooler_output.float()
        for _ in range(repeats):  # interleaved, so that a change in the machine's load hits both alike
            for name, enabled in modes.items():
                batched.use_batched_vision_attention(model, enabled)
                seconds[name].append(_timed(lambda: tower(pixels, grid_thw=grid), device)[0])
    for name in modes:
        figures[name] = {"tower_seconds": statistics.median(seconds[name]), "tower_seconds_each": seconds[name]}
    figures["tower_speedup"] = figures["per_image"]["tower_seconds"] / figures["batched"]["tower_seconds"]
    record(figures)
    for name, enabled in modes.items():
        batched.use_batched_vision_attention(model, enabled)
        generate_seconds, completions[name] = _timed(generate, device)
        figures[name].update(_speed(batch_size, len(split), generate_seconds))
    batched.use_batched_vision_attention(model, False)
    difference = (outputs["batched"] - outputs["per_image"]).abs()
    figures["eval_speedup"] = figures["batched"]["examples_per_s"] / figures["per_image"]["examples_per_s"]
    figures["tower_max_abs_difference"] = difference.max().item()
    figures["tower_max_relative_difference"] = (difference.max() / outputs["per_image"].abs().max()).item()
    figures["rows_with_other_completions"] = sum(
        a != b for a, b in zip(completions["per_image"], completions["batched"], strict=True)
    )
    del model
    if on_gpu:
        torch.cuda.empty_cache()
    return figures


def vision_tower_speed(device: str = "cuda", images: int = 256, sides: tuple[int, ...] = (448,),
                       dtype: torch.dtype = torch.bfloat16, size: str = "2b", depth: int | None = None,
                       repeats: int = 3) -> dict[str, Any]:  # fmt: skip
    """The Qwen2-VL vision tower of `size` alone (random weights, no folder), on `images` images whose sides cycle
    through `sides` pixels (multiples of 28): seconds per call once per image, batched (what `batched_vision_attention`
    picks on this device), and batched through SDPA on equal-size groups (its fallback off CUDA), each the median of
    `repeats` after a warm-up; and how far the outputs are from the per-image ones."""
    from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VisionTransformerPretrainedModel

    from synthetic.models import build_config

    config = build_config(size).vision_config
    if depth is not None:
        config.depth = depth
    config._attn_implementation = "sdpa"
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        tower = Qwen2VisionTransformerPretrainedModel._from_config(config, dtype=dtype).to(device).eval()
    patch = config.patch_size
    grid = torch.tensor([[1, sides[i % len(sides)] // patch, sides[i % len(sides)] // patch] for i in range(images)],
                        device=device)  # fmt: skip
    channels = config.in_channels * config.temporal_patch_size * patch * patch
    pixels = torch.randn(int(grid.prod(dim=1).sum()), channels, generator=torch.Generator().manual_seed(0))
    pixels = pixels.to(device, dtype)
    AttentionInterface.register(batched.ATTENTION_NAME, batched.batched_vision_attention)
    figures: dict[str, Any] = {"device": str(device), "images": images, "sides": list(sides), "dtype": str(dtype),
                               "depth": config.depth, "patches": int(pixels.shape[0]),
                               "batched_kernel": "varlen_attn" if batched.varlen_applies(pixels) else "grouped sdpa"}
    names = ("per_image", "batched", "batched_grouped_sdpa")
    outputs, seconds = {}, {name: [] for name in names}
    varlen_ok = batched._VARLEN_OK

    def run(name: str) -> torch.Tensor:
        # Every block reads the implementation from this config object. The grouped fallback is forced by hiding
        # varlen_attn for one call (on a CPU it is what "batched" runs anyway).
        config._attn_implementation = "sdpa" if name == "per_image" else batched.ATTENTION_NAME
        batched._VARLEN_OK = varlen_ok and name != "batched_grouped_sdpa"
        try:
            return tower(pixels, grid_thw=grid).pooler_output
        finally:
            batched._VARLEN_OK = varlen_ok

    with torch.inference_mode():
        for name in names:  # warm-up
            outputs[name] = run(name).float()
        for _ in range(repeats):  # interleaved, so that a change in the machine's load hits all alike
            for name in names:
                seconds[name].append(_timed(lambda: run(name), device)[0])
    for name in names:
        figures[name] = {"seconds": statistics.median(seconds[name]), "seconds_each": seconds[name]}
    for name in ("batched", "batched_grouped_sdpa"):
        difference = (outputs[name] - outputs["per_image"]).abs()
        figures[name]["speedup"] = figures["per_image"]["seconds"] / figures[name]["seconds"]
        figures[name]["max_abs_difference"] = difference.max().item()
        figures[name]["max_relative_difference"] = (difference.max() / outputs["per_image"].abs().max()).item()
    return figures
