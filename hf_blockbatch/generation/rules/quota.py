"""LLaDA's fixed quota: each block gets ``steps_per_block`` steps, and a step commits its share of
the masks the block held when the window moved there, the most confident first (``low_confidence``
remasking) or in random order (``random``, through random confidences)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch

from hf_blockbatch.generation.rules import register

if TYPE_CHECKING:
    from hf_blockbatch.generation.forward import Span
    from hf_blockbatch.generation.state import DecodeState

__all__ = ["QuotaRule", "quota_schedule", "quota_select"]


def quota_select(scores: torch.Tensor, count: torch.Tensor, order: torch.Tensor | None = None) -> torch.Tensor:
    """Commit the ``count[a]`` best candidates of each row (never a non-candidate)."""
    if order is None:
        order = scores.sort(dim=-1, descending=True).indices
    ranks = torch.empty_like(order).scatter_(-1, order, torch.arange(order.shape[-1], device=order.device).expand_as(order))
    return (scores > float("-inf")) & (ranks < count[:, None])


def quota_schedule(masked_at_block_start: torch.Tensor, steps_per_block: int, step: torch.Tensor) -> torch.Tensor:
    """LLaDA's even schedule: ``n`` masked tokens over ``s`` steps gives ``n // s`` per step plus one
    more in the first ``n % s`` steps (as its ``get_num_transfer_tokens``)."""
    base = masked_at_block_start // steps_per_block
    return base + (step < masked_at_block_start % steps_per_block).long()


@register
@dataclass(frozen=True)
class QuotaRule:
    """LLaDA's fixed quota as a :class:`~hf_blockbatch.generation.rules.TransferRule`, the one rule with per-row
    state: ``select`` reads and advances the schedule counters (``steps_in_block``, ``masked_at_block_start``) that
    the state keeps because ``keeps_quota`` says so."""

    name: ClassVar[str] = "quota"
    keeps_quota: ClassVar[bool] = True  # the state counts steps since each window moved
    steps_per_block: int = 1

    def select(self, scores: torch.Tensor, state: DecodeState, rows: torch.Tensor, span: Span) -> torch.Tensor:
        """Each row's share of its block's masks this step (:func:`quota_schedule`, at least one), the best
        candidates first. Advances ``state.steps_in_block`` of ``rows``: call it once per step."""
        count = quota_schedule(state.masked_at_block_start[rows], self.steps_per_block, state.steps_in_block[rows])
        state.steps_in_block[rows] += 1
        return quota_select(scores, count.clamp_min(1))
