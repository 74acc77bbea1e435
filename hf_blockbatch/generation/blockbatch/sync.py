"""Leader sync: a branch that lags too far behind its request's leader becomes a copy of it.

The leader of a request is its row with the most decoded tokens (first row on ties). Every active
row more than ``sync_threshold`` decoded tokens behind copies the leader's canvas, cache row and
probability map, then re-derives its own window (of its own block size) from its first mask.
This is the only operation that replaces committed tokens, and it replaces a whole row at once.
"""

from __future__ import annotations

import torch

from hf_blockbatch.cache import BranchCache
from hf_blockbatch.generation.state import DecodeState

__all__ = ["leaders", "sync_to_leader"]

_COPIED = ("canvas", "prob_p", "prob_ids", "since_refresh", "eos_hit", "eos_prob")


def leaders(state: DecodeState) -> tuple[torch.Tensor, torch.Tensor]:
    """(leader row of each row's request [R], decoded counts [R])."""
    R = state.num_rows
    decoded = state.decoded()
    idx = torch.arange(R, device=decoded.device)
    score = decoded * (R + 1) + (R - idx)
    B = int(state.request.max()) + 1 if R else 0
    best = torch.full((B,), -1, dtype=score.dtype, device=score.device)
    best.scatter_reduce_(0, state.request, score, reduce="amax")
    leader_score = best[state.request]
    leader = R - (leader_score % (R + 1))
    return leader, decoded


def sync_to_leader(state: DecodeState, cache: BranchCache | None, sync_threshold: int) -> torch.Tensor:
    """Sync lagging rows in place; returns the [R] bool of synced rows."""
    leader, decoded = leaders(state)
    lag = decoded[leader] - decoded
    synced = ~state.done & (leader != torch.arange(state.num_rows, device=lag.device)) & (lag > sync_threshold)
    synced &= decoded[leader] > 0
    dst = synced.nonzero().squeeze(1)
    if dst.numel():
        src = leader[dst]
        state.copied.index_add_(0, dst, lag[dst])
        state.syncs.index_add_(0, dst, torch.ones_like(dst))
        state.copy_rows(src, dst, _COPIED)
        if cache is not None:
            cache.copy_rows(src, dst)
        since = state.since_refresh[dst].clone()
        state.advance()
        state.since_refresh[dst] = since  # the copy carries the leader's refresh age, not a jump
    state.synced_now = synced
    return synced
