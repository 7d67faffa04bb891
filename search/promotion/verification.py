"""A model checked as the verifier will use it, before it becomes the submission and again in the reserve.

The check loads the folder with the verifier's own calls (`Qwen2VLForConditionalGeneration.from_pretrained` and
`AutoProcessor.from_pretrained`, offline, in a fresh interpreter) and, given the answers recorded when the model was
scored, generates on those ood_val rows with the protocol (`evaluator.evaluate` on exactly those rows) and compares
the extracted answers. bfloat16 batching can flip a rare near-tie, so a few rows may differ (`allowed_disagreements`);
more means the folder does not hold the model that was scored (a torn copy, a corrupted file, the wrong weights).

It runs in a subprocess on the GPUs it is given (none: the CPU): the weights are freed when it ends, a crash of the
loader cannot take the search down, and offline mode is set there as in the verifier's clean box. The subprocess
imports torch and transformers before it reads its request, so one started ahead of time (`keep_a_checker_ready`,
which the search turns on for its run) is ready when a check comes: the imports are most of a fresh interpreter's
start. It is told its GPUs with the request and hides the others before anything initializes CUDA.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Mapping, Sequence

from evaluator.protocol import GENERATION_KWARGS

CHECK_ROWS = 50  # rows of the recorded ood_val answers a check generates again
MAX_DISAGREEMENTS_PER_50 = 2  # near-ties bfloat16 batching may flip
TIMEOUT_S = 1800
PROJECT_ROOT = Path(__file__).resolve().parents[2]
CHECK_PARTS = ("start", "load", "answers", "exit")  # a check's seconds (`verify`'s outcome["seconds"]), in order

_ready_lock = threading.Lock()
_ready: subprocess.Popen | None = None  # a checker started ahead, its imports done or under way
_keep_ready = False


class VerificationError(RuntimeError):
    """The model does not load as the verifier loads it, or does not answer as it did when scored; one line."""


def expected_answers(per_row: Mapping[str, Sequence], rows: int = CHECK_ROWS) -> dict:
    """The first `rows` rows of an evaluator report's `per_row`: {"index": [...], "answer": [...]}."""
    return {"index": list(per_row["index"][:rows]), "answer": list(per_row["answer"][:rows])}


def allowed_disagreements(rows: int) -> int:
    return math.floor(rows * MAX_DISAGREEMENTS_PER_50 / 50)


def verify(
    model_dir: str | os.PathLike,
    data: str | os.PathLike | None = None,
    expected: Mapping[str, Sequence] | None = None,
    *,
    gpus: Sequence[int] = (),
    batch_size: int | None = None,
    max_new_tokens: int = GENERATION_KWARGS["max_new_tokens"],
) -> dict:
    """Check `model_dir`: it loads, and with `expected` (and the split `data` its indices refer to) it answers those
    rows as recorded. Returns {"rows", "differ", "allowed", "seconds"} (rows 0 when only loading was checked; with
    answers, also the "device" they were generated on); raises VerificationError. "seconds" has each of CHECK_PARTS:
    from the request to the loading (the imports of a checker not started ahead), the verifier's loading calls, the
    answers, the end of the process. `max_new_tokens` is the protocol's unless the answers were recorded with another
    cap (tests of a random model, which never stops on its own)."""
    request = {"model": str(model_dir), "data": str(data) if data else None, "batch_size": batch_size,
               "expected": dict(expected) if expected else None, "max_new_tokens": max_new_tokens,
               "cuda_visible_devices": ",".join(str(gpu) for gpu in gpus)}  # fmt: skip
    process = _take_ready() or _start_checker()
    sent = time.monotonic()
    try:
        stdout, stderr = process.communicate(json.dumps(request), timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        process.kill()
        process.communicate()
        stdout = None
    except BaseException:
        process.kill()
        raise
    ended = time.monotonic()
    if _keep_ready:
        _start_ready()  # the next check's, now that this one is done with the CPU and the GPU
    if stdout is None:
        raise VerificationError(f"{model_dir}: checking took over {TIMEOUT_S} s")
    if process.returncode != 0:
        lines = [line for line in stderr.splitlines() if line.strip()]
        why = lines[-1] if lines else f"failed the check: exit code {process.returncode}"
        raise VerificationError(f"{model_dir} {why}")
    outcome = json.loads(stdout.strip().splitlines()[-1])
    marks = outcome.pop("marks")
    outcome["seconds"] = {part: round(end - begin, 2) for part, begin, end in zip(
        CHECK_PARTS, [sent, *marks], [*marks, ended])}  # fmt: skip
    if outcome["differ"] > outcome["allowed"]:
        raise VerificationError(
            f"{model_dir} answers {outcome['differ']} of {outcome['rows']} ood_val rows otherwise than when it was "
            f"scored (at most {outcome['allowed']} may differ): rows {outcome['differing_rows'][:10]}"
        )
    return outcome


def keep_a_checker_ready(on: bool = True) -> None:
    """On: a checker interpreter is started now, and again after each check, so that the next check finds its
    imports done. Off: the one waiting is ended. A waiting checker holds no GPU memory (CUDA is not initialized
    before its request) and ends by itself when this process does (its request pipe closes)."""
    global _keep_ready, _ready
    with _ready_lock:
        _keep_ready = on
        if not on and _ready is not None:
            _ready.kill()
            _ready.communicate()
            _ready = None
    if on:
        _start_ready()


def _start_ready() -> None:
    global _ready
    with _ready_lock:
        if _ready is None or _ready.poll() is not None:
            _ready = _start_checker()


def _take_ready() -> subprocess.Popen | None:
    global _ready
    with _ready_lock:
        process, _ready = _ready, None
    return process if process is not None and process.poll() is None else None


def _start_checker() -> subprocess.Popen:
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        # torch.cuda.is_available() asks NVML instead of initializing CUDA, so that the GPUs the request names can
        # still be chosen after the imports.
        "PYTORCH_NVML_BASED_CUDA_CHECK": "1",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(PROJECT_ROOT), os.environ.get("PYTHONPATH")])),
    }
    return subprocess.Popen([sys.executable, "-m", "search.promotion"], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, text=True)  # fmt: skip


