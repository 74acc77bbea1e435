"""Window advance: a row whose window has no mask left moves to the block (of its own size) that
holds its first remaining mask; a row with no mask left is done (see ``DecodeState.advance``).

See docs/algorithm.md, "BlockBatch — Advance".
"""

from __future__ import annotations

from dataclasses import dataclass

from hf_blockbatch.generation.policies import StepContext

__all__ = ["Advance"]


@dataclass(frozen=True)
class Advance:
    """``after_full=False`` keeps the window after a full forward completed it, so the next block
    step runs on the completed block (the official Fast-dLLM's extra forward). ``always`` advances
    whether or not a window completed (after a merge, which fills masks outside the commit)."""

    after_full: bool = True
    always: bool = False

    def apply(self, ctx: StepContext) -> bool:
        """Advance every row's window (``DecodeState.advance``), unless no window can have completed; returns
        whether it advanced."""
        if not self.always and (not ctx.completed or (ctx.full and not self.after_full)):
            return False
        ctx.state.advance()
        return True
