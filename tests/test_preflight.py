"""`python run_search.py check`: the preflight of a box, run for real on the CPU (the demo's budget, a small model)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import faultkit
from search import preflight
from search.settings import load_settings

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def demo_box(tmp_path_factory) -> Path:
    """The demo budget's box, small: the demo's image size and counts, a few rows a split."""
    from synthetic.splits import write_box
    from synthetic.teach import DEMO_RECIPE

    root = tmp_path_factory.mktemp("box")
    write_box(root / "data", {"train": 16, "val": 4, "ood_val": 20, "test_compositional": 1, "test_other": 1}, 3,
              DEMO_RECIPE.image_size, DEMO_RECIPE.count_range)  # fmt: skip
    return root


def budget(folder: Path, model: Path, box: Path, **changes) -> Path:
    data = box / "data"
    values = dict(
        model_path=str(model), train_path=str(data / "train"), val_path=str(data / "val"),
        ood_val_path=str(data / "ood_val"), gpus=0, submission_path=str(folder / "submission"),
        runs_dir=str(folder / "runs"), storage=str(folder / "study.db"),
    )  # fmt: skip
    return faultkit.write_budget(folder, **{**values, **changes})


def check(folder: Path, budget_path: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "run_search.py"), "check", "--budget", str(budget_path)],
                          cwd=folder, capture_output=True, text=True, timeout=900)  # fmt: skip


def test_check_on_the_demo_budget_runs_a_real_round_scores_it_and_exits_0(tmp_path, tiny_model_dir, demo_box):
    result = check(tmp_path, budget(tmp_path, tiny_model_dir, demo_box))
    assert result.returncode == 0, result.stdout + result.stderr
    table = result.stdout
    for row in ("box", "cpu: fit", "cpu: round", "cpu: evaluation", "disk", "budget"):
        assert f"\n{row} " in f"\n{table}", table
    assert "FAILED" not in table and "2 steps" in table and f"{preflight.CHECK_OOD_ROWS} ood_val rows" in table
    assert "about " in table and "rounds of the heaviest configuration" in table
    assert not (tmp_path / "runs" / "demo" / preflight.PREFLIGHT_DIR).exists()  # its round folders are gone
    assert not (tmp_path / "study.db").exists() and not (tmp_path / "submission").exists()  # nothing else written


def test_check_names_a_missing_model_folder_in_one_line_with_exit_2(tmp_path, demo_box):
    result = check(tmp_path, budget(tmp_path, tmp_path / "no-model", demo_box))
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "model_path" in lines[0] and "no-model does not exist" in lines[0], result.stderr
    assert not (tmp_path / "runs").exists()


def test_a_failing_round_fails_the_check_with_its_reason_and_exit_1(tmp_path, tiny_model_dir, demo_box):
    """A train split of fewer rows than one generation needs (8 prompts a step): the round fails at set-up."""
    (tmp_path / "short").mkdir()
    from synthetic.splits import write_split

    short = write_split(tmp_path / "short" / "train", "train", 3, 0, (112, 112), (1, 6))
    path = budget(tmp_path, tiny_model_dir, demo_box, train_path=str(short))
    result = check(tmp_path, path)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "cpu: round" in result.stdout and "FAILED" in result.stdout
    assert result.stderr.strip().splitlines()[-1].startswith("check failed: cpu: round: failed after 0 step(s)")


def test_disk_counts_every_model_the_search_keeps(tmp_path, tiny_model_dir, demo_box):
    settings = load_settings(budget(tmp_path, tiny_model_dir, demo_box, keep_rounds=2))
    size = preflight.model_bytes(settings.model_path)
    needed, how = preflight.disk_needed(settings)
    merge = settings.merge.top_k + 1 if settings.merge.enabled else 0
    assert needed == (1 + 3 + len(settings.slots) + merge) * size > 0
    assert "3 (keep_rounds and the best)" in how


def test_the_heaviest_candidate_of_the_space_is_chosen(tmp_path, tiny_model_dir, demo_box):
    """On the CPU nothing is checked against a card: the heaviest footprint, full fine-tuning of the largest group
    with the KL reference."""
    from search.backends.fit import FitCheck
    from search.backends.local import model_config

    settings = load_settings(budget(tmp_path, tiny_model_dir, demo_box))
    no_card = FitCheck(lambda: model_config(settings.model_path), lambda gpus: None)
    config = preflight.heaviest_admitted(settings, no_card)
    space = settings.space
    assert config.lora_rank == 0 and config.num_generations == max(space["num_generations"])
    assert config.beta > 0
    corners = len(space["lora_rank"]) * len(space["num_generations"]) * len(space["max_pixels"]) * 2
    assert len(preflight.candidates(settings)) == corners
