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
  its main row's K/V outside the window: copied from the main row (``kv_from``) when the row carries
  a draft after a forward that rewrote the main row (the initial forward or a refresh), not before:
  many requests end or refresh before they draft. The initial forward and the refreshes are the main
  rows' alone, and fill the probability map inside the window only (all that :meth:`Lookahead.draft`
  reads);
* sparse window queries: the step a draft stands for reuses its parent's K/V *as cached after this
  forward*; the draft's K/V records are set to those (``Forwards._draft_records``), the parent's
  fresh K/V are echoed into the draft's cache row before attention (``forward_positions(echo=...)``),
  a draft row takes back its main row's K/V where it differs and the step does not rewrite them
  (``kv_dirty``, ``BranchCache.copy_positions``), and an adopted draft hands its K/V and records
  over; a draft is adopted only as its parent's next step (``draft_parent``: ``(0, 1)`` extends
  ``(0,)``), so chains follow parents;
* exactness: adoption compares whole canvases (``drafted`` == the main row's canvas after its
  commit). A draft keeps a mask in the window, so a canvas equal to it does too: the decoder
  without drafts passes through that canvas and runs a block step on it next (advance, stop and
  refresh all need a completed window), and that block step is the draft's.

* sampling (``temperature`` > 0): the same argument, in distribution. Which draft is adopted depends
  only on the main row's sampled commit and on the drafted canvases (built from the probability map
  before the step); the adopted draft's own commit is drawn with its own noise, independent of both.
  So, given the canvas it stands for, that commit is a draw of the next step's commit as the decoder
  without drafts makes it: the decoded sequences have the same distribution, not the same samples for
  a generator's seed (the draft rows' noise shifts the random stream). With keyed noise (``seed``,
  :mod:`hf_blockbatch.generation.noise`) a draft row draws the noise of the step it stands for (its main
  row's step count plus its depth), and an adopted draft hands its count over; a draft is then adopted only as
  its parent's next step (as with sparse steps), since one adopted sooner drew a later step's noise. So the
  samples are the decoder's own, with dense steps as with sparse ones. A committed token needs a confidence of at
  least the threshold, so above 0.5 it is the top token the draft guessed; drafts miss more often the
  hotter the sampling (a lone commit below the threshold may be any sampled token).

* ``accept="contained"`` (``FastDLLMConfig(lookahead_accept="contained")``): a step that commits
  the drafted tokens *and more* holds no draft's canvas exactly, yet the draft's forward saw a context
  the main row has now decoded, plus masks where the main row committed more. The main row then
  keeps its own commit and takes the draft's commits at the positions it left masked: tokens that
  a forward rated above the rule's threshold without seeing the main row's extra commits, as the
  transfer rule's own parallel commits never see each other. Adopted only while a mask is left in
  the window (a block step follows), or when the merge is the draft's own canvas (the step's
  completion and EOS checks ran on it); never when the main row's step completed its window. Not
  the decoder's tokens any more (a documented departure, measured in benchmarks/RESULTS.md §16);
  every other invariant holds: prompt untouched, a committed token never changes, no mask before
  EOS, exact NFE, a padded batch decodes each request as alone.

Counted: NFE as always (one per forward carrying the request); ``stats["lookahead_adopted"]``, the
block steps saved, so that NFE without drafts = NFE + adopted, exactly (with ``exact`` acceptance).

See docs/algorithm.md, "Lookahead branches".
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from hf_blockbatch.generation.forward import neighbourhood
from hf_blockbatch.generation.policies import StepContext
from hf_blockbatch.generation.state import DecodeState, canvas_positions, in_window

if TYPE_CHECKING:
    from hf_blockbatch.generation.engine import Run

__all__ = ["DRAFT_SHAPES", "Lookahead"]

#: what draft ``j`` commits: ranks of the main row's remaining window masks by confidence, in the
#: order they were adopted on training items (``benchmarks/lookahead_shapes.py``, RESULTS §12): most
#: adopted steps commit one token, the next most confident (rank 0) or the one after it (rank 1);
#: (0, 1) chains two of them.
DRAFT_SHAPES: tuple[tuple[int, ...], ...] = ((0,), (1,), (0, 1), (0, 1, 2), (2,), (1, 2))

