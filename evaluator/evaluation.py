"""Score a saved model on one split or several the way the verifier does, with one process per GPU.

The inputs are checked before any weights are loaded; each worker loads the model on its own device, generates for
its shard of the rows (of every split at once), and the completions are put back in each split's order before
scoring.
"""

from __future__ import annotations

import json
import os
import time
from concurrent.futures import ProcessPoolExecutor
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import datasets
import torch
import torch.multiprocessing
from transformers import AutoProcessor, Qwen2VLForConditionalGeneration

from evaluator.data import DataError, load_split, subset_indices, validate_solutions
from evaluator.generation import Completion, generate_completions
from evaluator.gpu_memory import cap_gpu_memory
from evaluator.protocol import GENERATION_KWARGS
from evaluator.repeated_kv_cache import use_repeated_kv_attention
from evaluator.report import build_report
from evaluator.text_attention import use_folded_gqa_attention
from evaluator.vision_attention import use_batched_vision_attention

# Decoding costs about the same per step whatever the batch on a GPU, so big batches are nearly free throughput;
# 128 rows of 480x320 images fit a 48 GB card with room to spare. On a CPU, small batches waste less on padding.
DEFAULT_GPU_BATCH_SIZE = 128
DEFAULT_CPU_BATCH_SIZE = 4
# The only architecture the verifier loads (`Qwen2VLForConditionalGeneration.from_pretrained`).
MODEL_TYPE = "qwen2_vl"
# The columns a completion is generated from (`protocol.build_messages`).
GENERATED_FROM = ["image", "problem"]


class ModelError(ValueError):
    """A model folder the verifier could not load as Qwen2-VL; the message names the folder."""


class Split(NamedTuple):
    """A split folder to score and which of its rows: all of them; `limit` of them (the first, or a seeded subset
    with `seed`); or exactly the rows at `indices` (what a report's `per_row.index` names: the search re-checks a
    promoted model on rows it was scored on)."""

    data: str | Path
    limit: int | None = None
    seed: int | None = None
    indices: Sequence[int] | None = None


def evaluate(
    model_dir: str | Path,
    data: str | Path,
    *,
    limit: int | None = None,
    seed: int | None = None,
    indices: Sequence[int] | None = None,
    **options: Any,
) -> dict[str, Any]:
    """The report of `model_dir` on the split folder `data` (see `report.build_report` for the scores); the rows as
    `Split` picks them, `options` as `evaluate_splits` takes them."""
    return evaluate_splits(model_dir, [Split(data, limit, seed, indices)], **options)[0]


