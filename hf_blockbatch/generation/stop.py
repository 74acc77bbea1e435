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
    complete: torch.Tensor | None = None,
) -> None:
    """Record EOS hits for ``rows`` (rows that were just decoded, so not done) after a commit.

    ``tokens`` ``[A, W]`` is a span of each row after the commit that covers its window;
    ``in_window`` marks the span's slots inside the window (``None``: the span is the window);
    ``eos_prob_at(local_rows [n], slots [n]) -> [n]`` gives this step's probability of EOS at a
    slot of some of the rows. It is asked only for rows that hit EOS for the first time, at their
    first EOS slot: a probability costs a softmax over the vocabulary, and a row hits once.
    ``complete`` ``[A]`` may say which windows are fully decoded, when the caller knows already.
    """
    is_eos = torch.isin(tokens, eos_ids)
    if in_window is not None:
        is_eos &= in_window
    if complete is None:
        open_slots = tokens == state.mask_id
        if in_window is not None:
            open_slots &= in_window
        complete = ~open_slots.any(-1)
    hit = is_eos.any(-1) & complete & ~state.eos_hit[rows]
    new = hit.nonzero().squeeze(1)
    if new.numel():
        first = is_eos[new].byte().argmax(-1)
        target = rows[new]
        state.eos_prob[target] = eos_prob_at(new, first).to(state.eos_prob.dtype)
        state.eos_hit[target] = True


def finished_requests(state: DecodeState, num_requests: int, early_stop: bool, branches: int) -> torch.Tensor:
    """[B] bool over the caller's batch: requests that end now (absent or retired requests: False).

    Rows are request-major, ``branches`` per request (the engine keeps whole requests together),
    so each request is one row of a ``[requests, branches]`` view.
    """
    first = state.first_rows(branches)
    ends = state.done.view(-1, branches).all(-1)
    if early_stop:
        ends |= state.eos_hit.view(-1, branches).any(-1)
    ends &= ~state.retired[first]
    finished = torch.zeros(num_requests, dtype=torch.bool, device=ends.device)
    return finished.index_put_((state.request[first],), ends)


def pick_winners(state: DecodeState, finished: torch.Tensor, early_stop: bool, branches: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For the rows of finished requests: the winning row index per request and whether it won by EOS.

    Returns ``(winner_row [B], by_eos [B])``; entries of unfinished requests are meaningless.
    EOS hitters first (by EOS probability), then the most decoded tokens, then the lowest branch.
    """
    R, B = state.num_rows, finished.shape[0]
    decoded = state.decoded().view(-1, branches)
    if early_stop:  # strictly by EOS probability first: a decoded count only breaks exact ties
        p = torch.where(state.eos_hit, state.eos_prob.double(), -1.0).view(-1, branches)
        decoded = torch.where(p == p.amax(-1, keepdim=True), decoded, -1)
    first = state.first_rows(branches)
    best = decoded.argmax(-1) + first  # argmax: the first maximum, the lowest branch
    winner = torch.full((B,), R - 1, dtype=torch.long, device=best.device)
    winner.index_put_((state.request[first],), best)
    by_eos = state.eos_hit[winner] & early_stop
    return winner, by_eos


def fill_after_eos(canvas: torch.Tensor, gen_start: int, mask_id: int, pad_id: int) -> torch.Tensor:
    """Positions still masked when a request stopped at EOS become padding (EOS), as the model
    itself fills the tail; positions before the EOS are never masked (windows move left to right)."""
    out = canvas.clone()
    gen = out[:, gen_start:]
    gen.masked_fill_(gen == mask_id, pad_id)
    return out
