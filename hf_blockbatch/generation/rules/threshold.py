"""Fast-dLLM's threshold rule: commit every candidate with confidence ≥ τ, and always the single
most confident one (so a step commits at least one token).

``many_masks_threshold`` (issue 16): while a row's window still has more than ``many_masks`` masks left,
commit at that (lower) threshold instead. Why: on training items the low-confidence commits that cost
accuracy are the late ones, among a window's last few masks, where the answer's content tokens wait; a
window that still has many masks left is committing mostly its format and its tail of end tokens, where
0.85 is as safe as 0.9 and saves forwards (benchmarks/RESULTS.md §48: a lower threshold everywhere loses
up to 1.5 points on tiny-llada code and arith, the same threshold only above 16 masks loses none).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch

from hf_blockbatch.generation.rules import register

if TYPE_CHECKING:
    from hf_blockbatch.generation.forward import Span
    from hf_blockbatch.generation.state import DecodeState

__all__ = ["MANY_MASKS", "ThresholdRule", "threshold_select"]

#: ``many_masks`` when a config sets ``many_masks_threshold`` alone: the mask count above which no lookahead draft
#: of ``FastDLLMConfig.drafted(exact=False)`` rides either (chosen on training items, RESULTS §48)
MANY_MASKS = 16


def threshold_select(scores: torch.Tensor, threshold: float | torch.Tensor) -> torch.Tensor:
    """Commit candidates scoring ≥ threshold (a number, or one per row ``[A, 1]``), and each row's single
    best candidate."""
    best = scores.argmax(dim=-1, keepdim=True)
    return (scores >= threshold).scatter_(-1, best, scores.gather(-1, best) > float("-inf"))


@register
@dataclass(frozen=True)
class ThresholdRule:
    """Fast-dLLM's threshold rule as a :class:`~hf_blockbatch.generation.rules.TransferRule`, with the optional
    lower threshold while a window has many masks left (module docstring)."""

    name: ClassVar[str] = "threshold"
    keeps_quota: ClassVar[bool] = False
    threshold: float = 0.9
    #: the threshold of a row whose window has more than ``many_masks`` masks left (its candidates, before the
    #: step's commit); ``None``: ``threshold`` everywhere
    many_masks_threshold: float | None = None
    many_masks: int = MANY_MASKS

    def select(self, scores: torch.Tensor, state: DecodeState, rows: torch.Tensor, span: Span) -> torch.Tensor:
        """The slots to commit this step (see :func:`threshold_select`), at ``many_masks_threshold`` in rows whose
        window has more than ``many_masks`` candidates; ``state``, ``rows`` and ``span`` are not read."""
        if self.many_masks_threshold is None:
            return threshold_select(scores, self.threshold)
        # the candidates are the masks inside the row's window (finite scores), so the count is per row: a padded
        # batch decodes each request as alone, and a lookahead draft row (its main row's canvas plus a drafted
        # token or two) uses the threshold its main row's next step would, on the same canvas
        left = (scores > float("-inf")).sum(-1, keepdim=True)
        tau = torch.where(left > self.many_masks, self.many_masks_threshold, self.threshold)
        return threshold_select(scores, tau)
