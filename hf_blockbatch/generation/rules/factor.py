"""Fast-dLLM's factor rule: sort the candidates by confidence and commit the largest n with
(n + 1)(1 − c_n) < f, at least one. A confident step commits many tokens, an unsure one few."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch

from hf_blockbatch.generation.rules import register
from hf_blockbatch.generation.rules.quota import quota_select

if TYPE_CHECKING:
    from hf_blockbatch.generation.forward import Span
    from hf_blockbatch.generation.state import DecodeState

__all__ = ["FactorRule", "factor_select"]


def factor_select(scores: torch.Tensor, factor: float) -> torch.Tensor:
    """Commit the n best candidates, n the largest with (n + 1)(1 − c_n) < factor (≥ 1)."""
    sorted_conf, order = scores.sort(dim=-1, descending=True)
    n = torch.arange(1, scores.shape[-1] + 1, device=scores.device)
    ok = ((n + 1) * (1 - sorted_conf) < factor) & torch.isfinite(sorted_conf)
    count = torch.where(ok, n, torch.zeros_like(n)).amax(dim=-1).clamp_min(1)
    return quota_select(scores, count, order=order)


@register
@dataclass(frozen=True)
class FactorRule:
    """Fast-dLLM's factor rule as a :class:`~hf_blockbatch.generation.rules.TransferRule`: the larger ``factor``,
    the more tokens a confident step commits."""

    name: ClassVar[str] = "factor"
    keeps_quota: ClassVar[bool] = False
    factor: float = 1.0

    def select(self, scores: torch.Tensor, state: DecodeState, rows: torch.Tensor, span: Span) -> torch.Tensor:
        """The slots to commit this step (see :func:`factor_select`); ``state``, ``rows`` and ``span`` are not read."""
        return factor_select(scores, self.factor)
