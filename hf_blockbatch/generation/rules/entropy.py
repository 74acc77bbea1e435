"""Entropy-bounded commits (EB-sampler: Ben-Hamu et al. 2025, arXiv 2505.24857; DiffusionGemma's default
sampler): rank the candidates by confidence and commit the longest prefix whose predictive entropies sum to
at most ``bound`` nats more than the largest of them, at least one. A peaked window commits many tokens, an
unsure one few, as the factor rule, with the budget in entropy rather than in the confidences. Measured
against the threshold rule in ``benchmarks/RESULTS.md`` §32: ahead on the lists suite and on tiny-dream's
code, behind on arith."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch

from hf_blockbatch.generation.rules import register

if TYPE_CHECKING:
    from hf_blockbatch.generation.forward import Span
    from hf_blockbatch.generation.state import DecodeState

__all__ = ["EntropyBoundRule", "entropy_select"]


def entropy_select(scores: torch.Tensor, entropy: torch.Tensor, bound: float) -> torch.Tensor:
    """``[A, W]``: per row, the candidates by confidence (``scores``, ``-inf`` off the candidates), the longest
    prefix whose ``entropy`` sums to at most ``bound`` above its largest: always the best candidate."""
    order = scores.argsort(dim=-1, descending=True, stable=True)  # candidates first
    candidate = scores.gather(-1, order) > float("-inf")
    h = entropy.gather(-1, order).to(torch.float64).masked_fill(~candidate, 0.0)
    within = (h.cumsum(-1) - h.cummax(-1).values <= bound) & candidate
    keep = within.cumprod(-1).bool()  # a prefix: the first candidate past the budget ends it
    return torch.zeros_like(candidate).scatter_(-1, order, keep)


@register
@dataclass(frozen=True)
class EntropyBoundRule:
    """Entropy-bounded commits as a :class:`~hf_blockbatch.generation.rules.TransferRule`: ``needs_entropy`` asks the
    sampling for each proposal's entropy, which :func:`~hf_blockbatch.generation.commit.write_commits` passes on."""

    name: ClassVar[str] = "entropy"
    keeps_quota: ClassVar[bool] = False
    needs_entropy: ClassVar[bool] = True  # the step's proposals carry their predictive entropy
    bound: float = 0.2

    def select(self, scores: torch.Tensor, state: DecodeState, rows: torch.Tensor, span: Span,
               entropy: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
        """The slots to commit this step (see :func:`entropy_select`); ``entropy`` ``[A, W]`` is required, and
        ``state``, ``rows`` and ``span`` are not read."""
        if entropy is None:
            raise ValueError("rule='entropy' reads each proposal's entropy: the step did not compute it.")
        return entropy_select(scores, entropy, self.bound)
