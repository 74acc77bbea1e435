"""Confidence intervals for accuracies.

Why Wilson and not the normal approximation: the bench often runs a few dozen items per cell,
and accuracies near 0 % or 100 % (tiny suites); the Wald interval ``p ± z·sqrt(p(1-p)/n)``
collapses to zero width there and can leave [0, 1]. Wilson's interval stays inside [0, 1] and
keeps close to its nominal coverage for small ``n``, so "BlockBatch is within the noise of
Fast-dLLM" is a claim we can actually make or refute.
"""

from __future__ import annotations

import math

__all__ = ["wilson_interval"]


def wilson_interval(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """Wilson score interval for ``k`` successes in ``n`` trials (``z=1.96``: 95 %).

    Returns ``(0.0, 1.0)`` for ``n == 0`` (no information), fractions in [0, 1] otherwise.
    """
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
