"""Greedy completions for counting rows, prompted exactly as the verifier prompts, on an already loaded model.

The verifier's steps, per row: `protocol.build_messages` (no system message), `apply_chat_template(tokenize=False,
add_generation_prompt=True)`, `qwen_vl_utils.process_vision_info` with its defaults, the processor on the batch,
`generate` with the model's generation config plus `protocol.GENERATION_KWARGS`, and the new tokens decoded with
`batch_decode(skip_special_tokens=True, clean_up_tokenization_spaces=False)`. What differs is only how rows are
grouped: batches of similar prompt length, left-padded, so that padding costs little.
"""

from __future__ import annotations

import io
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, NamedTuple

import datasets
import PIL.Image
import torch
from qwen_vl_utils import process_vision_info, smart_resize

from evaluator.protocol import GENERATION_KWARGS, build_messages
from evaluator.repeated_kv_cache import repeated_kv_cache

# Qwen2-VL: 14-pixel patches merged 2x2, so one image token covers a 28x28 square (qwen_vl_utils' default factor).
_PIXELS_PER_IMAGE_TOKEN = 28


class Completion(NamedTuple):
    text: str
    n_tokens: int  # generated tokens up to and including the first end-of-sequence token


def generate_completions(
    model: Any,
    processor: Any,
    rows: Sequence[Mapping[str, Any]],
    batch_size: int = 8,
    max_new_tokens: int = GENERATION_KWARGS["max_new_tokens"],
    static_cache: bool = False,
    repeated_kv_cache: bool = False,
    compiled_decode: bool = True,
) -> list[Completion]:
    """One greedy completion per row (a mapping with a PIL `image` and a `problem`), in the order of `rows`.

    `rows` may be a `datasets.Dataset`: its images are then sized from their file headers and decoded one batch at a
    time. `static_cache` compiles the decode step on a GPU: about a minute the first time in a machine (inductor
    caches it on disk for later processes), then about 3x faster per decode step than the dynamic cache.
    `repeated_kv_cache` (with `static_cache`; the model set up with `use_repeated_kv_attention`): the static cache
    holds each key/value head once per query head (`evaluator.repeated_kv_cache`): attention gets the same inputs
    without a copy of the cache at every decode step. `compiled_decode=False` (with `static_cache`) decodes eagerly
    over the same cache: nothing compiled, and attention sees one cache length at every step, where the dynamic
    cache's growing length makes cuDNN choose a kernel plan per step the first time a process meets it.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if len(rows) == 0:
        return []
    repeated = static_cache and repeated_kv_cache
    kwargs = _generation_kwargs(max_new_tokens, static_cache and not repeated, compiled_decode)
    cache = None
    batches = _length_sorted_batches(rows, processor, batch_size)
    # A compiled static-cache decode step recompiles for every new batch shape, so short batches are filled up.
    pad_to = len(batches[0]) if static_cache else None
    new_tokens = []
    # Images are decoded, resized and patched on a CPU thread for the next batch while the model generates this one.
    # Only that thread touches the tokenizer until the loop ends (a fast tokenizer is not safe to share).
    with ThreadPoolExecutor(max_workers=1) as pool, torch.inference_mode():
        pending = pool.submit(_prepare, processor, rows, batches[0], pad_to)
        for number, indices in enumerate(batches):
            inputs = pending.result()
            if number + 1 < len(batches):
                pending = pool.submit(_prepare, processor, rows, batches[number + 1], pad_to)
            if repeated:
                cache = _emptied_cache(model, cache, inputs["input_ids"].shape[1] + max_new_tokens - 1)
                kwargs["past_key_values"] = cache
            new_tokens.append(_generate(model, inputs, kwargs)[: len(indices)])
    results: list[Completion] = [None] * len(rows)  # type: ignore[list-item]
    for indices, tokens in zip(batches, new_tokens):
        for index, completion in zip(indices, _decode(processor, tokens, model.generation_config.eos_token_id)):
            results[index] = completion
    return results


def build_inputs(processor: Any, rows: Sequence[Mapping[str, Any]]) -> Any:
    """The processor's tensors for a batch of rows, built as the verifier builds them, left-padded."""
    conversations = [build_messages(row["image"], row["problem"]) for row in rows]
    texts = [processor.apply_chat_template(turn, tokenize=False, add_generation_prompt=True) for turn in conversations]
    images, videos = process_vision_info(conversations)
    return processor(text=texts, images=images, videos=videos, padding=True, padding_side="left", return_tensors="pt")


