"""The stop rule: when a request ends, which branch's canvas is its answer, and retirement.

A row *hits EOS* when its current window is fully decoded and holds an end-of-sequence token.
With early stop on, the first such hit ends the request and, among the request's hitting rows,
the one most confident in its EOS wins (``eos_rank`` says which probability ranks them:
``"completion"``, the forward that completed the block, or ``"commit"``, the one that committed
the EOS; ``None`` for a request of one row, which has nothing to rank; ``"widest"``: no
probability, the hitter with the largest block wins, see ``BlockBatchConfig.eos_prefer_widest``).
Otherwise a request ends when every row is done, and the row with the most decoded tokens (lowest
branch on ties) wins; a pruned row (``policies.prune``) never wins.

A finished request's rows are *retired* at once (done: no forward or policy touches them again)
and physically dropped from the state and the cache only once at least half of the rows are
retired: dropping copies every kept cache row, so dropping at every finish would cost
O(finishes × cache), halving keeps it O(cache) overall.

See docs/algorithm.md, "BlockBatch — Stop".
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from hf_blockbatch.cache import BranchCache
from hf_blockbatch.generation.state import DecodeState

__all__ = ["Ending", "StopRule", "fill_after_eos", "finished_requests", "mark_eos", "pick_winners"]


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
    hit = is_eos.any(-1) & complete & ~state.take(state.eos_hit, rows)
    new = hit.nonzero().squeeze(1)
    if new.numel():
        first = is_eos[new].byte().argmax(-1)
        target = rows[new]
        state.eos_prob[target] = eos_prob_at(new, first).to(state.eos_prob.dtype)
        state.eos_hit[target] = True


def finished_requests(state: DecodeState, num_requests: int, early_stop: bool) -> torch.Tensor:
    """[B] bool over the caller's batch: requests that end now (absent or retired requests: False)."""
    ends = state.per_request(state.done).all(-1)
    if early_stop:
        ends |= state.per_request(state.eos_hit).any(-1)
    ends &= ~state.main_rows(state.retired)
    finished = torch.zeros(num_requests, dtype=torch.bool, device=ends.device)
    return finished.index_put_((state.main_rows(state.request),), ends)


def pick_winners(state: DecodeState, finished: torch.Tensor, early_stop: bool, widest: bool = False,
                 ties: str = "decoded", decoded: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """For the rows of finished requests: the winning row index per request and whether it won by EOS.

    Returns ``(winner_row [B], by_eos [B])``; entries of unfinished requests are meaningless.
    EOS hitters first (by EOS probability, or by block size when ``widest``), then
    (``ties="decoded"``) the most decoded tokens, then the lowest branch (``ties="branch"``: the
    lowest branch at once, as the authors). ``decoded``: :meth:`DecodeState.decoded`, when the caller has counted
    it already.
    """
    R, B = state.num_rows, finished.shape[0]
    # a pruned row is a copy of a leader that went on: it may tie with it (a sync that copied a
    # completed canvas), never beat it
    if ties != "decoded":
        decoded = torch.zeros_like(state.committed)
    elif decoded is None:
        decoded = state.decoded()
    decoded = state.per_request(decoded if state.pruned is None else decoded.masked_fill(state.pruned, -1))
    if early_stop:  # strictly by EOS probability first: a decoded count only breaks exact ties
        rank = state.block.double() if widest else state.eos_prob.double()
        p = state.per_request(torch.where(state.eos_hit, rank, -1.0))
        decoded = torch.where(p == p.amax(-1, keepdim=True), decoded, -1)
    first = state.first_rows()
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


@dataclass
class Ending:
    """Requests that finished in this step: their indices, winning rows, whether by EOS, and outputs."""

    finished: torch.Tensor  # [B] bool over the caller's batch
    requests: torch.Tensor  # [n] indices into the caller's batch
    winners: torch.Tensor  # [n] state rows
    by_eos: torch.Tensor  # [n] bool
    sequences: torch.Tensor  # [n, L]
    decoded: torch.Tensor | None = None  # [R] DecodeState.decoded() when the winners were picked (the stats read it)


@dataclass(frozen=True)
class StopRule:
    """When a request ends and which of its rows answers (module docstring): ``early_stop`` ends it at a completed
    window holding EOS, ranked by ``eos_rank`` among several branches; else when a row has no mask left."""

    early_stop: bool = False
    eos_rank: str | None = None  # "completion" | "commit" | "widest" | None (see the module docstring)
    # the authors' variant: EOS hits are detected only after these phases' commits, and checked
    # right after the block step, before the policies (``before_policies``); the EOS probability
    # is a softmax in ``eos_dtype``; EOS-probability ties go to the lowest branch (``ties``)
    eos_phases: tuple[str, ...] = ("init", "block", "refresh")
    before_policies: bool = False
    eos_dtype: torch.dtype = torch.float32
    ties: str = "decoded"

    def ending(self, state: DecodeState, num_requests: int, pad_id: int) -> Ending | None:
        """The requests that end now, or None (one host sync while none can)."""
        # a request can only end once one of its live rows is done (or hit EOS, with early stop);
        # retired rows are done and have no EOS hit. A pruned row is done too, but every request keeps
        # a row that is not pruned (``policies.prune``; Lookahead's main row), and it is done when all
        # are: so pruned rows are left out, or Lookahead's parked drafts would make every step look
        # for finished requests
        ready = state.done ^ state.retired
        if state.pruned is not None:
            ready &= ~state.pruned
        if self.early_stop:
            ready |= state.eos_hit
        if not bool(ready.any()):
            return None
        finished = finished_requests(state, num_requests, self.early_stop)
        if not bool(finished.any()):
            return None
        decoded = state.decoded()  # the winners' tie-break (ties="decoded") and the finished requests' stats
        winner, by_eos = pick_winners(state, finished, self.early_stop, self.eos_rank == "widest", self.ties, decoded)
        req = finished.nonzero().squeeze(1)
        rows, eos_req = winner[req], by_eos[req]
        out = state.canvas[rows]
        if bool(eos_req.any()):
            out = torch.where(eos_req[:, None], fill_after_eos(out, state.gen_start, state.mask_id, pad_id), out)
        return Ending(finished, req, rows, eos_req, out, decoded)

    def retire(self, state: DecodeState, cache: BranchCache | None, ending: Ending, pad_id: int,
               before_drop: Callable[[], None]) -> bool:  # fmt: skip
        """Retire the ended requests' rows (dropping retired rows once they are half, after
        ``before_drop()`` has read what it needs of them); True when no request is left."""
        state.retire(ending.finished[state.request], pad_id)
        n_retired = int(state.retired.sum())
        if n_retired == state.num_rows:
            return True
        if 2 * n_retired >= state.num_rows:
            before_drop()
            keep = (~state.retired).nonzero().squeeze(1)
            state.select(keep)
            if cache is not None:
                cache.keep_rows(keep)
        return False
