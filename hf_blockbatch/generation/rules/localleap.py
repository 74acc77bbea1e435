"""LocalLeap: commit confident anchors, and relax the threshold in a bounded neighbourhood of each.

Kong et al. 2025, "Accelerating Diffusion LLM Inference via Local Determinism Propagation"
(arXiv 2510.07081). The paper observes that a masked position whose neighbour is predicted with
high confidence is itself usually already determined even at moderate confidence ("local
determinism propagation"), and that this holds less the further away it is ("spatial consistency
decay"). The rule, per step and per row:

* **anchors**: candidates (masked positions inside the row's current block) with confidence
  ≥ ``anchor_threshold``; they are committed, exactly as Fast-dLLM's threshold rule does;
* **neighbourhood**: every position at distance ≤ ``radius`` from an anchor, counted in canvas
  positions (already-decoded slots in between count, they do not stop the neighbourhood and the
  neighbourhood need not be contiguous in candidates);
* candidates in the neighbourhood are committed at ``relaxed_threshold`` instead;
* the single most confident candidate is always committed, so a step never commits nothing.

What the authors' released generation code does (``get_transfer_index`` in their LLaDA
``generate.py``, read in public copies, not copied) and this module follows:

* anchors are *this step's* confident candidates only. Tokens decoded in earlier steps are not
  anchors, and a
  token committed at the relaxed threshold does not become an anchor in the same step: there is
  **no chaining**, the neighbourhood is one dilation of the anchor set;
* the guaranteed best candidate is not an anchor unless it reaches ``anchor_threshold``;
* thresholds are inclusive (``≥``), as in the threshold rule.

Equivalently: ``threshold_select(scores, anchor) | (near_anchor & scores ≥ relaxed)``, which is
how it is computed here (one max-pool for the dilation, no loop over rows or positions, no
host sync).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from numbers import Real
from typing import TYPE_CHECKING, ClassVar

import torch

from hf_blockbatch.generation.rules import register
from hf_blockbatch.generation.rules.threshold import threshold_select

if TYPE_CHECKING:
    from hf_blockbatch.generation.configs import BlockBatchConfig, FastDLLMConfig
    from hf_blockbatch.generation.forward import Span
    from hf_blockbatch.generation.state import DecodeState

__all__ = [
    "ANCHOR_THRESHOLD",
    "RADIUS",
    "RELAXED_THRESHOLD",
    "LocalLeapRule",
    "localleap_select",
]

# The paper's defaults (Kong et al. 2025, arXiv 2510.07081, the LocalLeap method and its
# experimental setup; the same three values are the defaults of the authors' released generation
# and evaluation code, github.com/friedrichor/LocalLeap). Its empirical analysis of local
# determinism conditions on a centre token with confidence ≥ 0.9, which is the anchor threshold.

#: Confidence at which a candidate becomes an anchor (and is committed). Equal to Fast-dLLM's
#: default threshold, so at the defaults LocalLeap commits a superset of what Fast-dLLM commits.
ANCHOR_THRESHOLD = 0.9
#: Confidence at which a candidate within ``RADIUS`` positions of an anchor is committed.
RELAXED_THRESHOLD = 0.75
#: Neighbourhood half-width in canvas positions: the positions p with |p − anchor| ≤ RADIUS.
RADIUS = 4


def localleap_select(
    scores: torch.Tensor,
    *,
    anchor_threshold: float,
    relaxed_threshold: float,
    radius: int,
) -> torch.Tensor:
    """The slots to commit, ``[A, W]`` bool, under LocalLeap.

    Each row is a span of ``W`` consecutive canvas positions (slot ``w + 1`` is the position after
    slot ``w``). ``scores`` ``[A, W]`` is the confidence at candidate slots and ``-inf`` elsewhere
    (what :func:`~hf_blockbatch.generation.rules.candidate_scores` builds). As in the paper, tokens
    decoded in earlier steps are not anchors, so the rule needs nothing else.

    Returns: every candidate ≥ ``anchor_threshold``; every candidate ≥ ``relaxed_threshold`` within
    ``radius`` positions of such a candidate; and each row's most confident candidate (the first on
    ties), so a row with candidates commits at least one. Never a non-candidate. Options are not
    re-checked here (hot path): :meth:`LocalLeapRule.validate` does that once, before any forward.
    """
    width = scores.shape[-1]
    if width == 0:  # no slot: nothing to commit (and no best to take)
        return torch.zeros(scores.shape, dtype=torch.bool, device=scores.device)
    anchors = scores >= anchor_threshold  # -inf at non-candidates: never an anchor
    committed = threshold_select(scores, anchor_threshold)
    # near[a, w] = an anchor in slots [w - radius, w + radius]: one stride-1 max-pool (a dilation).
    # A radius beyond the row reaches every slot anyway; capping it bounds the pooling window.
    reach = min(radius, width - 1)
    near = torch.nn.functional.max_pool1d(anchors[:, None].to(torch.float32), 2 * reach + 1, 1, reach)[:, 0] > 0
    return committed | (near & (scores >= relaxed_threshold))


def _check_threshold(name: str, value: object, default: float) -> None:
    if isinstance(value, bool) or not isinstance(value, Real) or not math.isfinite(value) or not 0.0 < value <= 1.0:
        raise ValueError(f"{name} must be a number in (0, 1], got {value!r}; the paper uses {default}.")


@register
@dataclass(frozen=True)
class LocalLeapRule:
    """LocalLeap's options, validated once before any forward; ``select`` is the per-step rule."""

    name: ClassVar[str] = "localleap"
    keeps_quota: ClassVar[bool] = False

    anchor_threshold: float = ANCHOR_THRESHOLD
    relaxed_threshold: float = RELAXED_THRESHOLD
    radius: int = RADIUS

    @classmethod
    def from_config(cls, cfg: FastDLLMConfig | BlockBatchConfig) -> LocalLeapRule:
        """The rule a config asks for: anchors at its ``threshold``; its ``relaxed_threshold`` and
        ``leap_radius``, or the paper's defaults where they are unset."""
        return cls(cfg.threshold, RELAXED_THRESHOLD if cfg.relaxed_threshold is None else cfg.relaxed_threshold,
                   RADIUS if cfg.leap_radius is None else cfg.leap_radius)  # fmt: skip

    def validate(self, names: dict[str, str] | None = None) -> None:
        """Raise a one-line ``ValueError`` saying what to change; ``names`` maps the fields to the
        option names the user gave (a config calls the anchor threshold ``threshold``)."""
        name = {"anchor_threshold": "anchor_threshold", "relaxed_threshold": "relaxed_threshold", "radius": "radius",
                **(names or {})}  # fmt: skip
        _check_threshold(name["anchor_threshold"], self.anchor_threshold, ANCHOR_THRESHOLD)
        _check_threshold(name["relaxed_threshold"], self.relaxed_threshold, RELAXED_THRESHOLD)
        if self.relaxed_threshold > self.anchor_threshold:
            raise ValueError(
                f"{name['relaxed_threshold']} ({self.relaxed_threshold}) must not exceed {name['anchor_threshold']} "
                f"({self.anchor_threshold}): lower it (the paper uses {RELAXED_THRESHOLD} with {ANCHOR_THRESHOLD})."
            )
        if isinstance(self.radius, bool) or not isinstance(self.radius, int) or self.radius <= 0:
            raise ValueError(
                f"{name['radius']} must be a positive integer (positions each side of an anchor), got {self.radius!r}; "
                f"the paper uses {RADIUS}."
            )

    def select(self, scores: torch.Tensor, state: DecodeState | None = None, rows: torch.Tensor | None = None,
               span: Span | None = None) -> torch.Tensor:  # fmt: skip
        """The slots to commit this step (see :func:`localleap_select`)."""
        return localleap_select(
            scores,
            anchor_threshold=self.anchor_threshold, relaxed_threshold=self.relaxed_threshold, radius=self.radius,
        )  # fmt: skip
