"""When a request ends, and which branch's canvas is its answer.

A row *hits EOS* when its current window is fully decoded and holds an end-of-sequence token.
With early stop on, the first such hit ends the request and, among the request's hitting rows,
the one most confident in its EOS wins. Otherwise a request ends when every row is done, and the
row with the most decoded tokens (lowest branch index on ties) wins.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from hf_blockbatch.generation.state import DecodeState

__all__ = ["mark_eos", "finished_requests", "pick_winners", "fill_after_eos"]


def mark_eos(
    state: DecodeState,
    rows: torch.Tensor,
    tokens: torch.Tensor,
    in_window: torch.Tensor | None,
    eos_prob_at: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    eos_ids: torch.Tensor,
) -> None:
    """Record EOS hits for ``rows`` (rows that were just decoded, so not done) after a commit.

    ``tokens`` ``[A, W]`` is a span of each row after the commit that covers its window;
    ``in_window`` marks the span's slots inside the window (``None``: the span is the window);
    ``eos_prob_at(local_rows [n], slots [n]) -> [n]`` gives this step's probability of EOS at a
    slot of some of the rows. It is asked only for rows that hit EOS for the first time, at their
    first EOS slot: a probability costs a softmax over the vocabulary, and a row hits once.
    """
    open_slots = tokens == state.mask_id
    is_eos = torch.isin(tokens, eos_ids)
    if in_window is not None:
        open_slots &= in_window
        is_eos &= in_window
    hit = is_eos.any(-1) & ~open_slots.any(-1) & ~state.eos_hit[rows]
    new = hit.nonzero().squeeze(1)
    if new.numel():
        first = is_eos[new].byte().argmax(-1)
        target = rows[new]
        state.eos_prob[target] = eos_prob_at(new, first).to(state.eos_prob.dtype)
        state.eos_hit[target] = True


def finished_requests(state: DecodeState, num_requests: int, early_stop: bool) -> torch.Tensor:
    """[B] bool over the caller's batch: requests that end now (absent or retired requests: False)."""
    all_done = torch.ones(num_requests, dtype=torch.bool, device=state.canvas.device)
    all_done.scatter_reduce_(0, state.request, state.done, reduce="amin")
    live = torch.zeros_like(all_done).scatter_reduce_(0, state.request, ~state.retired, reduce="amax")
    finished = all_done & live
    if early_stop:
        eos = torch.zeros_like(all_done).scatter_reduce_(0, state.request, state.eos_hit, reduce="amax")
        finished |= eos & live
    return finished


def pick_winners(state: DecodeState, finished: torch.Tensor, early_stop: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """For the rows of finished requests: the winning row index per request and whether it won by EOS.

    Returns ``(winner_row [B], by_eos [B])``; entries of unfinished requests are meaningless.
    """
    R = state.num_rows
    B = finished.shape[0]
    idx = torch.arange(R, device=state.canvas.device)
    # score: EOS hitters first (by EOS probability), then most decoded, then lowest row index
    decoded = state.decoded().double()
    eos_key = torch.where(state.eos_hit, 1.0 + state.eos_prob.double(), torch.zeros_like(decoded))
    if not early_stop:
        eos_key = torch.zeros_like(eos_key)
    score = eos_key * 1e9 + decoded * (R + 1) + (R - idx).double()
    best = torch.full((B,), -1.0, dtype=torch.float64, device=score.device)
    best.scatter_reduce_(0, state.request, score, reduce="amax")
    is_best = score == best[state.request]
    winner = torch.full((B,), R, dtype=torch.long, device=score.device)
    winner.scatter_reduce_(0, state.request, torch.where(is_best, idx, torch.full_like(idx, R)), reduce="amin")
    winner = winner.clamp(max=R - 1)
    by_eos = state.eos_hit[winner] & early_stop
    return winner, by_eos


def fill_after_eos(canvas: torch.Tensor, gen_start: int, mask_id: int, pad_id: int) -> torch.Tensor:
    """Positions still masked when a request stopped at EOS become padding (EOS), as the model
    itself fills the tail; positions before the EOS are never masked (windows move left to right)."""
    out = canvas.clone()
    gen = out[:, gen_start:]
    gen.masked_fill_(gen == mask_id, pad_id)
    return out
