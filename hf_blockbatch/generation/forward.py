"""The model calls of a step: which slots a step reads, and the packed forwards that produce them.

A *span* is, for each of a step's rows, a run of consecutive canvas positions (its window for a
block step; the generated region for a full forward that refreshes the probability map), padded
to the longest. Only the slots a step reads go through the model's head: greedy low-confidence
decoding reads the still-masked slots (nothing else is ever committed or read back from the
probability map), plus each row's first EOS slot in its window when EOS hitters are ranked at
completion (its probability picks a winner if the window completes). Stochastic decoding reads
every slot, so that the random draws follow the packed layout whatever the canvas holds; so does
a ``shared`` span (the initial forward: every slot is masked, and each request's proposals serve
all its branches).

Block steps also count, per row, the forwards that carried it and its *query tokens* (positions
fed through the model, padding excluded). They repeat one layout until a window moves, so they are
added up only before rows are dropped and at the end (:meth:`Forwards.flush`), never per step; full forwards
are known from each row's ``refreshes`` (see ``trace.Recorder.finished``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from hf_blockbatch.attention.metadata import packed_index
from hf_blockbatch.generation.state import DecodeState, canvas_positions, in_window

if TYPE_CHECKING:
    from hf_blockbatch.cache import BranchCache

__all__ = ["Forwards", "Span", "neighbourhood"]


def neighbourhood(marked: torch.Tensor, radius: int) -> torch.Tensor:
    """``[..., L]`` bool: the positions within ``radius`` of a marked one (the marked ones too). A
    sparse step re-queries these around the slots it reads (their K/V predate their neighbours'
    latest commits); :class:`~hf_blockbatch.generation.policies.lookahead.Lookahead` estimates a
    step's query tokens with the same rule."""
    flat = marked.reshape(-1, 1, marked.shape[-1]).float()
    return (F.max_pool1d(flat, 2 * radius + 1, stride=1, padding=radius) > 0).view(marked.shape)


@dataclass
class Span:
    """The slots a step reads: ``[A, W]`` positions of a span of each of its rows, padded."""

    rows: torch.Tensor  # [A] state rows
    positions: torch.Tensor  # [A, W] canvas positions (padded slots: L, a spare column)
    valid: torch.Tensor | None  # [A, W] real slots (None: all, the spans are uniform)
    in_win: torch.Tensor | None  # [A, W] slots inside the row's window (None: all)
    canvas: torch.Tensor  # the rows' canvases, with the spare column when padded
    current: torch.Tensor  # [A, W] what they hold at the slots
    masked: torch.Tensor  # [A, W] still masked
    keep: torch.Tensor | None  # [A, W] slots whose logits the step reads (None: every real slot)

    @property
    def read(self) -> torch.Tensor | None:
        """``[A, W]`` slots whose logits the step reads; ``None``: every slot."""
        return self.keep if self.keep is not None else self.valid