def _generation_kwargs(max_new_tokens: int, static_cache: bool, compiled_decode: bool = True) -> dict[str, Any]:
    """The verifier's `generate` keyword arguments, on top of the model's own generation config as it does.

    The model's config keeps what greedy decoding uses from it (end-of-sequence and pad ids, a repetition penalty if
    one is set); its sampling settings (temperature 0.01, top_k 1, top_p 0.001 in Qwen2-VL's) do nothing without
    sampling. Passing `do_sample=False` as a keyword, not inside a GenerationConfig, is also what keeps transformers
    quiet about them: it only warns about inherited sampling flags when `do_sample` was not set by the caller.
    """
    kwargs = {**GENERATION_KWARGS, "max_new_tokens": max_new_tokens}
    if static_cache:
        kwargs["cache_implementation"] = "static"
    if not compiled_decode:  # transformers compiles the decode step of any static cache unless told not to
        kwargs["disable_compile"] = True
    return kwargs


def _emptied_cache(model: Any, cache: Any, positions: int) -> Any:
    """A repeated-KV cache of at least `positions` per layer for the next batch: the previous one emptied, or a new one
    when it is too short. One cache serves every batch (all are filled up to one size), so the compiled decode step
    keeps reading the same tensors. `positions` is what transformers sizes its own static cache to (prompt plus new
    tokens, less one) and, like it, the cache never shrinks: the same cache length, the same attention arithmetic."""
    if cache is not None and cache.get_max_length() >= positions:
        cache.reset()
        return cache
    return repeated_kv_cache(model, positions)


def _length_sorted_batches(rows: Sequence[Mapping[str, Any]], processor: Any, batch_size: int) -> list[list[int]]:
    """Row indices grouped by prompt length, longest first.

    Longest first because a static cache is sized by the first batch and is then reused (recompiled if a later
    prompt is longer). The length is the image's token count plus the question's: the chat template adds the same
    tokens to every row.
    """
    problems = rows["problem"] if isinstance(rows, datasets.Dataset) else [row["problem"] for row in rows]
    text_tokens = [len(ids) for ids in processor.tokenizer(list(problems))["input_ids"]]
    lengths = [_image_tokens(size) + n for size, n in zip(_image_sizes(rows), text_tokens)]
    order = sorted(range(len(rows)), key=lambda index: -lengths[index])
    return [order[start : start + batch_size] for start in range(0, len(order), batch_size)]


def _image_sizes(rows: Sequence[Mapping[str, Any]]) -> list[tuple[int, int]]:
    """(width, height) of every row's image; for a Dataset, read from the encoded file's header without decoding it."""
    if not isinstance(rows, datasets.Dataset):
        return [row["image"].size for row in rows]
    encoded = rows.cast_column("image", datasets.Image(decode=False))["image"]
    sizes = []
    for image in encoded:
        source = io.BytesIO(image["bytes"]) if image["bytes"] is not None else image["path"]
        with PIL.Image.open(source) as opened:  # PIL reads the header only until pixels are asked for
            sizes.append(opened.size)
    return sizes


def _image_tokens(size: tuple[int, int]) -> int:
    width, height = size
    resized_height, resized_width = smart_resize(height, width, factor=_PIXELS_PER_IMAGE_TOKEN)
    return (resized_height // _PIXELS_PER_IMAGE_TOKEN) * (resized_width // _PIXELS_PER_IMAGE_TOKEN)


def _prepare(processor: Any, rows: Sequence[Mapping[str, Any]], indices: list[int], pad_to: int | None) -> Any:
    """The batch's inputs; with `pad_to`, a short batch is filled up with copies of its last row, whose completions
    are dropped."""
    batch = [rows[index] for index in indices]
    if pad_to is not None:
        batch += [batch[-1]] * (pad_to - len(batch))
    return build_inputs(processor, batch)


def _generate(model: Any, inputs: Any, kwargs: dict[str, Any]) -> torch.Tensor:
    """The generated tokens of every row of the batch (with the padding that follows an early end), on the CPU."""
    inputs = inputs.to(model.device)
    output = model.generate(**inputs, **kwargs)
    # Left padding puts every prompt's end at the same column, so the new tokens are what follows it.
    return output[:, inputs["input_ids"].shape[1] :].cpu()


def _decode(processor: Any, new_tokens: torch.Tensor, eos_token_id: int | list[int] | None) -> list[Completion]:
    texts = processor.batch_decode(new_tokens, skip_special_tokens=True, clean_up_tokenization_spaces=False)
    return [Completion(text, count) for text, count in zip(texts, tokens_until_eos(new_tokens, eos_token_id))]


def tokens_until_eos(new_tokens: torch.Tensor, eos_token_id: int | list[int] | None) -> list[int]:
    """Generated tokens up to and including the first end-of-sequence token; the padding after it is not counted."""
    length = new_tokens.shape[1]
    if eos_token_id is None:
        return [length] * new_tokens.shape[0]
    eos_ids = torch.tensor(eos_token_id, device=new_tokens.device).reshape(-1)
    is_eos = torch.isin(new_tokens, eos_ids)
    # argmax finds the first True; rows with no EOS ran to the cap.
    first = torch.where(is_eos.any(dim=1), is_eos.int().argmax(dim=1) + 1, length)
    return first.tolist()
