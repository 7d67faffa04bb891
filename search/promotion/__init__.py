"""Handing a model in: the checked promotion into the submission folder, the answers check, the promoter.

`submission`: the promotion itself (whole or not at all, checked, the previous kept aside), its lock, the final
check, pruning old rounds' weights. `verification`: a model loaded with the verifier's calls in a fresh process and
its recorded answers generated again (`python -m search.promotion` is that process). `promoter`: what the scheduler
calls (`SubmissionPromoter`, `RecordingPromoter`).
"""

from search.promotion.promoter import Promoter, RecordingPromoter, SubmissionPromoter, promote_recorded
from search.promotion.submission import (
    MARKER, FinalCheck, PromotionError, check_submission, delete_weights, final_check, link_tree, lock_path, promote,
    promoted, prune_run_dirs, recover_submission, restore_previous,
)  # fmt: skip
from search.promotion.verification import (
    CHECK_PARTS, CHECK_ROWS, VerificationError, allowed_disagreements, expected_answers, keep_a_checker_ready, verify,
)  # fmt: skip

__all__ = [
    "CHECK_PARTS", "CHECK_ROWS", "MARKER", "FinalCheck", "Promoter", "PromotionError", "RecordingPromoter",
    "SubmissionPromoter", "VerificationError", "allowed_disagreements", "check_submission", "delete_weights",
    "expected_answers", "final_check", "keep_a_checker_ready", "link_tree", "lock_path", "promote", "promoted",
    "promote_recorded", "prune_run_dirs", "recover_submission", "restore_previous", "verify",
]  # fmt: skip
