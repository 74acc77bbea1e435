"""Fast-dLLM's threshold rule: commit every candidate with confidence ≥ τ, and always the single
most confident one (so a step commits at least one token)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from hf_blockbatch.generation.rules import register

__all__ = ["ThresholdRule", "threshold_select"]


def threshold_select(scores: torch.Tensor, threshold: float) -> torch.Tensor:
    """Commit candidates scoring ≥ threshold, and each row's single best candidate."""
    best = scores.argmax(dim=-1, keepdim=True)
    return (scores >= threshold).scatter_(-1, best, scores.gather(-1, best) > float("-inf"))


@register
@dataclass(frozen=True)
class ThresholdRule:
    name: ClassVar[str] = "threshold"
    keeps_quota: ClassVar[bool] = False
    threshold: float = 0.9

    def select(self, scores, state, rows, span) -> torch.Tensor:
        return threshold_select(scores, self.threshold)