class _Stage(Exception):
    """A failure in the subprocess, with what failed: 'does not load: ...' or 'fails to generate: ...'."""


def _check(request: dict) -> dict:
    """The check itself, in the subprocess: the verifier's loading calls, then the recorded rows generated again.
    `marks`: when the loading began, when it ended, when the answers did (time.monotonic, which is system-wide)."""
    from transformers import AutoProcessor, Qwen2VLForConditionalGeneration

    from evaluator.protocol import build_messages

    began = time.monotonic()
    try:
        model = Qwen2VLForConditionalGeneration.from_pretrained(request["model"])
        processor = AutoProcessor.from_pretrained(request["model"])
        text = processor.apply_chat_template(build_messages(None, "How many objects?"), tokenize=False,
                                             add_generation_prompt=True)  # fmt: skip
    except Exception as error:  # noqa: BLE001 - whatever the loader raises, the model does not load
        raise _Stage(f"does not load: {_one_line(error)}") from None
    if "<|image_pad|>" not in text:
        raise _Stage(f"does not load: the chat template does not place the image: {text!r}")
    del model
    loaded = time.monotonic()
    expected = request.get("expected")
    if not expected:
        return {"rows": 0, "differ": 0, "allowed": 0, "differing_rows": [], "marks": [began, loaded, loaded]}

    import datasets
    import torch

    from evaluator.evaluation import evaluate

    datasets.disable_progress_bars()
    device = "cuda:0" if torch.cuda.is_available() else "cpu"
    try:
        # The static cache decoded eagerly: compiling would cost more than 50 rows take, and one cache length at
        # every step spares cuDNN choosing a kernel plan per step, as the dynamic cache's growing length makes it.
        report = evaluate(request["model"], request["data"], indices=expected["index"], devices=[device],
                          batch_size=request["batch_size"], num_samples=0, static_cache=True, compiled_decode=False,
                          max_new_tokens=request["max_new_tokens"])  # fmt: skip
    except Exception as error:  # noqa: BLE001 - a model that cannot answer fails its check, whatever the reason
        raise _Stage(f"fails to generate: {_one_line(error)}") from None
    answers = report["per_row"]["answer"]
    differing = [index for index, now, then in zip(expected["index"], answers, expected["answer"]) if now != then]
    rows = len(answers)
    return {"rows": rows, "differ": len(differing), "allowed": allowed_disagreements(rows), "differing_rows": differing,
            "device": device, "marks": [began, loaded, time.monotonic()]}  # fmt: skip


def _one_line(error: BaseException) -> str:
    return f"{type(error).__name__}: {' '.join(str(error).split())}"


def serve() -> int:
    """The subprocess: its imports, then the request on stdin (an empty one: the search ended without a check)."""
    import evaluator.evaluation  # noqa: F401 - torch, transformers' Qwen2-VL classes, datasets: before the request
    from transformers import Qwen2VLProcessor  # noqa: F401 - what AutoProcessor resolves to

    text = sys.stdin.read()
    if not text.strip():
        return 0
    request = json.loads(text)
    os.environ["CUDA_VISIBLE_DEVICES"] = request["cuda_visible_devices"]
    try:
        print(json.dumps(_check(request)))
    except _Stage as failure:
        print(failure, file=sys.stderr)
        return 1
    return 0

