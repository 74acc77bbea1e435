"""Leader sync: a branch that lags too far behind its request's leader becomes a copy of it.

The leader of a request is its row with the most decoded tokens (first row on ties). Every active
row more than ``sync_threshold`` decoded tokens behind copies the leader's canvas, cache row and
probability map, then re-derives its own window (of its own block size) from its first mask.
This is the only operation that replaces committed tokens, and it replaces a whole row at once.

See docs/algorithm.md, "BlockBatch — Sync".
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hf_blockbatch.cache import BranchCache
from hf_blockbatch.generation.policies import StepContext
from hf_blockbatch.generation.state import DecodeState

__all__ = ["Sync", "leaders", "sync_to_leader"]

_COPIED = ("canvas", "prob_p", "prob_ids", "eos_hit", "eos_prob", "commit_prob")


@dataclass(frozen=True)
class Sync:
    """``count``: what the leader and the lag are measured in: ``"decoded"`` (non-mask tokens,
    ours) or ``"rule"`` (the transfer rule's commits, merged tokens excluded, a synced row taking
    its leader's count: the authors'). ``copy_map``: a synced row also takes the leader's
    probability map and EOS state (ours), or keeps its own (the authors': canvas and K/V only)."""

    threshold: int = 8
    count: str = "decoded"
    copy_map: bool = True

    @property
    def needs(self) -> tuple[str, ...]:
        """The state's optional tensors this policy reads (``DecodeState.features``)."""
        return ("count_offset",) if self.count == "rule" else ()

    def apply(self, ctx: StepContext) -> bool:
        """Sync the rows more than ``threshold`` behind their request's leader, then advance every window
        (:func:`sync_to_leader`); returns True."""
        # leaders before the sync: afterwards a synced row ties with its leader and may win the tie
        leader = leaders(ctx.state, self.count) if ctx.recorder.tracing else None
        synced = sync_to_leader(ctx.state, ctx.cache, self.threshold, self.count, _COPIED if self.copy_map else ("canvas",))
        if leader is not None:
            ctx.recorder.sync(ctx.state, synced, leader)
        return True


def counts(state: DecodeState, count: str = "decoded") -> torch.Tensor:
    """[R] what a row has decoded, as the sync measures it (see :class:`Sync`); a pruned row
    (``policies.prune``) counts -1, so it is never a leader."""
    decoded = state.decoded() if count == "decoded" else state.committed + state.count_offset
    return decoded if state.pruned is None else decoded.masked_fill(state.pruned, -1)


def leaders(state: DecodeState, count: str = "decoded") -> torch.Tensor:
    """[R] the leader row of each row's request: an argmax over the ``[B, N]`` decoded counts,
    which returns the first maximum, the lowest branch on ties."""
    per_request = state.per_request(counts(state, count))
    return (per_request.argmax(-1) + state.first_rows()).repeat_interleave(state.branches)


def sync_to_leader(state: DecodeState, cache: BranchCache | None, sync_threshold: int, count: str = "decoded",
                   copied: tuple[str, ...] = _COPIED) -> torch.Tensor:  # fmt: skip
    """Sync lagging rows in place, then advance every row's window; returns the [R] bool of synced rows.

    The windows may be stale on entry (the engine merges, then syncs, then advances once): the
    decoded counts are exact, and a row that merged into completion has the most decoded tokens,
    so it is never synced, only followed. A sync neither counts nor resets a row's window moves.
    """
    branches = state.branches
    decoded = state.per_request(counts(state, count))
    best, leader = decoded.max(-1, keepdim=True)
    lag = best - decoded  # [B, N]; the leader's own lag is 0, never above a threshold >= 0
    synced = ((lag > sync_threshold) & ~state.done.view_as(lag)).view(-1)
    dst = synced.nonzero().squeeze(1)
    if dst.numel():
        src = dst - dst % branches + leader.view(-1)[dst // branches]  # the leader of dst's request
        state.copied.index_add_(0, dst, lag.view(-1)[dst])
        state.syncs.index_add_(0, dst, torch.ones_like(dst))
        state.copy_rows(src, dst, copied)
        if count == "rule":  # the synced row's count becomes its leader's
            state.count_offset[dst] = state.committed[src] + state.count_offset[src] - state.committed[dst]
        if cache is not None:
            cache.copy_rows(src, dst, same_mask=True)
            state.copy_rows(src, dst, ("kv_tokens",))  # which K/V the copied cache rows hold
    moves = state.moves[dst] if state.moves is not None else None
    state.advance()
    if dst.numel():
        state.since_refresh[dst] = state.since_refresh[src]  # the copy carries the leader's refresh age
        if moves is not None:  # a sync neither counts nor resets the authors' refresh counter
            state.moves[dst] = moves
    state.synced_now = synced
    return synced
