"""Branch pruning: a branch that keeps being synced to its leader stops being decoded.

Why: a sync is the evidence that a branch's block size lost to the leader's on this request; a
branch synced ``after_syncs`` times has cost forwards' worth of query tokens (its window in every
block step, its whole row in every refresh) and contributed nothing the leader did not already
have. Pruning it retires the row for the rest of the request (``DecodeState.pruned``): it is
*done* from then on, so

* no block step or refresh queries it (the engine steps the rows that are not done), and it adds
  no query tokens;
* it is no merge source (merge takes from active rows) and no merge destination (merge writes
  only into rows that are not done), and it is never synced;
* it is never a leader (``sync.leaders`` skips pruned rows) and never wins: a row is pruned right
  after a sync made it a copy of its leader, so its EOS hit (if any) is the leader's own and is
  cleared, and ``stop.pick_winners`` ranks it below every live row (it may tie with its leader
  when the sync copied a completed canvas).

The leader itself is never pruned (it was not synced), so every request keeps a live row and
ends as before. Everything is per request (a row's own sync count), so a padded batch decodes
each request as it would alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from hf_blockbatch.generation.policies import StepContext
from hf_blockbatch.generation.state import DecodeState

__all__ = ["Prune", "prune"]


@dataclass(frozen=True)
class Prune:
    """Retire a branch for the rest of its request once it has been synced ``after_syncs`` times.
    Runs right after :class:`~.sync.Sync` in a plan (it reads the step's ``synced_now``)."""

    needs: ClassVar[tuple[str, ...]] = ("pruned", "step_syncs")

    after_syncs: int = 2

    def apply(self, ctx: StepContext) -> bool:
        """Prune the branches synced ``after_syncs`` times (not after a full forward); returns whether any was."""
        if ctx.full:  # the initial sync says only which window committed most from the shared logits
            return False
        return bool(prune(ctx.state, self.after_syncs).any())


def prune(state: DecodeState, after_syncs: int) -> torch.Tensor:
    """Count this step's syncs and prune, in place, the rows synced now whose count of syncs after
    block steps reached ``after_syncs``; returns the [R] bool of rows pruned now.

    The initial forward's sync is not counted: every branch commits in its first window from the
    same logits, so the widest window leads by construction, and counting that sync would prune
    every other branch before it decoded anything of its own."""
    if state.synced_now is None:
        return torch.zeros_like(state.pruned)
    state.step_syncs += state.synced_now
    new = state.synced_now & (state.step_syncs >= after_syncs) & ~state.pruned
    state.pruned |= new
    state.done |= new
    state.eos_hit &= ~new  # a copy of its leader's hit: the leader keeps it
    return new
