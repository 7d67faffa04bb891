"""A promoted model is checked as the verifier will use it: loaded with the verifier's calls in a fresh interpreter,
and answering the ood_val rows it was scored on as it did then. The final check in the reserve restores the previous
submission when the current one fails either way. Real models (the tiny random Qwen2-VL), real subprocesses, CPU."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from evaluator.evaluation import evaluate
from faultkit import alive
from search.promotion import verification
from search.promotion.submission import MARKER, check_submission, final_check, promote, promoted
from search.promotion.verification import CHECK_PARTS, VerificationError, allowed_disagreements, expected_answers, verify


# The random tiny model never stops on its own: its answers are recorded and checked with a short cap (the search
# records and checks them with the protocol's 256 tokens), which keeps each check's subprocess to seconds.
TOKENS = 16


@pytest.fixture(scope="module")
def recorded(tiny_model_dir, tiny_split_dir) -> dict:
    """The answers the tiny model gave when the evaluator scored it (as a round's ood_eval.json keeps them)."""
    report = evaluate(tiny_model_dir, tiny_split_dir, devices=["cpu"], batch_size=4, max_new_tokens=TOKENS)
    assert report["per_row"]["index"] == list(range(8))  # every row of the split, in its order
    return expected_answers(report["per_row"])


def check(path, **kwargs):
    """The final check's check, with the answers' cap."""
    return check_submission(path, **kwargs, max_new_tokens=TOKENS)


def test_the_tolerance_is_two_rows_in_fifty():
    assert [allowed_disagreements(n) for n in (8, 24, 25, 50, 100)] == [0, 0, 1, 2, 4]


def test_a_model_passes_when_it_answers_as_recorded_and_fails_otherwise(tiny_model_dir, tiny_split_dir, recorded):
    began = time.monotonic()
    outcome = verify(tiny_model_dir, tiny_split_dir, recorded, max_new_tokens=TOKENS)
    wall = time.monotonic() - began
    assert outcome["rows"] == 8 and outcome["differ"] == 0 and outcome["device"] == "cpu"
    # Where the check's seconds went: each part once, in order, and together no more than the call took.
    parts = outcome["seconds"]
    assert list(parts) == list(CHECK_PARTS) and min(parts.values()) >= 0
    assert parts["load"] > 0 and parts["answers"] > 0 and sum(parts.values()) <= wall + 0.05
    # What the check sees when the folder holds other weights than those that were scored: other answers.
    other = {"index": recorded["index"], "answer": list(recorded["answer"])}
    for row in (1, 4, 6):
        other["answer"][row] = 7 if other["answer"][row] != 7 else 8
    with pytest.raises(VerificationError, match=r"answers 3 of 8 ood_val rows otherwise than when it was scored "
                                                r"\(at most 0 may differ\): rows \[1, 4, 6\]"):  # fmt: skip
        verify(tiny_model_dir, tiny_split_dir, other, max_new_tokens=TOKENS)


def test_a_corrupted_weights_file_does_not_load(tiny_model_dir, tmp_path):
    broken = shutil.copytree(tiny_model_dir, tmp_path / "broken")
    weights = next(broken.glob("*.safetensors"))
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])  # a torn copy
    with pytest.raises(VerificationError, match=r"broken does not load: "):
        verify(broken)  # without recorded answers: the load check alone


@pytest.mark.parametrize("corruption", ["weights", "answers"])
def test_the_final_check_restores_the_previous_submission(tiny_model_dir, tiny_split_dir, recorded, tmp_path,
                                                          corruption):  # fmt: skip
    submission = tmp_path / "submission"
    for trial, accuracy in ((1, 40.0), (2, 55.0)):
        assert promote(tiny_model_dir, submission, min_format_rate=0, format_rate=0.0, accuracy=accuracy, trial=trial,
                       details={"check_rows": recorded}, check=lambda path: None)  # fmt: skip
    assert promoted(submission)["trial"] == 2
    if corruption == "weights":  # the disk tore the submission's weights after the swap
        weights = next(submission.glob("*.safetensors"))
        weights.chmod(0o644)
        weights.write_bytes(b"\0" * 64)
    else:  # the submission holds other weights than the scored ones: its recorded answers no longer match
        marker = json.loads((submission / MARKER).read_text())
        marker["check_rows"]["answer"] = [3] * len(marker["check_rows"]["answer"])
        (submission / MARKER).write_text(json.dumps(marker))
    result = final_check(submission, str(tiny_split_dir), check=check)
    assert not result.passed and result.restored and result.trial == 1
    assert result.line.startswith("FINAL CHECK FAILED: the submission (trial 2) ")
    assert ("does not load" if corruption == "weights" else "otherwise than when it was scored") in result.line
    assert promoted(submission)["trial"] == 1
    again = final_check(submission, str(tiny_split_dir), check=check)  # what was restored is whole
    assert again.passed and again.line == "final check passed: the submission (trial 1) loads and answers 8 " \
                                          "recorded ood_val rows as when scored"
    assert not (tmp_path / ".submission.previous").exists()


