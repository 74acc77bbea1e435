"""Confidence-gated merging: a branch adopts tokens that another, compatible branch has decoded.

Two rows of a request are *compatible* when every position decoded in both holds the same token.
A destination row looks at the positions inside the current windows of its compatible sources;
for each of those positions still masked in the destination, it takes, among the tokens its
sources have decoded there, the one its own probability map rates highest, and commits it when
that probability exceeds ``merge_threshold``.

As in the reference, destinations are ordered by decreasing window end and each takes only from
the rows behind it (smaller window end; equal ends by row order). Sources are therefore never
destinations already merged in the same pass, so the whole pass is computed at once on the
pre-merge canvases, as ``[R, R, G]`` masked comparisons, with no loop over rows or positions.

The probability map keeps the top-k probabilities per position with ``k >= ceil(1 / threshold)``,
which is exact for this test: a token with probability above ``1/k`` is always among the top k.
"""

from __future__ import annotations

import torch

from hf_blockbatch.generation.state import DecodeState

__all__ = ["merge"]


def merge(state: DecodeState, merge_threshold: float) -> torch.Tensor:
    """Apply one merge pass in place; returns the [R, G] bool of merged positions."""
    gs, mask_id = state.gen_start, state.mask_id
    gen = state.canvas[:, gs:]  # [R, G]
    R, G = gen.shape
    decoded = gen != mask_id
    active = ~state.done
    same_req = state.request[:, None] == state.request[None, :]
    idx = torch.arange(R, device=gen.device)
    end = state.win_end
    behind = (end[None, :] < end[:, None]) | ((end[None, :] == end[:, None]) & (idx[None, :] > idx[:, None]))
    conflict = (decoded[:, None, :] & decoded[None, :, :] & (gen[:, None, :] != gen[None, :, :])).any(-1)
    sources = same_req & behind & ~conflict & active[:, None] & active[None, :]  # [dst, src]

    pos = torch.arange(G, device=gen.device) + gs
    in_window = (pos[None, :] >= state.win_start[:, None]) & (pos[None, :] < state.win_end[:, None])  # [R, G]
    scanned = (sources[:, :, None] & in_window[None, :, :]).any(1)  # [dst, G]

    # the destination's probability for each source's token: [dst, src, G]
    offered = gen[None, :, :].expand(R, R, G)
    hit = state.prob_ids[:, None, :, :] == offered[..., None]  # [dst, src, G, k]
    prob = (state.prob_p[:, None, :, :] * hit).sum(-1)
    usable = sources[:, :, None] & decoded[None, :, :]
    prob = torch.where(usable, prob, torch.full_like(prob, -1.0))
    best_prob, best_src = prob.max(dim=1)  # [dst, G]
    best_tok = offered.gather(1, best_src[:, None, :]).squeeze(1)
    take = scanned & ~decoded & (best_prob > merge_threshold) & active[:, None]
    state.canvas[:, gs:] = torch.where(take, best_tok, gen)
    state.merged += take.sum(-1)
    return take
