"""A model checked as the verifier will use it, before it becomes the submission and again in the reserve.

The check loads the folder with the verifier's own calls (`Qwen2VLForConditionalGeneration.from_pretrained` and
`AutoProcessor.from_pretrained`, offline, in a fresh interpreter) and, given the answers recorded when the model was
scored, generates on those ood_val rows with the protocol (`evaluator.evaluate` on exactly those rows) and compares
the extracted answers. bfloat16 batching can flip a rare near-tie, so a few rows may differ (`allowed_disagreements`);
more means the folder does not hold the model that was scored (a torn copy, a corrupted file, the wrong weights).

It runs in a subprocess on the GPUs it is given (none: the CPU): the weights are freed when it ends, a crash of the
loader cannot take the search down, and offline mode is set there as in the verifier's clean box.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Mapping, Sequence

from evaluator.protocol import GENERATION_KWARGS

CHECK_ROWS = 50  # rows of the recorded ood_val answers a check generates again
MAX_DISAGREEMENTS_PER_50 = 2  # near-ties bfloat16 batching may flip
TIMEOUT_S = 1800
PROJECT_ROOT = Path(__file__).resolve().parents[1]


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
    rows as recorded. Returns {"rows", "differ", "allowed"} (rows 0 when only loading was checked); raises
    VerificationError. `max_new_tokens` is the protocol's unless the answers were recorded with another cap (tests
    of a random model, which never stops on its own)."""
    request = {"model": str(model_dir), "data": str(data) if data else None, "batch_size": batch_size,
               "expected": dict(expected) if expected else None, "max_new_tokens": max_new_tokens}  # fmt: skip
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "CUDA_VISIBLE_DEVICES": ",".join(str(gpu) for gpu in gpus),
        "PYTHONPATH": os.pathsep.join(filter(None, [str(PROJECT_ROOT), os.environ.get("PYTHONPATH")])),
    }
    try:
        result = subprocess.run([sys.executable, "-m", "search.verification"], input=json.dumps(request), env=env,
                                capture_output=True, text=True, timeout=TIMEOUT_S)  # fmt: skip
    except subprocess.TimeoutExpired:
        raise VerificationError(f"{model_dir}: checking took over {TIMEOUT_S} s") from None
    if result.returncode != 0:
        lines = [line for line in result.stderr.splitlines() if line.strip()]
        raise VerificationError(f"{model_dir} {lines[-1] if lines else f'failed the check: exit code {result.returncode}'}")
    outcome = json.loads(result.stdout.strip().splitlines()[-1])
    if outcome["differ"] > outcome["allowed"]:
        raise VerificationError(
            f"{model_dir} answers {outcome['differ']} of {outcome['rows']} ood_val rows otherwise than when it was "
            f"scored (at most {outcome['allowed']} may differ): rows {outcome['differing_rows'][:10]}"
        )
    return outcome


class _Stage(Exception):
    """A failure in the subprocess, with what failed: 'does not load: ...' or 'fails to generate: ...'."""


def _check(request: dict) -> dict:
    """The check itself, in the subprocess: the verifier's loading calls, then the recorded rows generated again."""
    from transformers import AutoProcessor, Qwen2VLForConditionalGeneration

    from evaluator.protocol import build_messages

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
    expected = request.get("expected")
    if not expected:
        return {"rows": 0, "differ": 0, "allowed": 0, "differing_rows": []}

    import datasets
    import torch

    from evaluator.evaluation import evaluate

    datasets.disable_progress_bars()
    device = "cuda:0" if torch.cuda.is_available() else "cpu"
    try:
        report = evaluate(request["model"], request["data"], indices=expected["index"], devices=[device],
                          batch_size=request["batch_size"], num_samples=0, static_cache=False,
                          max_new_tokens=request["max_new_tokens"])  # fmt: skip
    except Exception as error:  # noqa: BLE001 - a model that cannot answer fails its check, whatever the reason
        raise _Stage(f"fails to generate: {_one_line(error)}") from None
    answers = report["per_row"]["answer"]
    differing = [index for index, now, then in zip(expected["index"], answers, expected["answer"]) if now != then]
    rows = len(answers)
    return {"rows": rows, "differ": len(differing), "allowed": allowed_disagreements(rows), "differing_rows": differing}


def _one_line(error: BaseException) -> str:
    return f"{type(error).__name__}: {' '.join(str(error).split())}"


if __name__ == "__main__":
    try:
        print(json.dumps(_check(json.loads(sys.stdin.read()))))
    except _Stage as failure:
        print(failure, file=sys.stderr)
        sys.exit(1)
