"""Row-by-row comparison of scored rounds: which leads are beyond the noise of a finite ood_val.

Every round is scored on the same ood_val rows, so two rounds compare pair-wise: per row the difference of their
correctness is -1, 0 or +1, and the mean of those differences is the lead in accuracy. Its 95% interval is the
normal approximation on the paired differences, mean +- 1.96 x sd / sqrt(n): far narrower than two independent
intervals, since rows both rounds get right (or wrong) cancel out. On 1,000 rows a lead of about 2-3 points between
similar models is typically within the noise.

A round's correctness is kept in its trial (the user attribute `OOD_ROWS`), so that the leaderboard of a study shared
by several boxes needs no other box's files: `{"n", "digest", "correct"}`, the rows' right/wrong as hex-packed bits
and a short digest of which rows they were (indices and gold counts); only rounds with equal digests are compared.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from typing import Mapping, Sequence

OOD_ROWS = "ood_rows"  # the user attribute of a scored round (see the module docstring)
Z_95 = 1.959964  # two-sided 95% quantile of the normal distribution
_HEX_DIGITS = frozenset("0123456789abcdefABCDEF")


@dataclass(frozen=True)
class Lead:
    """A paired lead in accuracy points, with its 95% interval."""

    points: float
    low: float
    high: float
    n: int

    @property
    def beyond_noise(self) -> bool:
        """The interval excludes 0: the lead is not explained by which rows happened to be in ood_val."""
        return self.low > 0 or self.high < 0

    def __str__(self) -> str:
        return f"{self.points:+.1f} [{self.low:+.1f}, {self.high:+.1f}]"


def rows_attr(per_row: Mapping[str, Sequence]) -> dict:
    """The `OOD_ROWS` attribute of a round from its OOD report's `per_row`."""
    correct = correctness(per_row)
    return {"n": len(correct), "digest": rows_digest(per_row), "correct": pack(correct)}


def read_rows_attr(attrs: Mapping) -> tuple[str, list[bool]] | None:
    """(digest, per-row correctness) of a trial's user attributes, or None when it has none (or a malformed one)."""
    packed = _read_packed(attrs)
    return None if packed is None else (packed[0], unpack(attrs[OOD_ROWS]["correct"], packed[1]))


def lead_between(attrs: Mapping, other: Mapping) -> Lead | None:
    """The paired lead of one scored round over another from their trials' user attributes; None unless both hold
    per-row scores of the same rows. Counted on the packed bits (a leaderboard of hundreds of rounds computes two
    leads per round, after every round)."""
    mine, theirs = _read_packed(attrs), _read_packed(other)
    if mine is None or theirs is None or mine[:2] != theirs[:2] or mine[1] == 0:
        return None
    a, b = mine[2], theirs[2]
    return _lead_from_counts((a & ~b).bit_count(), (b & ~a).bit_count(), mine[1])


def _read_packed(attrs: Mapping) -> tuple[str, int, int] | None:
    """(digest, row count, the rows as the bits of one integer, first row highest) of a trial's `OOD_ROWS`, or None
    when it has none or one `pack` did not write (a hex digit count other than the rows need, a non-hex digit)."""
    value = attrs.get(OOD_ROWS)
    try:
        digest, n, correct = str(value["digest"]), int(value["n"]), value["correct"]
    except (TypeError, KeyError, ValueError):
        return None
    if not isinstance(correct, str) or n < 0 or len(correct) != -(-n // 4) or not set(correct) <= _HEX_DIGITS:
        return None
    return digest, n, int(correct or "0", 16) >> (len(correct) * 4 - n)


def correctness(per_row: Mapping[str, Sequence]) -> list[bool]:
    """Per row, whether the extracted answer equals the gold count (an evaluator report's `per_row`)."""
    answers, golds = per_row["answer"], per_row["gold"]
    return [answer is not None and answer == gold for answer, gold in zip(answers, golds, strict=True)]


def rows_digest(per_row: Mapping[str, Sequence]) -> str:
    """Which rows were scored: equal for two reports of the same rows of the same split."""
    identity = json.dumps([list(per_row["index"]), list(per_row["gold"])], separators=(",", ":"))
    return hashlib.sha256(identity.encode()).hexdigest()[:16]


def pack(correct: Sequence[bool]) -> str:
    """Per-row correctness as hex (4 rows a digit); `unpack` needs the row count back."""
    if not correct:
        return ""
    bits = "".join("1" if c else "0" for c in correct)
    bits += "0" * (-len(bits) % 4)
    return f"{int(bits, 2):0{len(bits) // 4}x}"


def unpack(packed: str, n: int) -> list[bool]:
    if not packed:
        return []
    bits = bin(int(packed, 16))[2:].zfill(4 * len(packed))
    return [bit == "1" for bit in bits[:n]]


def paired_lead(a: Sequence[bool], b: Sequence[bool]) -> Lead:
    """How far `a` leads `b` on the same rows, in accuracy points, with its paired 95% interval."""
    if len(a) != len(b) or not a:
        raise ValueError(f"need the same rows on both sides, got {len(a)} and {len(b)}")
    wins = sum(1 for x, y in zip(a, b) if x and not y)
    losses = sum(1 for x, y in zip(a, b) if y and not x)
    return _lead_from_counts(wins, losses, len(a))


def _lead_from_counts(wins: int, losses: int, n: int) -> Lead:
    """The paired lead from the rows only `a` got right (`wins`) and only `b` got right (`losses`), of `n`: each
    paired difference is +1, -1 or 0, so its mean and sample variance follow from the two counts."""
    mean = (wins - losses) / n
    variance = (wins + losses - n * mean * mean) / (n - 1) if n > 1 else 0.0
    half = Z_95 * math.sqrt(variance / n)
    return Lead(100.0 * mean, 100.0 * (mean - half), 100.0 * (mean + half), n)
