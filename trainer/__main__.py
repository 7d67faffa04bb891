"""`python -m trainer --config RUN_DIR/trial.json`, or `accelerate launch --num_processes N -m trainer --config ...`.

Exit codes: 0 when the round completed or was stopped (STOP file / SIGTERM; it saved what it had), 1 when it
failed (status.json says why), 2 for a bad configuration: one line on stderr, before any model is loaded (and
before torch/transformers are even imported, so the search learns it in a fraction of a second).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from common.process_exit import exit_now
from trainer.config import ConfigError, TrialConfig
from trainer.layout import batch_layout, launched_processes


def check(config: TrialConfig) -> None:
    """What can be checked without loading anything: paths exist, the batch divides over the processes."""
    if not Path(config.model_path, "config.json").is_file():
        raise ConfigError("model_path", f"{config.model_path} is not a model folder (no config.json)")
    if not Path(config.train_path).is_dir():
        raise ConfigError("train_path", f"{config.train_path} is not a folder")
    if config.eval_every > 0 and not Path(config.ood_path).is_dir():
        raise ConfigError("ood_path", f"{config.ood_path} is not a folder")
    batch_layout(config, launched_processes())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m trainer", description="Run one GRPO round.")
    parser.add_argument("--config", required=True, help="the round's TrialConfig JSON (trial.json)")
    args = parser.parse_args(argv)
    try:
        config = TrialConfig.from_json(args.config)
        check(config)
    except (ConfigError, OSError) as error:
        print(f"bad config {args.config}: {error}".replace("\n", " "), file=sys.stderr)
        return 2

    from trainer.round import run_round  # heavy imports (torch, transformers, trl) only for a valid config

    result = run_round(config)
    return 0 if result.state.saved else 1


if __name__ == "__main__":
    exit_now(main())
