"""The merge stage: weight soups of the kept rounds, chosen on rows they were not judged on.

`soup` builds a candidate's weights (`MergeSpec`, `build`; `python -m search.merge --spec RUN_DIR/merge.json` in a
round's process); `stage` plans the candidates and guards what is handed in (`MergeStage`, `rank`). The scheduler's
side of the stage is search.stage_runner.
"""

from search.merge.soup import SPEC_FILE, MergeSpec, build, weight_files
from search.merge.stage import ETA, GREEDY, UNIFORM, Candidate, Decision, Ingredient, MergeStage, rank

__all__ = [
    "ETA", "GREEDY", "SPEC_FILE", "UNIFORM", "Candidate", "Decision", "Ingredient", "MergeSpec", "MergeStage",
    "build", "rank", "weight_files",
]  # fmt: skip
