"""Confidence intervals for accuracies, and for the difference of two decoders' accuracies; the ratio of two
decoders' times measured side by side (:func:`paired_time_ratio`).

Why Wilson and not the normal approximation: the bench often runs a few dozen items per cell,
and accuracies near 0 % or 100 % (tiny suites); the Wald interval ``p ± z·sqrt(p(1-p)/n)``
collapses to zero width there and can leave [0, 1]. Wilson's interval stays inside [0, 1] and
keeps close to its nominal coverage for small ``n``, so "BlockBatch is within the noise of
Fast-dLLM" is a claim we can actually make or refute.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from numbers import Integral, Real

from hf_blockbatch.checks import check_positive_real

__all__ = ["paired_difference", "paired_difference_interval", "paired_time_ratio", "wilson_interval"]


def _check_count(name: str, value: object) -> None:
    """Counts of items are whole numbers (a NumPy integer too): ``n = inf`` gave the interval (0, 0) and a
    fractional ``k`` an interval of no count of items; a bool is refused, as the configs refuse it for a size."""
    if isinstance(value, bool) or not isinstance(value, Integral):
        raise TypeError(f"{name} must be a whole number of items, got {value!r} ({type(value).__name__}).")


def wilson_interval(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """Wilson score interval for ``k`` successes in ``n`` trials (``z=1.96``: 95 %).

    Returns ``(0.0, 1.0)`` for ``n == 0`` (no information), fractions in [0, 1] otherwise. ``z`` must be a finite
    number > 0: a negative one swapped the bounds, and NaN returned (0, 1) as if nothing were known.
    """
    _check_count("k", k)
    _check_count("n", n)
    check_positive_real("z", z)
    if n < 0 or k < 0 or k > n:
        raise ValueError(f"need 0 <= k <= n, got k={k}, n={n}")
    if n == 0:
        return 0.0, 1.0
    p = k / n
    z2 = z * z
    denom = 1.0 + z2 / n
    centre = (p + z2 / (2 * n)) / denom
    half = (z / denom) * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n))
    lo, hi = max(0.0, centre - half), min(1.0, centre + half)
    # exact endpoints at the boundaries (floating error would otherwise give 1e-17 / 0.9999…)
    if k == 0:
        lo = 0.0
    if k == n:
        hi = 1.0
    return lo, hi


def paired_difference_interval(both: int, only_a: int, only_b: int, neither: int,
                               z: float = 1.96) -> tuple[float, float]:  # fmt: skip
    """95 % interval (``z=1.96``) of ``acc(a) - acc(b)`` when a and b were scored on the *same*
    items: Newcombe's hybrid score interval for paired proportions (Newcombe 1998, method 10),
    from the 2x2 counts of items both got right, only a, only b, and neither.

    Why paired: two decoders of one model get most items right or wrong together, so the
    difference of their accuracies is far less noisy than two independent accuracies suggest.
    The paired interval is what says whether "1.4 points below the tuned baseline" is a
    difference or the noise of a 500-item test set. Built from the two Wilson intervals and
    the correlation of the outcomes (phi), it stays inside [-1, 1] and keeps its coverage near
    0 % or 100 % accuracy, where the Wald interval of the mean difference does not.
    Returns ``(-1.0, 1.0)`` for no items.
    """
    counts = (both, only_a, only_b, neither)
    for name, count in zip(("both", "only_a", "only_b", "neither"), counts):
        _check_count(name, count)
    check_positive_real("z", z)
    if min(counts) < 0:
        raise ValueError(f"paired counts must be >= 0, got {counts}")
    n = sum(counts)
    if n == 0:
        return -1.0, 1.0
    a_right, b_right = both + only_a, both + only_b
    p1, p2 = a_right / n, b_right / n
    l1, u1 = wilson_interval(a_right, n, z)
    l2, u2 = wilson_interval(b_right, n, z)
    denom = (both + only_a) * (only_b + neither) * (both + only_b) * (only_a + neither)
    phi = (both * neither - only_a * only_b) / math.sqrt(denom) if denom > 0 else 0.0
    d = p1 - p2
    lower = math.sqrt(max(0.0, (p1 - l1) ** 2 - 2 * phi * (p1 - l1) * (u2 - p2) + (u2 - p2) ** 2))
    upper = math.sqrt(max(0.0, (u1 - p1) ** 2 - 2 * phi * (u1 - p1) * (p2 - l2) + (p2 - l2) ** 2))
    return max(-1.0, d - lower), min(1.0, d + upper)


def _is_outcome(value: object) -> bool:
    """Whether ``value`` is a right/wrong outcome: a bool or a number equal to 0 or 1 (numpy and 0-d torch
    booleans included). A string such as ``"False"`` is not: ``bool("False")`` is true, so reading it as one
    would count a wrong item as right."""
    if isinstance(value, (str, bytes)) or value is None:
        return False
    try:
        return bool(value == 0) or bool(value == 1)
    except (TypeError, ValueError, RuntimeError):
        return False


def paired_difference(a: dict, b: dict, z: float = 1.96) -> dict[str, float | int] | None:
    """``acc(a) - acc(b)`` over the items both were scored on, with its paired interval.

    ``a`` and ``b`` map an item's key to whether it was answered right. Returns the number of
    shared items, the difference and its interval (fractions), and the 2x2 counts; ``None``
    when no item is shared. Two lists are refused rather than read by position: the items are paired by key,
    so that two runs over different subsets are compared on the items they share."""
    for name, side in (("a", a), ("b", b)):
        if not isinstance(side, Mapping):
            raise TypeError(f"paired_difference: {name} must map each item's key to whether it was answered right "
                            f"(e.g. {{r['index']: r['correct'] for r in rows}}), got {type(side).__name__}.")  # fmt: skip
    keys = a.keys() & b.keys()
    if not keys:
        return None
    for name, side in (("a", a), ("b", b)):
        bad = [(k, side[k]) for k in keys if not _is_outcome(side[k])]
        if bad:
            raise ValueError(f"paired_difference: {name}'s values must say whether each item was answered right "
                             f"(True/False or 1/0), got {bad[0][1]!r} for item {bad[0][0]!r}.")  # fmt: skip
    both = sum(bool(a[k]) and bool(b[k]) for k in keys)
    only_a = sum(bool(a[k]) and not b[k] for k in keys)
    only_b = sum(not a[k] and bool(b[k]) for k in keys)
    neither = len(keys) - both - only_a - only_b
    lo, hi = paired_difference_interval(both, only_a, only_b, neither, z)
    return {"n": len(keys), "difference": (only_a - only_b) / len(keys), "ci95": (lo, hi),
            "both": both, "only_a": only_a, "only_b": only_b, "neither": neither}  # fmt: skip


def paired_time_ratio(a: list[float], b: list[float]) -> float:
    """Decoder ``a``'s time over decoder ``b``'s, from rounds that timed both side by side (round ``i`` of each in the
    same stretch of the machine, batch by batch when interleaved): the ratio of their total times.

    Why not the ratio of the two medians: the medians may come from different rounds, so that ratio can set one
    decoder's fast round against the other's slow one. Where the machine drifts between rounds it reads an unpaired
    extreme: on a sitting of RESULTS §51 it gave 1.082 where the rounds' own ratios were 1.037, 1.082 and 1.057
    (RESULTS §52). The total keeps every round's pair together and weighs each round by its length, as a time per
    item over all of them does. A time that is not a finite number >= 0 (a NaN of a failed round) is refused: it
    would make the ratio NaN, or a negative one."""
    if len(a) != len(b) or not a:
        raise ValueError(f"paired rounds needed: {len(a)} against {len(b)} rounds.")
    for name, rounds in (("a", a), ("b", b)):
        bad = [t for t in rounds if isinstance(t, bool) or not isinstance(t, Real) or not math.isfinite(t) or t < 0]
        if bad:
            raise ValueError(f"paired_time_ratio: {name}'s round times must be finite numbers >= 0 (seconds), got {bad[:3]}.")
    if min(b) <= 0:
        raise ValueError("the baseline's rounds must have taken some time.")
    return sum(a) / sum(b)
