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

The probability map keeps the top-k probabilities per position with ``k = ceil(1 / threshold) - 1``
(at least 1), which is exact for this test: fewer than ``1 / threshold`` tokens can each hold more
than ``threshold``, so a token above it is always among the top k (the top-1 at threshold 0.5).
"""

from __future__ import annotations

import torch

from hf_blockbatch.generation.state import DecodeState

__all__ = ["merge"]


def merge(state: DecodeState, merge_threshold: float, branches: int) -> torch.Tensor:
    """Apply one merge pass in place; returns the [R, G] bool of merged positions.

    Rows are laid out request-major with ``branches`` rows per request (the engine keeps whole
    requests together), so every comparison is ``[B, N, N, G]``: linear in the batch, not
    quadratic in rows.
    """
    gs, mask_id = state.gen_start, state.mask_id
    R, G = state.num_rows, state.length - gs
    B, N = R // branches, branches
    gen = state.canvas[:, gs:].view(B, N, G)
    decoded = gen != mask_id
    active = (~state.done).view(B, N)
    end = state.win_end.view(B, N)
    idx = torch.arange(N, device=gen.device)
    # [b, dst, src]: sources stand behind the destination (smaller window end; ties by row order)
    behind = (end[:, None, :] < end[:, :, None]) | (
        (end[:, None, :] == end[:, :, None]) & (idx[None, None, :] > idx[None, :, None])
    )
    conflict = (decoded[:, :, None] & decoded[:, None] & (gen[:, :, None] != gen[:, None])).any(-1)
    sources = behind & ~conflict & active[:, :, None] & active[:, None, :]

    pos = torch.arange(G, device=gen.device) + gs
    in_window = (pos >= state.win_start[:, None]) & (pos < state.win_end[:, None])  # [R, G]
    scanned = (sources[..., None] & in_window.view(B, 1, N, G)).any(2)  # [b, dst, G]

    # the destination's probability for each source's token: [b, dst, src, G]
    k = state.prob_p.shape[-1]
    offered = gen[:, None].expand(B, N, N, G)
    hit = state.prob_ids.view(B, N, 1, G, k) == offered[..., None]
    prob = (state.prob_p.view(B, N, 1, G, k) * hit).sum(-1)
    usable = sources[..., None] & decoded[:, None]
    prob = torch.where(usable, prob, torch.full_like(prob, -1.0))
    best_prob, best_src = prob.max(dim=2)  # [b, dst, G]
    best_tok = offered.gather(2, best_src[:, :, None]).squeeze(2)
    take = scanned & ~decoded & (best_prob > merge_threshold) & active[..., None]
    state.canvas[:, gs:] = torch.where(take, best_tok, gen).view(R, G)
    take = take.view(R, G)
    state.merged += take.sum(-1)
    return take
