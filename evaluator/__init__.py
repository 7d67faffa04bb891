"""Scores a Qwen2-VL model on a counting split exactly as the verifier does (the protocol lives in `protocol`).

The public names load on first use, so that `import evaluator.protocol` (rewards, the trainer) stays light and
does not pull in torch, transformers and datasets.
"""

from __future__ import annotations

import importlib
from typing import Any

_PUBLIC = {
    "DataError": "evaluator.data",
    "load_split": "evaluator.data",
    "ModelError": "evaluator.evaluation",
    "evaluate": "evaluator.evaluation",
    "evaluate_splits": "evaluator.evaluation",
    "Split": "evaluator.evaluation",
}
__all__ = sorted(_PUBLIC)


def __getattr__(name: str) -> Any:
    if name not in _PUBLIC:
        raise AttributeError(f"module 'evaluator' has no attribute {name!r}")
    return getattr(importlib.import_module(_PUBLIC[name]), name)