#: what a main row takes from the draft it adopts (``kv_tokens`` exists with sparse steps only), beside the canvas,
#: which :meth:`Lookahead.apply` writes from the adoption's own comparison (a contained merge is not a draft's canvas).
#: Not ``commit_prob``: only BlockBatch plans keep it (a "commit" EOS rank, a merge's source confidence), and drafts
#: ride Fast-dLLM plans only
_COPIED = ("prob_p", "prob_ids", "eos_hit", "eos_prob", "kv_tokens", "steps", "runner_p", "runner_ids")


def _need(shape: tuple[int, ...]) -> int:
    """Open masks a draft of ``shape`` needs: its ranks, and one left over (a draft that fills the window stands in
    for no block step)."""
    return max(max(shape) + 1, len(shape) + 1)


def _park(s: DecodeState) -> None:
    """Every draft row out of the steps (pruned-like and done) until the next draft."""
    s.pruned.masked_fill_(s.draft_row, True)
    s.done.masked_fill_(s.draft_row, True)


def _parents(drafts: int) -> list[int]:
    """The branch each draft extends: the draft holding its shape without its last rank, when one of
    the first ``drafts`` does ((0, 1) extends (0,)), else the main row (0)."""
    shapes = DRAFT_SHAPES[:drafts]
    return [shapes.index(s[:-1]) + 1 if s[:-1] in shapes else 0 for s in shapes]


def _depths(drafts: int) -> list[int]:
    """Each draft's place in its chain: 1 for a draft of the main row's next state, its parent's + 1 for a draft
    of a draft; also how many steps ahead of its main row it stands (so it draws that step's keyed noise)."""
    depth = [0]
    for p in _parents(drafts):
        depth.append(depth[p] + 1)
    return depth[1:]


@functools.cache
def _steps_ahead(drafts: int, device: torch.device) -> torch.Tensor:
    """``[K]`` :func:`_depths` as a tensor, built once per device."""
    return torch.tensor(_depths(drafts), device=device)