def evaluate_splits(
    model_dir: str | Path,
    splits: Sequence[Split],
    *,
    batch_size: int | None = None,
    devices: list[str] | None = None,
    num_samples: int = 5,
    static_cache: bool = True,
    max_new_tokens: int = GENERATION_KWARGS["max_new_tokens"],
    repeated_kv_cache: bool = True,
    batched_vision_attention: bool = False,
    folded_gqa_attention: bool = False,
    compiled_decode: bool = True,
    wait_for_model: Callable[[], None] | None = None,
    gpu_memory_gb: float | None = None,
) -> list[dict[str, Any]]:
    """One report per split, in order, from one load of the model: the rows of every split are generated together,
    in one run of length-sorted batches, so a second split costs neither a model load nor another compilation of the
    decode step. Each report's `seconds` is the whole call's (`call_rows` rows of `call_splits`).

    wait_for_model: called once every split is read and checked, before the model folder is looked at; it may block
    until the model is written (`python -m evaluator --wait-for-input`), and `seconds` then start when it returns.

    devices: None for every visible GPU (the CPU when there is none), else device names, one worker each; the same
    name may repeat (["cpu", "cpu"] runs two CPU workers). static_cache, compiled_decode: see
    `generate_completions`; ignored on a CPU. `max_new_tokens` other than 256 is not the verifier's protocol: it is
    for quick checks, and the report records it. repeated_kv_cache, batched_vision_attention, folded_gqa_attention:
    see `load_model`; the repeated-KV cache is a static cache's, and folded attention, which reads the ordinary cache
    in place, needs none. gpu_memory_gb: each GPU worker's memory is capped to this many GB (10^9 bytes) with
    `torch.cuda.set_per_process_memory_fraction`, so that a larger card rehearses a smaller one; None: the card's.
    """
    start = time.perf_counter()
    if not splits:
        raise ValueError("evaluate_splits needs at least one split")
    chosen = [_chosen_rows(split) for split in splits]  # every split is read and checked before any weights
    rows = _together([split_rows for split_rows, _, _ in chosen])
    if wait_for_model is not None:
        wait_for_model()
        start = time.perf_counter()
    model_dir = check_model_dir(model_dir)
    devices = _devices(devices)
    on_gpu = torch.device(devices[0]).type == "cuda"
    batch_size = batch_size or (DEFAULT_GPU_BATCH_SIZE if on_gpu else DEFAULT_CPU_BATCH_SIZE)
    static_cache = static_cache and on_gpu  # it compiles the decode step only on a GPU; on a CPU it only costs
    repeated_kv_cache = repeated_kv_cache and static_cache and not folded_gqa_attention
    # Strided shards: each worker gets the same mix of prompt lengths, so they finish together.
    shards = [list(range(worker, len(rows), len(devices))) for worker in range(len(devices))]
    shards = [shard for shard in shards if shard]
    jobs = [
        (model_dir, device, rows.select(shard), batch_size, max_new_tokens, static_cache, repeated_kv_cache,
         batched_vision_attention, folded_gqa_attention, compiled_decode, len(shards), gpu_memory_gb)
        for device, shard in zip(devices, shards)
    ]
    if len(jobs) == 1:
        outputs = [_run_shard(*jobs[0])]
    else:
        context = torch.multiprocessing.get_context("spawn")
        with ProcessPoolExecutor(max_workers=len(jobs), mp_context=context) as pool:
            outputs = list(pool.map(_run_shard, *zip(*jobs)))
    completions: list[Completion] = [None] * len(rows)  # type: ignore[list-item]
    for shard, shard_completions in zip(shards, outputs):
        for index, completion in zip(shard, shard_completions):
            completions[index] = completion
    seconds = time.perf_counter() - start
    shared = {  # every report of the call
        "seconds": seconds,
        "examples_per_s": len(rows) / seconds,
        "call_rows": len(rows),
        "call_splits": [str(split.data) for split in splits],
        "model": str(model_dir),
        "devices": devices[: len(jobs)],
        "batch_size": batch_size,
        "max_new_tokens": max_new_tokens,
        "static_cache": static_cache,
        "compiled_decode": compiled_decode and static_cache,
        "repeated_kv_cache": repeated_kv_cache,
        "batched_vision_attention": batched_vision_attention,
        "folded_gqa_attention": folded_gqa_attention,
    }
    reports, first = [], 0
    for split, (split_rows, golds, indices) in zip(splits, chosen):
        own = completions[first : first + len(split_rows)]
        first += len(split_rows)
        report = build_report(list(split_rows["problem"]), golds, own, num_samples=num_samples, indices=indices)
        reports.append({**report, **shared, "data": str(split.data), "limit": split.limit, "seed": split.seed})
    return reports


def _chosen_rows(split: Split) -> tuple[Any, list[int], list[int]]:
    """The split's chosen rows, their gold counts and their indices in the split; DataError for a bad folder, bad
    solutions or bad indices."""
    data, limit, seed, indices = split
    whole = load_split(data)
    if indices is None:
        indices = subset_indices(len(whole), limit, seed)
    elif limit is not None or not indices or not all(0 <= i < len(whole) for i in indices):
        raise DataError(f"{data}: indices must be non-empty row numbers below {len(whole)}, without limit")
    indices = [int(i) for i in indices]
    rows = whole if len(indices) == len(whole) and indices == list(range(len(whole))) else whole.select(indices)
    return rows, validate_solutions(rows, source=str(data)), indices


def _together(splits_rows: list[Any]) -> Any:
    """The rows of every split as one dataset, in order, with only what generation reads (image, problem). A split
    whose column types differ from the first's (one folder's parquet may store its text as large_string, another's as
    string) is cast to them in memory: a cast on disk would write next to the split, which may be read-only."""
    if len(splits_rows) == 1:
        return splits_rows[0]
    columns = [rows.select_columns(GENERATED_FROM) for rows in splits_rows]
    features = columns[0].features
    same = [rows if rows.features == features else rows.cast(features, keep_in_memory=True) for rows in columns]
    return datasets.concatenate_datasets(same)