def test_the_check_runs_offline_on_the_gpus_it_is_given(monkeypatch, tiny_model_dir):
    seen = {}

    class Checker:  # a checker that never answers
        returncode = None

        def __init__(self, command, **kwargs):
            seen.update(kwargs["env"])

        def poll(self):
            return self.returncode

        def communicate(self, request=None, timeout=None):
            if request is None:  # after the kill
                return "", ""
            seen["request"] = json.loads(request)
            raise subprocess.TimeoutExpired("checker", timeout)

        def kill(self):
            self.returncode = -9

    monkeypatch.setattr(verification.subprocess, "Popen", Checker)
    with pytest.raises(VerificationError, match="checking took over"):
        verify(tiny_model_dir, gpus=[1, 3])
    assert seen["request"]["cuda_visible_devices"] == "1,3" and seen["HF_HUB_OFFLINE"] == "1"
    assert seen["PYTORCH_NVML_BASED_CUDA_CHECK"] == "1"  # so that the imports before the request leave CUDA alone
    assert str(Path(verification.__file__).resolve().parents[2]) in seen["PYTHONPATH"]  # the project's root


def test_a_checker_started_ahead_serves_the_next_check_and_another_takes_its_place(tiny_model_dir, tiny_split_dir,
                                                                                    recorded):  # fmt: skip
    verification.keep_a_checker_ready()
    try:
        ahead = verification._ready
        assert ahead is not None and ahead.poll() is None
        outcome = verify(tiny_model_dir, tiny_split_dir, recorded, max_new_tokens=TOKENS)
        assert outcome["differ"] == 0 and ahead.returncode == 0  # it served this check, and ended
        successor = verification._ready
        assert successor is not None and successor is not ahead and successor.poll() is None
    finally:
        verification.keep_a_checker_ready(False)
    assert successor.returncode is not None and verification._ready is None


def test_a_waiting_checker_ends_with_the_search_that_started_it(tmp_path):
    script = ("from search.promotion import verification\n"
              "verification.keep_a_checker_ready()\n"
              "print(verification._ready.pid, flush=True)\n"
              "import os; os._exit(0)  # the search killed: no teardown of its own\n")  # fmt: skip
    done = subprocess.run([sys.executable, "-c", script], cwd=Path(verification.__file__).resolve().parents[2],
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert done.returncode == 0, done.stderr
    pid = int(done.stdout.strip())
    until = time.monotonic() + 300  # it ends once its imports are done and it reads the closed request pipe
    while alive(pid):
        assert time.monotonic() < until, f"the checker {pid} outlived its search"
        time.sleep(0.5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_a_checker_started_ahead_runs_on_the_gpus_its_request_names(tiny_model_dir, tiny_split_dir, recorded):
    """The GPUs are chosen after the checker's imports: those must not have initialized CUDA."""
    on_gpu = evaluate(tiny_model_dir, tiny_split_dir, devices=["cuda:0"], max_new_tokens=TOKENS, static_cache=True,
                      compiled_decode=False)  # as the check generates: one batch of the 8 rows  # fmt: skip
    verification.keep_a_checker_ready()
    try:
        hidden = verify(tiny_model_dir, tiny_split_dir, recorded, gpus=[], max_new_tokens=TOKENS)
        shown = verify(tiny_model_dir, tiny_split_dir, expected_answers(on_gpu["per_row"]), gpus=[0],
                       max_new_tokens=TOKENS)  # fmt: skip
    finally:
        verification.keep_a_checker_ready(False)
    assert (hidden["device"], hidden["differ"]) == ("cpu", 0)
    assert (shown["device"], shown["differ"]) == ("cuda:0", 0)