@functools.cache
def _shapes(drafts: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``[K, S]`` bool: rank r in draft j; ``[K]``: open masks a draft needs (its ranks, and one left
    over: a draft that fills the window stands in for no block step); ``[K]``: its parent's branch;
    ``[K]``: ``1..K``, each draft's branch, which is also the number of drafts up to it (a query budget
    counts them). Built once per device."""
    shapes = DRAFT_SHAPES[:drafts]
    ranks = torch.zeros(len(shapes), 1 + max(max(s) for s in shapes), dtype=torch.bool)
    for j, shape in enumerate(shapes):
        ranks[j, list(shape)] = True
    need = torch.tensor([_need(shape) for shape in shapes])
    count = torch.arange(1, len(shapes) + 1, device=device)
    return ranks.to(device), need.to(device), torch.tensor(_parents(drafts), device=device), count


@dataclass(frozen=True)
class Lookahead:
    """``drafts`` draft rows per request, shaped by the first ``drafts`` entries of :data:`DRAFT_SHAPES`;
    drafted only while the main row's window has at most ``max_masks`` masks left (``None``: always)."""

    drafts: int = 2
    max_masks: int | None = None
    #: ``"exact"``: adopt a draft whose canvas is the main row's after its commit (the tokens are the
    #: decoder's without drafts). ``"contained"``: also one whose drafted tokens the main row's commit
    #: holds, when it committed more; the main row keeps its own commit and adds what the draft
    #: committed elsewhere, so long as a mask is left in the window (see :meth:`apply`)
    accept: str = "exact"
    #: with sparse steps and contained acceptance: a draft re-queries the decoded neighbours of its masks
    #: within this radius only (``None``: the plan's re-query radius, as the next sparse step would);
    #: beyond it, where its parent re-queries one in the same forward it reads the parent's fresh K/V
    #: (the echo), elsewhere its cached K/V: fewer query tokens per draft, for neighbours one step
    #: staler than the next sparse step's (RESULTS §16)
    draft_radius: int | None = None
    #: a request's step with drafts queries about at most this many of its windows' widths in all
    #: (``None``: no limit). Drafts are admitted in order while the estimate fits: the main row's
    #: masks and the positions within its re-query radius of them, then per draft the same at the
    #: draft's radius (a dense step: one window per row). Cheap drafts (few masks, a small radius)
    #: ride; expensive ones wait until the window has fewer masks (RESULTS §17)
    query_budget: float | None = None
    #: a draft row whose shape needs more masks than the window has left (``(0, 1)`` with 2 masks left) drafts,
    #: instead, the runner-up token of a mask: the most probable token after the map's, at the masks in order of
    #: that token's probability (:func:`~hf_blockbatch.generation.commit.note_runner_ups`). The step's likeliest
    #: other single commit, in a row that would otherwise be parked (RESULTS §49)
    runner_up: bool = False

    @property
    def needs(self) -> tuple[str, ...]:
        """The state's optional tensors this policy reads (``DecodeState.features``)."""
        return ("pruned", "lookahead", "runner_up") if self.runner_up else ("pruned", "lookahead")

    @functools.cached_property
    def spare_masks(self) -> int:
        """The most open masks at which some draft's shape cannot ride (its row is spare): 0 without runner-up
        drafts, and with fewer than three drafts (every shape then rides whenever a draft can). Read every step: built
        once."""
        most = max(_need(shape) for shape in DRAFT_SHAPES[: self.drafts]) - 1
        return most if self.runner_up and most >= 2 else 0

    @property
    def depth(self) -> int:
        """The longest chain of drafts, each extending the one before (sparse steps resolve a draft's
        K/V a level at a time)."""
        return max(_depths(self.drafts))

    def draft(self, run: Run) -> bool:
        """Before a block step: write each live request's drafts into its draft rows, park the
        rest, and give drafts whose main row was refreshed since their last copy its K/V. Returns
        whether the rows the step carries changed since the previous draft (else the engine keeps
        its step layout). Works on ``[requests, branches, ...]`` views: branch 0 is the main row."""
        s = run.state
        ranks, need, parents, count = _shapes(self.drafts, s.canvas.device)
        L, gs, S = s.length, s.gen_start, ranks.shape[1]
        canvas = s.per_request(s.canvas)  # [B, N, L]
        main = canvas[:, 0]
        ws, we = s.main_rows(s.win_start), s.main_rows(s.win_end)
        in_win = in_window(canvas_positions(L, main.device), ws, we)  # [B, L]
        ws, we = ws[:, None], we[:, None]  # [B, 1]
        open_ = (main == s.mask_id) & in_win
        # a draft needs its ranks and one mask left over; a finished request (done) drafts nothing;
        # a window with many masks left commits several next, which a draft of one or two rarely is
        n_open = open_.sum(-1, keepdim=True)
        live = ~s.per_request(s.done)[:, :1]  # [B, 1]
        if self.max_masks is not None:
            live = live & (n_open <= self.max_masks)
        fits = n_open >= need
        valid = live & fits  # [B, K]
        # runner-up drafts: a row whose shape does not fit, while 2 masks or more are left
        spare = self._spare(s, open_, live & ~fits & (n_open >= 2)) if self.spare_masks else None
        if spare is not None:
            valid |= spare[0]
        run.fwd.drafting = bool(valid.any())
        # the budget's estimate only where a draft may ride (most steps of a wide window have none)
        if run.fwd.drafting and self.query_budget is not None:
            valid &= self._affordable(run, open_, in_win, we - ws, count)
            run.fwd.drafting = bool(valid.any())
            if spare is not None:  # a spare row the budget parks drafts nothing
                spare = (spare[0] & valid, *spare[1:])
        was = s.per_request(s.draft_parked)[:, 1:]
        if not run.fwd.drafting:  # no draft this step: every draft row parked (pruned-like: no decision reads a
            # parked row's canvas; the next draft rewrites it), mirroring its main row when it is parked anew
            if bool(was.all()):  # parked since the last step: nothing to do
                return False
            canvas[:, 1:] = main[:, None]
            _park(s)
            was.fill_(True)
            return True
        conf = s.per_request(s.prob_p)[:, 0, :, 0].masked_fill(~open_[:, gs:], float("-inf"))  # [B, G]
        order = conf.topk(min(S, L - gs), dim=-1).indices  # [B, S] generated positions, best first
        if order.shape[1] < S:  # a canvas shorter than the widest draft: those ranks never exist
            order = torch.cat([order, order[:, :1].expand(-1, S - order.shape[1])], dim=1)
        # (a parent needs no more masks than its child: a valid draft's parent is valid; a spare row drafts the main
        # row's next step, as does a spare row's child, which is spare too)
        ahead = _steps_ahead(self.drafts, valid.device)
        shaped = valid
        if spare is not None:
            shaped = valid & ~spare[0]
            parents, ahead = parents.masked_fill(spare[0], 0), ahead.masked_fill(spare[0], 1)
        s.per_request(s.draft_parent)[:, 1:] = parents
        if s.steps is not None:  # keyed noise: a draft draws what the step it stands for would (noise.py)
            steps = s.per_request(s.steps)
            steps[:, 1:] = steps[:, :1] + ahead
        at = order + gs
        guessed = s.per_request(s.prob_ids)[:, 0, :, 0].gather(1, order)  # [B, S] top-1 tokens
        tokens = torch.where(shaped[:, :, None] & ranks, guessed[:, None], main.gather(1, at)[:, None])  # [B, K, S]
        drafts = canvas[:, 1:]
        drafts.copy_(main[:, None].expand_as(drafts))
        drafts.scatter_(2, at[:, None].expand_as(tokens), tokens)
        if spare is not None:  # a spare row: its runner-up token at its mask
            rides, where, token = spare
            where = where[:, :, None] + gs
            drafts.scatter_(2, where, torch.where(rides, token, drafts.gather(2, where)[:, :, 0])[:, :, None])
        s.per_request(s.drafted)[:, 1:] = drafts
        s.per_request(s.win_start)[:, 1:] = ws
        s.per_request(s.win_end)[:, 1:] = we
        parked = ~valid
        changed = not torch.equal(parked, was)
        was.copy_(parked)
        s.per_request(s.pruned)[:, 1:] = parked
        s.per_request(s.done)[:, 1:] = parked
        if run.cache is not None:
            kv_from, refreshes = s.per_request(s.kv_from), s.per_request(s.refreshes)
            stale = valid & (kv_from[:, 1:] != refreshes[:, :1])
            if bool(stale.any()):
                b, j = stale.nonzero().unbind(1)
                src, dst = b * s.branches, b * s.branches + 1 + j
                run.cache.copy_rows(src, dst, same_mask=True)
                s.kv_from[dst] = s.refreshes[src]
                if s.kv_dirty is not None:
                    s.kv_dirty[dst] = False
        return changed

    @staticmethod
    def _trace_adoptions(ctx: StepContext, s: DecodeState, rounds_taken: list[tuple[torch.Tensor, ...]],
                         start: torch.Tensor) -> None:
        """One ``SyncEvent`` of a main row to the draft it adopted, then a commit (phase ``adopt``) of the tokens
        that adoption gained, per round of the step's chain: a chain recorded as one sync to its last draft hid
        the forwards its earlier adoptions saved. The gained tokens are recorded as a commit because a replay
        cannot rebuild a draft's canvas (drafted tokens are written, not committed)."""
        at = canvas_positions(s.length, start.device)
        before = start
        for hit, source, canvas in rounds_taken:
            requests = hit.nonzero().squeeze(1)
            dst = requests * s.branches
            leaders = torch.arange(s.num_rows, device=dst.device).index_copy_(0, dst, dst + source[requests])
            synced = torch.zeros(s.num_rows, dtype=torch.bool, device=dst.device).index_fill_(0, dst, True)
            ctx.recorder.sync(s, synced, leaders)
            gained = canvas[requests] != before[requests]
            ctx.recorder.commit(s, dst, at.expand(dst.shape[0], -1), gained, "adopt")
            before = canvas

    @staticmethod
    def _main_completed(s: DecodeState) -> bool:
        """Whether some main row that is not done holds a window with no mask left (after this step's adoptions)."""
        left = s.main_rows(s.window_mask_count(s.win_start, s.win_end))
        return bool(((left == 0) & ~s.main_rows(s.done)).any())

    @staticmethod
    def _spare(s: DecodeState, open_: torch.Tensor,
               spare: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:  # fmt: skip
        """Runner-up drafts: ``([B, K] bool, [B, K], [B, K])``, which of the ``spare`` draft rows (``[B, K]``: their
        shape needs more masks than the window has left, and at least 2 are left) draft one (a runner-up token is
        known), the generated position of each row's mask and its token: a request's spare rows take its masks'
        runner-up tokens in order of their probability. ``None`` when no row drafts one."""
        if not bool(spare.any()):
            return None
        gs = s.gen_start
        ids = s.main_rows(s.runner_ids)  # [B, G] the main row's runner-ups
        p = s.main_rows(s.runner_p).masked_fill(~open_[:, gs:] | (ids < 0), -1.0)
        best = p.topk(min(spare.shape[1], p.shape[1]), dim=-1)  # [B, K'] masks by their runner-up's probability
        k = (spare.cumsum(-1) - 1).clamp(0, best.indices.shape[1] - 1)  # a spare row's place among its request's
        spare &= best.values.gather(1, k) > 0
        if not bool(spare.any()):
            return None
        where = best.indices.gather(1, k)
        return spare, where, ids.gather(1, where)

    def _affordable(self, run: Run, open_: torch.Tensor, in_win: torch.Tensor, width: torch.Tensor,
                    count: torch.Tensor) -> torch.Tensor:  # fmt: skip
        """``[B, K]``: whether the main row and drafts ``0..j`` (``count[j]`` of them) fit the request's
        query budget, by the rule a sparse step queries with (its masks, and the decoded positions within the re-query
        radius of them; a draft's radius for a draft). An estimate made before the step, from the
        main row's canvas: a draft's masks are its main row's but for its one to three drafted ones,
        which it re-queries anyway (their K/V predate their token)."""
        plan = run.plan
        if plan.sparse_queries:
            r = plan.requery_radius
            rd = r if self.draft_radius is None else self.draft_radius
            main = (neighbourhood(open_, r) & in_win).sum(-1, keepdim=True)  # [B, 1]
            each = main if rd == r else (neighbourhood(open_, rd) & in_win).sum(-1, keepdim=True)
        else:  # a dense step queries every row's whole window
            main = each = width
        return main + count * each <= self.query_budget * width

    def apply(self, ctx: StepContext) -> bool:
        """After a block step: the main row takes the state of the draft (chain) that held exactly
        its next canvas (``contained``: or whose drafted tokens its commit holds, keeping its own
        commit), then every draft row is parked.

        Returns False: an adoption moves no window itself. A main row's window is complete after one
        only when the adopted canvas is a draft's own after this step (exact, a chain's last draft, or a
        contained merge equal to it; one that leaves a mask completes nothing), and a draft keeps a mask
        when drafted, so that draft row completed its window in this step: the step's ``completed`` is
        true, and the :class:`Advance` policy after this one moves the window and ends the request or
        makes it due for a refresh. Saying True on every adoption cost a stop and refresh check each.

        Conversely, a step whose only completed windows are draft rows' (drafts the main rows did not adopt) moves
        nothing that matters: those rows are parked here, and the next draft rewrites their canvas and window from
        their main row's. So ``ctx.completed`` is narrowed to the main rows: the :class:`Advance` policy, the stop
        check and the refresh check then run only when a main row's window is complete (on tiny-dream lists at
        batch 1, 1.1 of the 2.1 completed block steps per item were drafts' alone)."""
        s = ctx.state
        live = ~s.per_request(s.pruned)[:, 1:]  # [B, K]
        if not bool(live.any()):  # no draft rode in this step: they are parked already
            return False
        if not ctx.full:
            B, K = live.shape
            canvas = s.per_request(s.canvas)
            current, after = canvas[:, 0], canvas[:, 1:]  # [B, L], [B, K, L]
            drafted = s.per_request(s.drafted)[:, 1:]
            source = torch.zeros(B, dtype=torch.long, device=live.device)  # branch whose state the main row takes
            took = torch.zeros_like(source)
            branch = _shapes(self.drafts, live.device)[3]  # each draft row's branch, 1..K
            # with sparse steps a draft's K/V are those its parent's row holds after this forward, and with
            # keyed noise it drew the noise of its parent's next step: it stands only for that step
            chained = s.kv_dirty is not None or s.steps is not None
            parents = s.per_request(s.draft_parent)[:, 1:] if chained else None
            contained = self.accept == "contained"
            if contained:  # what does not change along a chain, built once
                ws, we = s.main_rows(s.win_start), s.main_rows(s.win_end)
                in_win = in_window(canvas_positions(s.length, live.device), ws, we)  # [B, L] the main row's window
                written = drafted != s.mask_id  # [B, K, L] the drafted tokens (and the canvas they extend)
                open_after = (after == s.mask_id) & in_win[:, None]  # masks left in a draft's window
                size = written.sum(-1)
            # a chain adopts at most every draft once; with sparse steps, a level of parents at a time
            rounds = K if parents is None else self.depth
            cand = live if parents is None else live & (parents == 0)  # drafts that may stand for the next step
            hit, adopted = None, False  # which requests adopted a draft in the last round; whether any did
            # traced: each round's adoptions and the main rows' canvas before the first (a chain is several
            # adoptions); a copy, since ``current`` is a view of the canvas the adoption rewrites
            rounds_taken, start = [], current.clone() if ctx.recorder.tracing else None
            for level in range(rounds):
                if level:
                    # a request whose canvas did not move in the last round compares as it did then (no
                    # match); with sparse steps only the adopted draft's children stand for the next step.
                    # No candidate left ends the chain before any canvas is compared
                    cand = live & hit[:, None]
                    if parents is not None:
                        cand &= parents == source[:, None]
                    if not bool(cand.any()):
                        break
                # a draft keeps a mask in the window, so a canvas equal to it does too: a block step
                # follows it (nothing the decoder does between two steps needs checking)
                current_k = current[:, None]  # [B, 1, L] against each draft
                differ = drafted != current_k
                merged = after
                if not contained:
                    match = ~differ.any(-1)
                else:  # (a draft equal to the canvas is held, and the merge is its own canvas: no separate test)
                    # the main row committed the drafted tokens and more: it keeps its commit and
                    # takes the draft's commits elsewhere, while a mask stays in the window (so a block
                    # step follows, and no window completes that the step did not see complete) or
                    # the merge is the draft's own canvas (its completion and EOS checks stand)
                    blank = current == s.mask_id
                    step_left = blank & in_win  # the main row's window still holds a mask
                    blank_k = blank[:, None]
                    merged = torch.where(blank_k, after, current_k)
                    held = ~(differ & written).any(-1) & step_left.any(-1, keepdim=True)
                    open_left = (open_after & blank_k).any(-1)
                    own_canvas = ~(merged != after).any(-1)  # the merge is the draft's own canvas
                    match = held & (open_left | own_canvas)
                match &= cand
                hit = match.any(-1)
                if not bool(hit.any()):
                    break
                adopted = True
                # (several drafts can be contained: the one holding most drafted tokens, the first on a tie)
                j = (match * size).argmax(-1) if contained else match.byte().argmax(-1)
                current = torch.where(hit[:, None], merged[canvas_positions(B, j.device), j], current)  # (a cached arange)
                source = torch.where(hit, j + 1, source)
                took += hit
                if ctx.recorder.tracing:
                    rounds_taken.append((hit, j + 1, current))
                if level + 1 < rounds:  # the adopted draft leaves the candidates
                    live = live & (branch != (j + 1).masked_fill(~hit, 0)[:, None])
            if adopted:
                requests = source.nonzero().squeeze(1)
                dst = requests * s.branches
                src = dst + source[requests]
                canvas, before = current[requests], s.canvas[dst]  # the main rows' canvas now (an adopted draft's, or a
                # contained merge) and before the adoption, which only fills masks: the tokens it gained
                gained = canvas != before
                s.copy_rows(src, dst, _COPIED)
                s.canvas[dst] = canvas
                if s.kv_dirty is not None:  # sparse: the draft's K/V are the main row's next ones
                    took_kv = s.kv_dirty[src]  # where the adopted draft differs from the main row
                    ctx.cache.copy_positions(src, dst, took_kv)
                    # the request's other drafts now differ from it there too; the adopted one nowhere
                    s.per_request(s.kv_dirty)[requests, 1:] |= took_kv[:, None]
                    s.kv_dirty[src] = False
                s.committed.index_add_(0, dst, gained.sum(-1))
                s.adopted.index_add_(0, dst, took[requests])
                if ctx.recorder.tracing:  # each adoption of a chain as a sync to its draft and the tokens it gained
                    self._trace_adoptions(ctx, s, rounds_taken, start)
            if ctx.completed:  # only a main row's complete window moves anything now (see the docstring)
                ctx.completed = self._main_completed(s)
        _park(s)
        s.eos_hit.masked_fill_(s.draft_row, False)
        return False
