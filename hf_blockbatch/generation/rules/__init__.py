"""Transfer rules: which of a step's proposals are committed.

A rule sees one step's ``scores`` ``[A, W]``: for each of the step's ``A`` rows, ``W`` consecutive
canvas positions (a span covering the row's window), holding each candidate's confidence and
``-inf`` everywhere else. Candidates are the masked positions inside the row's current window;
they are always finite, so a row with candidates always has a best one. A rule returns the
``[A, W]`` bool of slots to commit, never a non-candidate and at least one candidate per row that
has one (a step always makes progress). The one exception: a candidate whose logits held NaN or +inf
scores NaN, which every rule's comparisons leave uncommitted (and a row whose best is NaN may commit
nothing that step); a decode that stalls on them fails saying why (engine), one forward that gives
them only costs that forward.

Each rule is one small frozen dataclass in its own file, registered here by name with
:func:`register`; :func:`make_rule` builds one from a config's options. Rules that keep per-row
schedule counters (the fixed quota) say so with ``keeps_quota``, so the state maintains them; a
rule that reads each proposal's predictive entropy (entropy-bounded commits) says so with
``needs_entropy``, so that sampling computes it, and gets it ``[A, W]`` as a fifth argument.

See docs/algorithm.md, "Transfer rules".
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar, Protocol

import torch

if TYPE_CHECKING:
    from hf_blockbatch.generation.forward import Span
    from hf_blockbatch.generation.state import DecodeState

__all__ = ["RULES", "TransferRule", "candidate_scores", "make_rule", "needs_entropy", "register"]


class TransferRule(Protocol):
    """What the engine asks of a rule: ``select`` one step's commits, with the flags that say which per-row counters
    (``keeps_quota``) the state must keep for it."""

    name: ClassVar[str]
    keeps_quota: ClassVar[bool]

    def select(self, scores: torch.Tensor, state: DecodeState, rows: torch.Tensor, span: Span) -> torch.Tensor:
        """``[A, W]`` bool: the slots of ``rows`` to commit this step."""


RULES: dict[str, type] = {}


def register(cls: type) -> type:
    """Class decorator: make a rule available by its ``name``."""
    RULES[cls.name] = cls
    return cls


def needs_entropy(rule: TransferRule) -> bool:
    """Whether ``rule`` reads the proposals' entropy (a rule that does not say, does not)."""
    return bool(getattr(rule, "needs_entropy", False))


def make_rule(name: str, **options: Any) -> TransferRule:
    """The registered rule ``name`` built with ``options`` (its dataclass fields); an unknown name is refused with
    the known ones."""
    if name not in RULES:
        raise ValueError(f"Unknown transfer rule {name!r}; known: {', '.join(sorted(RULES))}.")
    return RULES[name](**options)


def candidate_scores(confidence: torch.Tensor, candidates: torch.Tensor) -> torch.Tensor:
    """What the rules read: the confidence at candidates, ``-inf`` elsewhere.

    Candidates stay finite (a suppressed ``-inf`` confidence becomes the lowest finite value) so
    that a row with candidates always has a best one: a step can never commit nothing while masks
    remain.
    """
    finite = confidence.clamp_min(torch.finfo(confidence.dtype).min)
    return torch.where(candidates, finite, float("-inf"))


# the built-in rules register themselves on import
from hf_blockbatch.generation.rules import entropy, factor, localleap, quota, threshold  # noqa: E402,F401