def check_model_dir(path: str | Path) -> Path:
    """The folder, if its config.json says Qwen2-VL; read before any weights so a wrong folder fails in a second."""
    folder = Path(path)
    if not folder.is_dir():
        raise ModelError(f"{folder}: no such model folder")
    config_file = folder / "config.json"
    if not config_file.is_file():
        raise ModelError(f"{folder}: no config.json, not a save_pretrained model folder")
    try:
        model_type = json.loads(config_file.read_text()).get("model_type")
    except (json.JSONDecodeError, UnicodeDecodeError, AttributeError) as error:
        raise ModelError(f"{config_file}: not a model config ({error})") from None
    if model_type != MODEL_TYPE:
        raise ModelError(f"{folder}: model_type is {model_type!r}; the verifier loads only {MODEL_TYPE!r}")
    return folder


def load_model(
    model_dir: str | Path,
    device: str,
    batched_vision_attention: bool = False,
    folded_gqa_attention: bool = False,
    repeated_kv_cache: bool = False,
) -> tuple[Any, Any]:
    """The model in eval mode on `device` (bf16 with sdpa attention on a GPU, float32 on a CPU) and its processor.

    repeated_kv_cache: the language model attends over a static cache that holds each key/value head once per query
    head (`evaluator.repeated_kv_cache`; generate with `repeated_kv_cache=True`), so decode steps do not copy the
    cache. SDPA gets the very tensors the verifier's path builds by copying, so it runs the same kernel on the same
    inputs.

    batched_vision_attention: the vision tower attends to a whole batch of images in one call
    (`evaluator.vision_attention`) instead of once per image. Off by default: the verifier runs the per-image path,
    whose bf16 rounding the batched kernel does not reproduce exactly.

    folded_gqa_attention: the language model's query heads that share a key/value head attend as rows of that head
    (`evaluator.text_attention`) instead of over a copy of the cache per query head. Off by default for the same
    reason: another kernel, other rounding.
    """
    if folded_gqa_attention and repeated_kv_cache:
        raise ValueError("folded_gqa_attention reads the ordinary cache in place: it takes no repeated_kv_cache")
    on_gpu = torch.device(device).type == "cuda"
    model = Qwen2VLForConditionalGeneration.from_pretrained(
        model_dir,
        dtype=torch.bfloat16 if on_gpu else torch.float32,
        attn_implementation="sdpa",
        device_map={"": device},
    )
    use_attention_options(model, batched_vision_attention, folded_gqa_attention, repeated_kv_cache)
    return model.eval(), AutoProcessor.from_pretrained(model_dir)


def use_attention_options(model: Any, batched_vision_attention: bool, folded_gqa_attention: bool,
                          repeated_kv_cache: bool) -> None:  # fmt: skip
    """Set `load_model`'s attention options on a loaded model, each on or off (folded attention, which reads the
    ordinary cache, wins over the repeated-KV cache's attention)."""
    use_batched_vision_attention(model, batched_vision_attention)
    if folded_gqa_attention:
        use_folded_gqa_attention(model)
    else:
        use_repeated_kv_attention(model, repeated_kv_cache)


def _devices(devices: list[str] | None) -> list[str]:
    if devices is None:
        count = torch.cuda.device_count()
        return [f"cuda:{index}" for index in range(count)] if count else ["cpu"]
    if not devices:
        raise ValueError("devices must name at least one device")
    return [str(torch.device(device)) for device in devices]


def _run_shard(
    model_dir: Path,
    device: str,
    rows: Any,
    batch_size: int,
    max_new_tokens: int,
    static_cache: bool,
    repeated_kv_cache: bool,
    batched_vision_attention: bool,
    folded_gqa_attention: bool,
    compiled_decode: bool,
    workers: int,
    gpu_memory_gb: float | None = None,
) -> list[Completion]:
    """One worker: load the model on `device` and generate its rows' completions, in their order."""
    if torch.device(device).type == "cuda":
        torch.cuda.set_device(device)  # keeps this process's CUDA context off the other workers' GPUs
        cap_gpu_memory(device, gpu_memory_gb)
    elif workers > 1:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // workers))  # CPU workers share the cores
    model, processor = load_model(model_dir, device, batched_vision_attention, folded_gqa_attention, repeated_kv_cache)
    return generate_completions(model, processor, rows, batch_size=batch_size, max_new_tokens=max_new_tokens,
                                static_cache=static_cache, repeated_kv_cache=repeated_kv_cache,
                                compiled_decode=compiled_decode)  # fmt: skip