class Forwards:
    """Builds spans over a state and runs the model's full and window forwards on them, timed apart
    from the policy."""

    def __init__(self, model: Any, state: DecodeState, cache: BranchCache | None, cache_mode: str, pad_id: int,
                 eos_ids: torch.Tensor, masked_only: bool, eos_slot: bool, requery_radius: int = 0,
                 draft_depth: int = 0, draft_radius: int | None = None) -> None:  # fmt: skip
        """Read the state's geometry and allocate the column offsets that every step slices (never re-allocated)."""
        self.requery_radius = requery_radius
        self.draft_radius = draft_radius  # draft rows' own re-query radius (Lookahead.draft_radius; None: r)
        self.draft_depth = draft_depth  # lookahead with sparse steps: the longest chain of drafts
        self.drafting = True  # some draft row rides in the next step (Lookahead.draft sets it each step)
        self.model, self.cache, self.cache_mode, self.pad_id, self.eos_ids = model, cache, cache_mode, pad_id, eos_ids
        self.masked_only, self.eos_slot = masked_only, eos_slot
        self.L, self.gs = state.length, state.gen_start
        self.mask_id = state.mask_id
        self.mask_logits = bool(getattr(model, "supports_logits_mask", False))
        self.cuda = state.canvas.device.type == "cuda"  # read once: `model.device` walks the module tree
        self.seconds = 0.0
        self.in_forward = False
        self._events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        # column offsets, sliced by every step (never re-allocated): spans are at most L long, and
        # they also index the <= R rows of a step (the canvas positions are the cached range itself)
        self.offsets = canvas_positions(max(self.L, state.num_rows) + 1, state.canvas.device)
        self._layouts: list[list] = []  # [rows, query lengths, block steps] since the last flush

    # ------------------------------------------------------------------ timing and counting
    def timed(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """A model forward, timed apart from the policy. On CUDA by a pair of events read once the
        run ends, so timing never stalls the host (a synchronize around every forward would stop
        the CPU from queueing the forward's kernels while the policy's still run). ``in_forward``
        stays true when the forward raises: an error message can say where decoding failed."""
        self.in_forward = True
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = fn(*args, **kwargs)
            end.record()
            self._events.append((start, end))
        else:
            t = time.perf_counter()
            out = fn(*args, **kwargs)
            self.seconds += time.perf_counter() - t
        self.in_forward = False
        return out

    def forward_seconds(self) -> float:
        """Seconds the model forwards took so far. On CUDA it synchronizes to read the events: call
        it once, when the run ends."""
        if self.cuda:  # the call's wall time includes its last kernels; then the events can be read
            torch.cuda.synchronize()
            return sum(a.elapsed_time(b) for a, b in self._events) / 1000
        return self.seconds

    def new_layout(self, rows: torch.Tensor, lengths: torch.Tensor) -> None:
        """Block steps from now on carry ``rows``, feeding ``lengths`` positions of each (until the
        next layout: rows and windows stay the same until a window moves)."""
        self._layouts.append([rows, lengths, 0])

    def block_step(self) -> None:
        """One more block step of the current layout (added to the rows' counts by :meth:`flush`)."""
        self._layouts[-1][2] += 1

    def flush(self, state: DecodeState) -> None:
        """Add the block steps of the layouts since the last flush to the rows' counts: a fixed
        handful of operations, whatever the number of layouts. Call it before rows are dropped
        or their counts are read."""
        layouts = [tuple(lay) for lay in self._layouts if lay[2]]
        self._layouts = [[*self._layouts[-1][:2], 0]] if self._layouts else []  # the current one goes on
        if not layouts:
            return
        rows = torch.cat([lay[0] for lay in layouts])
        steps = torch.tensor([lay[2] for lay in layouts], device=rows.device)
        steps = steps.repeat_interleave(torch.tensor([lay[0].shape[0] for lay in layouts], device=rows.device))
        state.block_forwards.index_add_(0, rows, steps)
        state.block_queries.index_add_(0, rows, torch.cat([lay[1] for lay in layouts]) * steps)

    # ------------------------------------------------------------------ spans
    def layout(self, starts: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(positions [A, W], valid [A, W] | None)`` of the slots ``[start, start + length)`` of
        each row, padded to the longest (padded slots point at ``L``, a spare column; ``valid``
        is ``None`` when every span has the same length)."""
        shortest, W = torch.stack(torch.aminmax(lengths)).tolist()
        positions = starts[:, None] + self.offsets[:W]
        valid = None
        if shortest != W:
            valid = self.offsets[:W] < lengths[:, None]
            positions = positions.masked_fill(~valid, self.L)
        return positions, valid

    def span(self, state: DecodeState, rows: torch.Tensor, layout: tuple[torch.Tensor, torch.Tensor | None],
             window_only: bool, shared: bool = False) -> Span:  # fmt: skip
        """The slots of a :meth:`layout` of each row and what the rows' canvases hold there;
        ``window_only`` says the spans are exactly the rows' windows."""
        positions, valid = layout
        canvas = state.take(state.canvas, rows)
        if valid is not None:  # the spare column: never masked
            canvas = torch.cat([canvas, canvas.new_full((rows.shape[0], 1), self.pad_id)], dim=1)
        current = canvas.gather(1, positions)
        masked = current == self.mask_id
        in_win = valid
        if not window_only:
            ws, we = state.take(state.win_start, rows), state.take(state.win_end, rows)
            in_win = in_window(positions, ws, we)
            if valid is not None:
                in_win &= valid
        keep = None
        if self.masked_only and not shared:
            keep = masked
            if self.eos_slot:
                is_eos = torch.isin(current, self.eos_ids)
                if in_win is not None:
                    is_eos &= in_win
                first = is_eos.byte().argmax(-1, keepdim=True)
                keep = keep.scatter(1, first, is_eos.gather(1, first) | masked.gather(1, first))
        return Span(rows, positions, valid, in_win, canvas, current, masked, keep)

    # ------------------------------------------------------------------ forwards
    def full(self, state: DecodeState, span: Span, write_cache: bool) -> torch.Tensor:
        """Full forward over the span's rows; returns the packed logits predicting the slots it reads."""
        rows, read = span.rows, span.read
        want = torch.zeros(rows.shape[0], self.L + 1, dtype=torch.bool, device=rows.device)
        # a padded slot points at L, which is L - 1 for a shifted model: a hidden state that predicts
        # no position of the canvas, so no real slot shares it
        want.scatter_(1, span.positions - self.model.logit_shift, True if read is None else read)
        want = want[:, : self.L]
        kwargs = {"logits_mask": want} if self.mask_logits else {}
        out = self.timed(self.model, state.canvas[rows], attention_mask=state.attention_mask[rows],
                         cache=self.cache if write_cache else None, cache_rows=rows if write_cache else None,
                         **kwargs)  # fmt: skip
        if write_cache:
            state.kv_written(rows)
        return out.logits if self.mask_logits else out.logits[want]

    def windows(self, state: DecodeState, span: Span, starts: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
        """Window forward over the span's rows (dual: queries are the windows; prefix: they run to
        the end of the canvas); returns the packed logits predicting the slots it reads."""
        rows, read = span.rows, span.read
        if self.cache_mode == "dual":
            q_end = ends
            pick = None if read is None else (read.reshape(-1) if span.valid is None else read[span.valid])
        else:  # prefix: each row's packed queries are [start, L); the span is their first `length`
            q_end = torch.full_like(ends, self.L)
            q_len = self.L - starts
            Wq = int(q_len.max())
            sel = torch.zeros(rows.shape[0], Wq, dtype=torch.bool, device=rows.device)
            sel[:, : span.positions.shape[1]] = True if read is None else read
            pick = sel[self.offsets[:Wq] < q_len[:, None]]
        kwargs = {"logits_mask": pick} if self.mask_logits and pick is not None else {}
        out = self.timed(self.model.forward_windows, state.canvas, starts, q_end, self.cache, rows=rows, **kwargs)
        return out.logits if kwargs or pick is None else out.logits[pick]

    def positions(self, state: DecodeState, span: Span) -> torch.Tensor:
        """Sparse block step (``window_queries="sparse"``, dual cache). Inside each row's window it
        queries the slots the step reads, the masks, the decoded positions whose cached K/V are stale
        (committed after their K/V were written) and, with ``requery_radius`` r, the decoded positions
        within r of a read slot (their K/V predate their neighbours' latest commits, and the read slots
        attend to them most); every other position's K/V stay as the cache holds them. Returns the
        packed logits of the read slots, as :meth:`windows` does, and counts each row's query tokens
        for this step (the layout changes every step).

        With lookahead (``draft_depth`` > 0), a draft row stands for its parent's *next* step: its
        queries are chosen against the K/V its parent's cache will hold after this forward, and it
        receives the parent's fresh K/V as cached ones (:meth:`_draft_records`)."""
        rows, read = span.rows, span.read
        want = torch.zeros(rows.shape[0], self.L + 1, dtype=torch.bool, device=rows.device)
        want.scatter_(1, span.positions, True if read is None else read)
        want = want[:, : self.L]
        ws, we = state.take(state.win_start, rows), state.take(state.win_end, rows)
        in_win = in_window(canvas_positions(self.L, rows.device), ws, we)
        near = None  # the decoded positions within r of a read slot

        def within(radius: int) -> torch.Tensor:  # [A, L] window positions within ``radius`` of a read slot
            return in_win & neighbourhood(want, radius)

        if self.requery_radius:
            r, rd = self.requery_radius, self.draft_radius
            near = within(r)
            if rd is not None and rd < r and self.draft_depth and self.drafting:  # drafts re-query closer in
                near = torch.where(state.take(state.draft_row, rows)[:, None], within(rd), near)
        heads = self.model.predicting_queries(want)
        always = heads if near is None else heads | near  # queried whatever the K/V records say
        # the rows' canvases, which nothing changes before the step commits (taken once: drafts ask again)
        canvas = state.take(state.canvas, rows)
        written = state.kv_record(canvas)  # the records this step's forward leaves where it queries

        def queried(records: torch.Tensor | None = None) -> torch.Tensor:  # [A, L] the positions each row queries
            # by its K/V records (``records``: the rows' ``kv_tokens``, when the caller holds them):
            # masks (recorded as -1) and tokens committed since their K/V
            return always | (state.stale_kv(rows, canvas, records) & in_win)

        queries, echo = queried(), None
        if self.draft_depth and self.drafting:
            queries, echo = self._draft_records(state, rows, queries, queried, written)
        out = self.timed(self.model.forward_positions, state.canvas, want, queries, self.cache, rows=rows, echo=echo)
        state.kv_written(rows, out.query_mask, written)
        if self.draft_depth:
            self._mark_dirty(state, rows, out.query_mask, echo)
        self._layouts.append([rows, out.query_mask.sum(-1), 1])
        return out.logits

    def _draft_records(self, state: DecodeState, rows: torch.Tensor, queries: torch.Tensor,
                       queried: Callable[[torch.Tensor], torch.Tensor],
                       written: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """Lookahead's draft rows in a sparse step. A draft row stands for its parent's next step (its
        main row's, or in a chain another draft's), so its cache must read as the parent's will after
        this forward: its K/V records become the parent's, updated with the parent's queries (then its
        own queries follow from them), and every position it does not query takes the K/V of the
        nearest ancestor that queries it (``forward_positions``' ``echo``). Chains resolve in
        ``draft_depth`` rounds, a level each. ``queried(records)``: the rows' queries by K/V records; ``written``:
        the rows' :meth:`DecodeState.kv_record` of their canvases. Returns ``(queries, echo)``."""
        A = rows.shape[0]
        local = torch.full((state.num_rows,), -1, dtype=torch.long, device=rows.device)
        local[rows] = self.offsets[:A]
        up = state.take(state.draft_parent, rows)  # the parent's branch, -1 for main rows
        draft = up >= 0
        first = rows - state.take(state.branch, rows)  # each row's main row
        parent = local[first + up.clamp_min(0)].clamp_min(0)  # a live draft's parent steps
        # (no copy: each round builds new records before writing them back)
        records = state.take(state.kv_tokens, rows)
        echo = torch.full_like(records, -1)
        # what the rounds read and do not change, built once
        is_draft, from_parent, parent_col = draft[:, None], written[parent], parent[:, None]
        # a level per round; when no draft in the step extends another draft, one round resolves them all
        # (a root draft's parent is a main row, whose records and queries the rounds do not change)
        depth = self.draft_depth if self.draft_depth > 1 and bool((up > 0).any()) else 1
        for _ in range(depth):
            took = queries[parent]
            records = torch.where(is_draft, torch.where(took, from_parent, records[parent]), records)
            via = torch.where(took, parent_col, echo[parent])
            state.kv_tokens[rows] = records
            queries = queried(records)
            echo = torch.where(is_draft & ~queries, via, -1)
        # a draft row's cache differs from its main row's where it wrote its own K/V before (kv_dirty);
        # what this step neither queries nor echoes there is taken back from the main row, which does
        # not write it in this forward (most of it is queried again: the masks and their neighbours)
        restore = state.take(state.kv_dirty, rows) & draft[:, None] & ~queries & (echo < 0)
        self.cache.copy_positions(first, rows, restore)
        return queries, echo

    @staticmethod
    def _mark_dirty(state: DecodeState, rows: torch.Tensor, queries: torch.Tensor, echo: torch.Tensor | None) -> None:
        """After a sparse step with lookahead: where each draft row's cache now differs from its main
        row's (``state.kv_dirty``). A draft row that stepped differs at its own queries and where a
        draft ancestor's K/V were echoed into it (everything else was its main row's for the step:
        taken back, echoed, or never different); a parked one also misses every position its main
        row wrote."""
        R = state.num_rows
        wrote = torch.zeros(R, state.length, dtype=torch.bool, device=rows.device)
        own = queries
        if echo is not None:  # echoes from draft ancestors (main rows' echoes match the main row)
            own = own | ((echo >= 0) & state.take(state.draft_row, rows)[echo.clamp_min(0)])
        wrote[rows] = own
        wrote, dirty = state.per_request(wrote), state.per_request(state.kv_dirty)
        if echo is None:  # no draft row rode (echo is None exactly then): every one is parked
            dirty[:, 1:] |= wrote[:, :1]
            return
        stepped = torch.zeros(R, dtype=torch.bool, device=rows.device)
        stepped[rows] = True
        stepped = state.per_request(stepped)
        dirty[:, 1:] = torch.where(stepped[:, 1:, None], wrote[:, 1:], dirty[:, 1:] | wrote[:, :1])

    def slots(self, valid: torch.Tensor | None, A: int, W: int) -> torch.Tensor:
        """``[A, W]`` row of the packed logits for each slot when every slot is read: ``a * W + w``
        for uniform spans, else counted over the real slots (padded slots: 0)."""
        if valid is None:
            return torch.arange(A * W, device=self.offsets.device).view(A, W)
        return packed_index(valid)
