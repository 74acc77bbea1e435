"""Which rows get a full-sequence forward (a *refresh*) this step.

Window steps leave the keys and values outside the window stale. A refresh recomputes a row's
whole cache row, its probability map, and applies the transfer rule to its window. Fast-dLLM's
block-start forward is the same operation with ``refresh_interval = block_length``: the row
becomes due exactly when its window enters a new block.

Policies: ``periodic`` (due once the window advanced ``refresh_interval`` generated tokens since
the last refresh), ``divergence`` (also due when the row's last-layer keys over the generated
region drift from the mean of its request's rows by more than ``divergence_threshold``,
relative; the authors' optional trigger), ``off``. A row synced this step is never refreshed in
the same step (the sync already gave it the leader's cache).
"""

from __future__ import annotations

import torch

from hf_blockbatch.cache import BranchCache
from hf_blockbatch.generation.state import DecodeState

__all__ = ["due_rows"]


def _divergence(state: DecodeState, cache: BranchCache) -> torch.Tensor:
    keys = cache.layers[-1].keys[:, state.gen_start :].float().flatten(1)  # [R, G*H*D]
    B = int(state.request.max()) + 1
    sums = torch.zeros(B, keys.shape[1], device=keys.device).index_add_(0, state.request, keys)
    counts = torch.zeros(B, device=keys.device).index_add_(0, state.request, torch.ones_like(state.request, dtype=torch.float))
    mean = sums[state.request] / counts[state.request, None]
    return (keys - mean).norm(dim=-1) / mean.norm(dim=-1).clamp_min(1e-6)


def due_rows(
    state: DecodeState,
    policy: str,
    interval: int,
    cache: BranchCache | None,
    divergence_threshold: float,
) -> torch.Tensor:
    """[R] bool: rows to refresh now."""
    if policy == "off" or cache is None:
        return torch.zeros_like(state.done)
    due = state.since_refresh >= interval
    if policy == "divergence":
        due |= _divergence(state, cache) > divergence_threshold
    due &= ~state.done
    return due if state.synced_now is None else due & ~state.synced_now
