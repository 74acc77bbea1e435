"""Lookahead branches: draft rows that run a request's *next* block step in the same forward, exactly.

Why (issue 16): BlockBatch's branches save forwards by merging what other block sizes committed,
and every such merge is a token that no forward of the destination's own context confirmed: the
saving is made of low-confidence tokens, and it costs accuracy where answers have several valid
forms. A branch can instead hold a *draft of the main row's next state*: the main row's canvas plus
the commit its next step is likely to make (the most confident remaining masks of its window, by
the probability map of its latest forward). The draft row is queried in the same packed forward as
the main row. After the step, the main row's own commit says what its next state really is; when a
draft held exactly that canvas, the draft's forward *is* the main row's next block step (same
tokens, same cached K/V outside the window, the window recomputed), so the main row takes the
draft's state after the draft's own commit and skips one forward. A draft that guessed wrong is
dropped. Drafts of drafts chain: a draft equal to an adopted draft's result is adopted in turn.

So the tokens decoded are those of the decoder without drafts (Fast-dLLM's own trajectory, up to
floating-point differences between a row computed alone and inside a larger batch), in fewer
forwards; what it costs is the draft rows' query tokens.

The parts:

* rows: each request has ``1 + drafts`` rows of the same block size; branch 0 is the main row (the
  answer: draft rows are pruned-like, ``DecodeState.pruned``, so they never win, end a request or
  get refreshed); draft rows take part only in block steps that carry a draft (:meth:`Lookahead.draft`,
  called by the engine before each block step) and are parked after it (:meth:`Lookahead.apply`);
* draft ``j`` commits the ranks ``DRAFT_SHAPES[j]`` of the main row's remaining window masks
  (rank 0: the most confident) with their top-1 tokens; a draft that would fill the window, or
  needs more masks than remain, is parked (a step that completes the window is followed by a
  refresh, not by a block step a draft could stand in for);
* cache: dense window queries recompute a row's whole window each step, so a draft row needs only
  its main row's K/V outside the window: copied from the main row after every refresh of it
  (``kv_from``); the initial forward broadcasts them to every row;
* exactness: adoption compares whole canvases (``drafted`` == the main row's canvas after its
  commit). A draft keeps a mask in the window, so a canvas equal to it does too: the decoder
  without drafts passes through that canvas and runs a block step on it next (advance, stop and
  refresh all need a completed window), and that block step is the draft's.

Counted: NFE as always (one per forward carrying the request); ``stats["lookahead_adopted"]``, the
block steps saved, so that NFE without drafts = NFE + adopted, exactly.

See docs/algorithm.md, "Lookahead branches".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch

from hf_blockbatch.generation.policies import StepContext
from hf_blockbatch.generation.state import DecodeState

if TYPE_CHECKING:
    from hf_blockbatch.generation.engine import Run

__all__ = ["DRAFT_SHAPES", "Lookahead"]

#: what draft ``j`` commits: ranks of the main row's remaining window masks by confidence. Chosen by
#: replaying Fast-dLLM's steps on training items (benchmarks/RESULTS.md §12): most steps commit one
#: token, the next most confident (rank 0) or the one after it (rank 1); (0, 1) chains two of them.
DRAFT_SHAPES: tuple[tuple[int, ...], ...] = ((0,), (1,), (0, 1), (0, 1, 2), (2,), (1, 2))

_COPIED = ("canvas", "prob_p", "prob_ids", "eos_hit", "eos_prob", "commit_prob")


@dataclass(frozen=True)
class Lookahead:
    """``drafts`` draft rows per request, shaped by the first ``drafts`` entries of :data:`DRAFT_SHAPES`."""

    needs: ClassVar[tuple[str, ...]] = ("pruned", "lookahead")

    drafts: int = 2

    def _rows(self, state: DecodeState) -> tuple[torch.Tensor, torch.Tensor]:
        """``(main [B], drafts [B, K])`` row indices."""
        main = state.first_rows()
        return main, main[:, None] + torch.arange(1, state.branches, device=main.device)

    def _shapes(self, device) -> tuple[torch.Tensor, torch.Tensor]:
        """``[K, S]`` bool: rank r in draft j; ``[K]``: open masks a draft needs (its ranks, and one
        left over: a draft that fills the window stands in for no block step)."""
        shapes = DRAFT_SHAPES[: self.drafts]
        width = 1 + max(max(s) for s in shapes)
        ranks = torch.zeros(len(shapes), width, dtype=torch.bool)
        for j, s in enumerate(shapes):
            ranks[j, list(s)] = True
        need = torch.tensor([max(max(s) + 1, len(s) + 1) for s in shapes])
        return ranks.to(device), need.to(device)

    def draft(self, run: Run) -> None:
        """Before a block step: write each live request's drafts into its draft rows, park the
        rest, and give drafts whose main row was refreshed since their last copy its K/V."""
        s = run.state
        main, drafts = self._rows(s)
        B, K = drafts.shape
        L, gs = s.length, s.gen_start
        ranks, need = self._shapes(main.device)
        S = ranks.shape[1]
        canvas = s.canvas[main]  # [B, L]
        ws, we = s.win_start[main], s.win_end[main]
        pos = torch.arange(L, device=main.device)
        open_ = (canvas == s.mask_id) & (pos >= ws[:, None]) & (pos < we[:, None])
        conf = torch.where(open_[:, gs:], s.prob_p[main, :, 0], float("-inf"))  # [B, G]
        order = conf.topk(min(S, L - gs), dim=-1).indices  # [B, S] generated positions, best first
        if order.shape[1] < S:  # a canvas shorter than the widest draft: those ranks never exist
            order = torch.cat([order, order[:, :1].expand(B, S - order.shape[1])], dim=1)
        n_open = open_.sum(-1)
        live = ~s.done[main] & ~s.retired[main]
        valid = live[:, None] & (n_open[:, None] >= need[None])  # [B, K]
        at = order + gs
        tokens = torch.where(ranks[None], s.prob_ids[main[:, None], order, 0][:, None], canvas.gather(1, at)[:, None])
        new = canvas[:, None].expand(B, K, L).clone()
        new.scatter_(2, at[:, None].expand(B, K, S), tokens)  # [B, K, L]
        new = torch.where(valid[:, :, None], new, canvas[:, None])  # a parked draft mirrors its main row
        flat = drafts.reshape(-1)
        s.canvas[flat] = s.drafted[flat] = new.view(B * K, L)
        s.win_start[flat], s.win_end[flat] = ws.repeat_interleave(K), we.repeat_interleave(K)
        parked = ~valid.view(-1)
        s.pruned[flat] = parked
        s.done[flat] = parked
        if run.cache is not None:
            src = main.repeat_interleave(K)
            stale = ~parked & (s.kv_from[flat] != s.refreshes[src])
            if bool(stale.any()):
                dst, src = flat[stale], src[stale]
                run.cache.copy_rows(src, dst, same_mask=True)
                s.kv_from[dst] = s.refreshes[src]

    def apply(self, ctx: StepContext) -> bool:
        """After a block step: the main row takes the state of the draft (chain) that held exactly
        its next canvas, then every draft row is parked. Returns whether a window may have moved."""
        s = ctx.state
        main, drafts = self._rows(s)
        B, K = drafts.shape
        live = ~s.pruned[drafts]
        adopted = False
        if not ctx.full and bool(live.any()):
            current = s.canvas[main]
            drafted, after = s.drafted[drafts], s.canvas[drafts]  # [B, K, L]
            src = main.clone()
            took = torch.zeros(B, dtype=torch.long, device=main.device)
            for _ in range(K):  # a chain adopts at most every draft once
                # a draft keeps a mask in the window, so a canvas equal to it does too: a block step
                # follows it (nothing the decoder does between two steps needs checking)
                match = live & (drafted == current[:, None]).all(-1)
                hit = match.any(-1)
                if not bool(hit.any()):
                    break
                j = match.byte().argmax(-1)
                current = torch.where(hit[:, None], after[torch.arange(B, device=main.device), j], current)
                src = torch.where(hit, drafts.gather(1, j[:, None]).squeeze(1), src)
                live = live & ~(hit[:, None] & (torch.arange(K, device=main.device) == j[:, None]))
                took += hit
            moved = src != main
            if bool(moved.any()):
                dst, src = main[moved], src[moved]
                before = s.decoded()[dst]
                leaders = torch.arange(s.num_rows, device=main.device)
                leaders[dst] = src
                s.copy_rows(src, dst, _COPIED)
                s.committed.index_add_(0, dst, s.decoded()[dst] - before)
                s.adopted.index_add_(0, dst, took[moved])
                synced = torch.zeros(s.num_rows, dtype=torch.bool, device=main.device)
                synced[dst] = True
                if ctx.recorder.tracing:
                    ctx.recorder.sync(s, synced, leaders)
                s.advance()
                adopted = True
        flat = drafts.reshape(-1)
        s.pruned[flat] = True
        s.done[flat] = True
        s.eos_hit[flat] = False
        return adopted
