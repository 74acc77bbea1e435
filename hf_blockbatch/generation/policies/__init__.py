"""Per-step branch policies: what happens to the rows after the transfer rule has committed.

A plan holds an ordered list of policies; after every commit the engine applies them in order
(:meth:`BranchPolicy.apply`). Fast-dLLM and vanilla have one, :class:`Advance`; BlockBatch adds
:class:`Merge` and :class:`Sync` (and optionally :class:`Prune`); Fast-dLLM with lookahead adds
:class:`Lookahead`, whose draft rows the engine also asks to be written before each block step. A policy returns whether it may
have moved a window (a moved window can make a row done, hit EOS or become due for a refresh;
while none moved, the engine keeps its step layout). A new policy is a new small file exposing a
class with ``apply``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from hf_blockbatch.cache import BranchCache
    from hf_blockbatch.generation.state import DecodeState
    from hf_blockbatch.generation.trace import Recorder

__all__ = ["Advance", "BranchPolicy", "Lookahead", "Merge", "Prune", "StepContext", "Sync"]


@dataclass
class StepContext:
    """What a policy may read or change after a commit."""

    state: DecodeState
    cache: BranchCache | None
    recorder: Recorder
    full: bool  # the commit came from a full forward (initial or refresh)
    completed: bool  # some window may have completed (else advancing would move nothing)


class BranchPolicy(Protocol):
    """What the engine asks of a policy: ``apply`` after each commit, in the plan's order. A policy may also say
    which optional state tensors it reads (``needs``: ``DecodeState.features``), so a plan without it pays none."""

    def apply(self, ctx: StepContext) -> bool:
        """Change the rows in place; return whether a window may have moved."""


from hf_blockbatch.generation.policies.advance import Advance  # noqa: E402
from hf_blockbatch.generation.policies.lookahead import Lookahead  # noqa: E402
from hf_blockbatch.generation.policies.merge import Merge  # noqa: E402
from hf_blockbatch.generation.policies.prune import Prune  # noqa: E402
from hf_blockbatch.generation.policies.sync import Sync  # noqa: E402
