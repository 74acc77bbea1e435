"""The model-agnostic decoding core shared by vanilla, Fast-dLLM and BlockBatch.

Each strategy is a :class:`DecodePlan` (branches, cache mode, transfer rule, policies); this
module runs any plan on any model that implements the forward contract of
:mod:`hf_blockbatch.models.base`. One step of the loop:

1. **block step**: one forward over the windows of every active row of every request (packed
   windows over the cache for ``dual``/``prefix``, a full forward for ``none``), computing logits
   only at the slots the step reads (see :meth:`_Run._span`); the transfer rule commits tokens,
   the probability map and EOS hits are updated;
2. **advance** windows (only once one completed), **merge** and **sync** (BlockBatch), then
3. **refresh** the rows that are due, in one batched full forward (Fast-dLLM's block-start
   forward is a refresh with ``refresh_interval = block_length``);
4. requests that finished leave the batch (retired at once; their rows are dropped from the
   state and the cache once half the rows are retired, see :meth:`_Run.finish`).

NFE is counted as the paper counts it: every forward call adds one to each request it carries.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from hf_blockbatch.attention.metadata import packed_index
from hf_blockbatch.cache import reuse_storage
from hf_blockbatch.generation import stop as stop_mod
from hf_blockbatch.generation.blockbatch.merge import merge
from hf_blockbatch.generation.blockbatch.sync import leaders, sync_to_leader
from hf_blockbatch.generation.refresh import due_rows
from hf_blockbatch.generation.state import DecodeState
from hf_blockbatch.generation.transfer import (
    Sampled,
    candidate_scores,
    eos_probability,
    factor_select,
    quota_schedule,
    quota_select,
    sample_tokens,
    threshold_select,
)

logger = logging.getLogger(__name__)

__all__ = ["DecodePlan", "DecodeResult", "run_plan"]


@dataclass
class DecodePlan:
    """Everything the core needs to know about a strategy (built from a generation config)."""

    strategy: str
    max_new_tokens: int
    block_sizes: list[int]
    cache: str = "dual"  # "none" | "prefix" | "dual"
    threshold: float | None = 0.9
    factor: float | None = None
    steps_per_block: int | None = None  # fixed quota
    temperature: float = 0.0
    remasking: str = "low_confidence"
    merge: bool = False
    merge_threshold: float = 0.5
    sync: bool = False
    sync_threshold: int = 8
    refresh: str = "periodic"
    refresh_interval: int = 32
    divergence_threshold: float = 0.1
    early_stop: bool = False
    eos_confidence: str = "completion"  # "completion" | "commit": how EOS hitters are ranked (stop.py)
    advance_after_full: bool = True
    prob_map: bool = False  # keep top-k probabilities of every generated position (merge needs it)
    suppress_logit_ids: list[int] = field(default_factory=list)
    low_confidence_ids: list[int] = field(default_factory=list)
    output_trace: bool = False

    @property
    def top_k(self) -> int:
        """Entries per position in the probability map. A merge takes a token only when the map
        rates it above ``merge_threshold`` t, and fewer than 1/t tokens can each hold more than t,
        so the top ``ceil(1/t) - 1`` entries are exact (the top-1 alone at the default t = 0.5)."""
        return max(1, math.ceil(1.0 / self.merge_threshold) - 1) if self.merge else 0


@dataclass
class DecodeResult:
    sequences: torch.Tensor  # [B, L]
    nfe: torch.Tensor  # [B] long
    stats: list[dict[str, Any]]


@dataclass
class _Span:
    """The slots a step reads: ``[A, W]`` positions of a span of each of its rows, padded."""

    rows: torch.Tensor  # [A] state rows
    positions: torch.Tensor  # [A, W] canvas positions (padded slots: L, a spare column)
    valid: torch.Tensor | None  # [A, W] real slots (None: all, the spans are uniform)
    in_win: torch.Tensor | None  # [A, W] slots inside the row's window (None: all)
    canvas: torch.Tensor  # the rows' canvases, with the spare column when padded
    current: torch.Tensor  # [A, W] what they hold at the slots
    masked: torch.Tensor  # [A, W] still masked
    keep: torch.Tensor | None  # [A, W] slots whose logits the step reads (None: every real slot)


class _Run:
    """One call of :func:`run_plan`: the state and the steps that change it."""

    def __init__(self, model, input_ids, attention_mask, plan: DecodePlan, mask_id, eos_ids, pad_id, generator,
                 streamer, stream_end_ids=None):  # fmt: skip
        self.model, self.plan, self.generator, self.streamer = model, plan, generator, streamer
        self.mask_id, self.pad_id = mask_id, pad_id
        device = input_ids.device
        self.eos_ids = torch.tensor(eos_ids, device=device, dtype=torch.long)
        # the stream ends where the answer does (answer_texts): at EOS or an end-of-turn token
        self.stream_end_ids = torch.tensor(sorted(set(eos_ids) | set(stream_end_ids or ())), device=device, dtype=torch.long)
        B, Lp = input_ids.shape
        G = plan.max_new_tokens
        self.B, self.L, self.gs = B, Lp + G, Lp
        N = len(plan.block_sizes)
        self.N = N
        canvas = torch.cat([input_ids, input_ids.new_full((B, G), mask_id)], dim=1)
        attn = torch.cat([attention_mask.bool(), attention_mask.new_ones((B, G)).bool()], dim=1)
        R = B * N
        rep = torch.arange(B, device=device).repeat_interleave(N)
        zeros = torch.zeros(R, dtype=torch.long, device=device)
        k = plan.top_k
        self.state = DecodeState(
            canvas=canvas[rep].clone(),
            attention_mask=attn[rep],
            request=rep,
            branch=torch.arange(N, device=device).repeat(B),
            block=torch.tensor(plan.block_sizes, device=device, dtype=torch.long).repeat(B),
            win_start=torch.full((R,), Lp, dtype=torch.long, device=device),
            win_end=torch.full((R,), Lp, dtype=torch.long, device=device),
            done=torch.zeros(R, dtype=torch.bool, device=device),
            since_refresh=zeros.clone(),
            steps_in_block=zeros.clone(),
            masked_at_block_start=zeros.clone(),
            prob_p=torch.zeros(R, G, k, device=device) if plan.prob_map else None,
            prob_ids=torch.full((R, G, k), -1, dtype=torch.long, device=device) if plan.prob_map else None,
            eos_hit=torch.zeros(R, dtype=torch.bool, device=device),
            eos_prob=torch.zeros(R, dtype=torch.float64, device=device),
            committed=zeros.clone(),
            merged=zeros.clone(),
            copied=zeros.clone(),
            syncs=zeros.clone(),
            refreshes=zeros.clone(),
            synced_now=None,
            retired=torch.zeros(R, dtype=torch.bool, device=device),
            gen_start=Lp,
            mask_id=mask_id,
            quota=plan.threshold is None and plan.factor is None,
        )
        # How a row that hits EOS gets the probability that ranks it against its request's other
        # hitting rows: read at completion (the EOS slot's logits of the completing forward), or kept
        # since commit. A request with one row has nothing to rank, so it reads neither.
        self._eos_rank = plan.eos_confidence if plan.early_stop and N > 1 else None
        if self._eos_rank == "commit":
            self.state.commit_prob = torch.zeros(R, G, dtype=torch.float64, device=device)
        self.state.win_start -= 1  # so the first advance counts as a move and sets the quota
        self.state.advance()
        self.state.since_refresh.zero_()
        self.cache = None
        if plan.cache != "none":
            self.cache = model.new_cache(R, self.L, self.state.attention_mask)
        # NFE = 1 (initial forward) + block steps + refreshes. Every live request rides in every
        # block step (a request whose rows are all done has finished), so block steps are one
        # host counter, copied into ``nfe_block`` when a request finishes; refreshes carry only
        # the due rows and are counted per request.
        self.block_steps = 0
        self.nfe_block = torch.zeros(B, dtype=torch.long, device=device)
        self.nfe_refresh = torch.zeros_like(self.nfe_block)
        self.sequences = canvas.clone()
        self.by_eos = torch.zeros(B, dtype=torch.bool, device=device)
        self.stats: list[dict[str, Any]] = [{} for _ in range(B)]
        self.trace: list[list[dict]] = [[] for _ in range(B)]
        self._cuda = device.type == "cuda"
        self._propose_masked_only = plan.temperature == 0 and plan.remasking == "low_confidence"
        self._mask_logits = bool(getattr(model, "supports_logits_mask", False))
        self.forward_seconds = 0.0
        self._forward_events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self.sample_seconds = 0.0
        self.streamed = 0
        self._windows: tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor | None]] | None = None
        # column offsets, sliced by every step (never re-allocated): spans are at most L long, and
        # they also index the <= R rows of a step
        self._offsets = torch.arange(max(self.L, R) + 1, device=device)

    # ------------------------------------------------------------------ forwards
    def _timed(self, fn, *args, **kwargs):
        """A model forward, timed apart from the policy. On CUDA by a pair of events read once the
        run ends, so timing never stalls the host (a synchronize around every forward would stop
        the CPU from queueing the forward's kernels while the policy's still run)."""
        # `self._cuda` is read once: `model.device` walks the module tree (~50 us a call)
        if self._cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = fn(*args, **kwargs)
            end.record()
            self._forward_events.append((start, end))
            return out
        t = time.perf_counter()
        out = fn(*args, **kwargs)
        self.forward_seconds += time.perf_counter() - t
        return out

    def _count_refresh(self, rows: torch.Tensor) -> None:
        """One refresh forward: +1 NFE for every request with at least one row in it."""
        hit = torch.zeros(self.B, dtype=torch.bool, device=rows.device).index_fill_(0, self.state.request[rows], True)
        self.nfe_refresh += hit

    def _nfe(self, request: int) -> int:
        """Forwards so far of a live request."""
        return 1 + self.block_steps + int(self.nfe_refresh[request])

    def _take(self, t: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """``t[rows]`` without a copy when ``rows`` is every row (it is then ``arange(R)``: rows
        come from ``nonzero`` and are ascending and unique)."""
        return t if rows.shape[0] == self.state.num_rows else t[rows]

    def _layout(self, starts: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(positions [A, W], valid [A, W] | None)`` of the slots ``[start, start + length)`` of
        each row, padded to the longest (padded slots point at ``L``, a spare column; ``valid``
        is ``None`` when every span has the same length)."""
        shortest, W = torch.stack(torch.aminmax(lengths)).tolist()
        positions = starts[:, None] + self._offsets[:W]
        valid = None
        if shortest != W:
            valid = self._offsets[:W] < lengths[:, None]
            positions = positions.masked_fill(~valid, self.L)
        return positions, valid

    def _span(self, rows: torch.Tensor, layout: tuple[torch.Tensor, torch.Tensor | None], window_only: bool,
              shared: bool = False) -> _Span:  # fmt: skip
        """The slots of a :meth:`_layout` of each row, and what the rows' canvases hold there;
        ``window_only`` says the spans are exactly the rows' windows.

        Greedy low-confidence decoding (the default) reads logits only at still-masked slots
        (``keep``): nothing else is ever committed or read back from the probability map (merging
        reads it only where the row is masked), and these are about a third of a window's slots
        once it is under way, so the other hidden states never go through the head. When EOS hitters
        are ranked at completion (early stop, several branches, ``eos_confidence="completion"``) it
        also reads each row's first EOS slot in its window, whose probability picks a winner if
        the window completes (the first EOS after the commit is that one, or a newly
        committed one, which was masked). Stochastic decoding reads every slot, so that the random
        draws follow the packed layout whatever the canvas holds; so does a ``shared`` step (the
        initial one: every slot is masked, and each request's proposals serve all its branches).
        """
        s = self.state
        positions, valid = layout
        canvas = self._take(s.canvas, rows)
        if valid is not None:  # the spare column: never masked
            canvas = torch.cat([canvas, canvas.new_full((rows.shape[0], 1), self.pad_id)], dim=1)
        current = canvas.gather(1, positions)
        masked = current == self.mask_id
        in_win = valid
        if not window_only:
            ws, we = self._take(s.win_start, rows), self._take(s.win_end, rows)
            in_win = (positions >= ws[:, None]) & (positions < we[:, None])
            if valid is not None:
                in_win &= valid
        keep = None
        if self._propose_masked_only and not shared:
            keep = masked
            if self._eos_rank == "completion":
                is_eos = torch.isin(current, self.eos_ids)
                if in_win is not None:
                    is_eos &= in_win
                first = is_eos.byte().argmax(-1, keepdim=True)
                keep = keep.scatter(1, first, is_eos.gather(1, first) | masked.gather(1, first))
        return _Span(rows, positions, valid, in_win, canvas, current, masked, keep)

    def _read(self, span: _Span) -> torch.Tensor | None:
        """``[A, W]`` slots whose logits the step reads; ``None``: every slot."""
        return span.keep if span.keep is not None else span.valid

    def _full_logits(self, span: _Span, write_cache: bool) -> torch.Tensor:
        """Full forward over the span's rows; returns the packed logits predicting the slots it reads."""
        s, rows = self.state, span.rows
        read = self._read(span)
        want = torch.zeros(rows.shape[0], self.L + 1, dtype=torch.bool, device=rows.device)
        # a padded slot points at L, which is L - 1 for a shifted model: a hidden state that predicts
        # no position of the canvas, so no real slot shares it
        want.scatter_(1, span.positions - self.model.logit_shift, True if read is None else read)
        want = want[:, : self.L]
        kwargs = {"logits_mask": want} if self._mask_logits else {}
        out = self._timed(
            self.model,
            s.canvas[rows],
            attention_mask=s.attention_mask[rows],
            cache=self.cache if write_cache else None,
            cache_rows=rows if write_cache else None,
            **kwargs,
        )
        return out.logits if self._mask_logits else out.logits[want]

    def _window_logits(self, span: _Span, starts: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
        """Window forward over the span's rows (dual: queries are the windows; prefix: they run to
        the end of the canvas); returns the packed logits predicting the slots it reads."""
        s, rows = self.state, span.rows
        read = self._read(span)
        if self.plan.cache == "dual":
            q_end = ends
            pick = None if read is None else (read.reshape(-1) if span.valid is None else read[span.valid])
        else:  # prefix: each row's packed queries are [start, L); the span is their first `length`
            q_end = torch.full_like(ends, self.L)
            q_len = self.L - starts
            Wq = int(q_len.max())
            sel = torch.zeros(rows.shape[0], Wq, dtype=torch.bool, device=rows.device)
            sel[:, : span.positions.shape[1]] = True if read is None else read
            pick = sel[self._offsets[:Wq] < q_len[:, None]]
        kwargs = {"logits_mask": pick} if self._mask_logits and pick is not None else {}
        out = self._timed(self.model.forward_windows, s.canvas, starts, q_end, self.cache, rows=rows, **kwargs)
        return out.logits if kwargs or pick is None else out.logits[pick]

    # ------------------------------------------------------------------ commits
    def _sample(self, packed_logits: torch.Tensor) -> Sampled:
        """Proposals for the packed positions; timed apart, since the softmax over the vocabulary
        is the one policy cost that grows with the model (it is most of the policy of a small one)."""
        plan = self.plan
        t = time.perf_counter()
        out = sample_tokens(
            packed_logits, plan.temperature, plan.remasking, plan.top_k, self.generator, self._suppress, self._lowconf,
            self.mask_id,
        )
        self.sample_seconds += time.perf_counter() - t
        return out

    def _slots(self, valid: torch.Tensor | None, A: int, W: int) -> torch.Tensor:
        """``[A, W]`` row of the packed logits for each slot when every slot is read: ``a * W + w``
        for uniform spans, else counted over the real slots (padded slots: 0)."""
        if valid is None:
            return torch.arange(A * W, device=self._offsets.device).view(A, W)
        return packed_index(valid)

    def _commit(self, span: _Span, packed: torch.Tensor, phase: str, slot_index: torch.Tensor | None = None) -> bool:
        """Propose tokens, apply the transfer rule inside each row's window and write the commits
        to the canvas; update the probability map and EOS hits.

        ``packed`` holds the logits predicting the slots the step reads (see :meth:`_span`), in
        row-major slot order; with every slot read, ``slot_index`` ``[A, W]`` may instead give the
        row of ``packed`` for each slot (the initial step's branches share their request's).

        Returns whether a window may have completed (exact for window spans: a row with no mask
        left in its window); while none has, :meth:`DecodeState.advance` would change nothing.
        """
        s, plan = self.state, self.plan
        rows, positions, valid, in_win, canvas, current, masked = (
            span.rows, span.positions, span.valid, span.in_win, span.canvas, span.current, span.masked
        )
        A, W = positions.shape
        if span.keep is not None:  # greedy: proposals at the slots read (the masked ones, + EOS slots)
            need = span.keep
            sampled = self._sample(packed)
            confidence = sampled.confidence
            if self._lowconf is not None:  # suppressed (-inf) proposals stay candidates
                confidence = confidence.clamp_min(torch.finfo(confidence.dtype).min)
            # the rules' scores directly: -inf off the masked slots (padded slots hold no mask)
            scores = torch.full((A, W), float("-inf"), dtype=confidence.dtype, device=masked.device)
            scores.masked_scatter_(need, confidence)
            if need is not masked:  # EOS slots are read for their probability, never committed
                scores.masked_fill_(~masked, float("-inf"))
            tokens = current.masked_scatter(need, sampled.tokens)
            top_probs, top_ids = sampled.top_probs, sampled.top_ids
        else:
            need = valid
            sampled = self._sample(packed)
            if slot_index is None:
                slot_index = self._slots(valid, A, W)
            scores, tokens = sampled.confidence[slot_index], sampled.tokens[slot_index]
            if s.prob_p is not None:
                keep = slot_index.reshape(-1) if valid is None else slot_index[valid]
                top_probs, top_ids = sampled.top_probs[keep], sampled.top_ids[keep]
        if s.prob_p is not None:  # one flat index into the [R * G] map entries: two row copies
            G, k = s.prob_p.shape[1:]
            entry = positions + (rows * G - self.gs)[:, None]
            entry = entry.reshape(-1) if need is None else entry[need]
            s.prob_p.view(-1, k).index_copy_(0, entry, top_probs)
            s.prob_ids.view(-1, k).index_copy_(0, entry, top_ids)
        if span.keep is not None:  # scores are already -inf off the masked slots
            if in_win is not valid:  # a span wider than the window
                scores = scores.masked_fill(~in_win, float("-inf"))
        else:
            scores = candidate_scores(scores, masked if in_win is None else masked & in_win)
        if plan.threshold is not None:
            select = threshold_select(scores, plan.threshold)
        elif plan.factor is not None:
            select = factor_select(scores, plan.factor)
        else:
            count = quota_schedule(s.masked_at_block_start[rows], plan.steps_per_block, s.steps_in_block[rows])
            select = quota_select(scores, count.clamp_min(1))
            s.steps_in_block[rows] += 1
        new = torch.where(select, tokens, current)
        if rows.shape[0] == s.num_rows and valid is None:
            s.canvas.scatter_(1, positions, new)
        else:
            s.canvas[rows] = canvas.scatter_(1, positions, new)[:, : self.L]
        n_select = select.sum(-1)
        s.committed.index_add_(0, rows, n_select)
        if s.commit_prob is not None:
            prob = sampled.probability
            if span.keep is not None:  # kept slots are the masked ones (no EOS slot is read)
                prob = torch.zeros((A, W), dtype=prob.dtype, device=prob.device).masked_scatter_(need, prob)
            else:
                prob = prob[slot_index]
            s.commit_prob[rows[:, None].expand(A, W)[select], positions[select] - self.gs] = prob[select]
        completed, complete_rows = True, None
        if in_win is valid:  # the span is the window: masked slots left unselected remain masked
            complete_rows = masked.sum(-1) <= n_select
            completed = bool(complete_rows.any())
        if plan.early_stop and completed:  # a hit needs a fully decoded window
            def eos_prob_at(local: torch.Tensor, slot: torch.Tensor) -> torch.Tensor:
                if self._eos_rank is None:
                    return torch.zeros(local.shape, dtype=torch.float64, device=local.device)
                if self._eos_rank == "commit":
                    return s.commit_prob[rows[local], positions[local, slot] - self.gs]
                if span.keep is not None:  # the packed row of a kept slot: the kept slots up to it
                    row = span.keep.reshape(-1).cumsum(0)[local * W + slot] - 1
                else:
                    row = slot_index[local, slot]
                return eos_probability(packed[row], self.eos_ids)

            stop_mod.mark_eos(s, rows, new, in_win, eos_prob_at, self.eos_ids, complete_rows)
        if plan.output_trace:
            self._trace_commit(rows, positions, select, phase)
        return completed

    def block_step(self, rows: torch.Tensor) -> bool:
        """One forward over the windows of ``rows``; returns whether a window may have completed.

        The windows' layout is kept from the previous block step until :meth:`run` drops it (a
        window moved, or rows finished): most steps only commit inside unmoved windows."""
        s, plan = self.state, self.plan
        if self._windows is None:
            starts, ends = self._take(s.win_start, rows), self._take(s.win_end, rows)
            self._windows = (starts, ends, self._layout(starts, ends - starts))
        starts, ends, layout = self._windows
        span = self._span(rows, layout, window_only=True)
        if plan.cache == "none":
            packed = self._full_logits(span, write_cache=False)
        else:
            packed = self._window_logits(span, starts, ends)
        self.block_steps += 1
        return self._commit(span, packed, "block")

    def full_step(self, rows: torch.Tensor, phase: str) -> None:
        """A full forward over ``rows`` (the initial forward, or a refresh): rewrite their cache
        rows, update their probability maps everywhere, commit in their windows."""
        s, plan = self.state, self.plan
        if plan.prob_map:
            starts = torch.full_like(rows, self.gs)
            lengths = torch.full_like(rows, self.L - self.gs)
        else:
            starts, lengths = s.win_start[rows], (s.win_end[rows] - s.win_start[rows]).clamp_min(1)
        span = self._span(rows, self._layout(starts, lengths), window_only=not plan.prob_map)
        packed = self._full_logits(span, write_cache=self.cache is not None)
        if phase == "refresh":
            self._count_refresh(rows)
        s.refreshes.index_add_(0, rows, torch.ones_like(rows))
        s.since_refresh[rows] = 0
        self._commit(span, packed, phase)

    def initial_step(self) -> None:
        """One full forward per request (not per branch): K/V broadcast to every branch's row."""
        s = self.state
        first = s.first_rows(self.N)
        if self.N == 1:
            self.full_step(first, "init")
            return
        # One forward per request over its whole generated region; the K/V and the logits are then
        # shared by every branch (their canvases are identical): each branch's slots point at its
        # request's logits, and each branch commits inside its own first window.
        G = self.L - self.gs
        span = self._span(first, self._layout(torch.full_like(first, self.gs), torch.full_like(first, G)), True,
                          shared=True)  # fmt: skip
        packed = self._full_logits(span, write_cache=self.cache is not None)
        if self.cache is not None:
            self.cache.broadcast_rows(self.N)
        n = self.N
        positions = span.positions.repeat_interleave(n, 0)
        in_win = (positions >= s.win_start[:, None]) & (positions < s.win_end[:, None])
        branches = _Span(torch.arange(s.num_rows, device=first.device), positions, None, in_win, s.canvas,
                         span.current.repeat_interleave(n, 0), span.masked.repeat_interleave(n, 0), None)  # fmt: skip
        s.refreshes += 1
        self._commit(branches, packed, "init", slot_index=self._slots(None, first.shape[0], G).repeat_interleave(n, 0))

    # ------------------------------------------------------------------ policy
    def after_commit(self, full: bool, completed: bool = True) -> bool:
        """Advance, merge, sync; returns whether a window may have moved (else no row can be due
        for a refresh: the last refresh left none, and only a moving window ages a row)."""
        s, plan = self.state, self.plan
        moved = False
        if (not full or plan.advance_after_full) and completed:
            s.advance()
            moved = True
        if plan.merge and self.N > 1:
            merged = merge(s, plan.merge_threshold, self.N)
            if plan.output_trace:
                self._trace_positions(merged, "merge")
            if not plan.sync:  # else the sync's advance moves the windows past the merged tokens too
                s.advance()
            moved = True
        if plan.sync and self.N > 1:
            # leaders before the sync: afterwards a synced row ties with its leader and may win the tie
            leader = leaders(s, self.N)[0] if plan.output_trace else None
            synced = sync_to_leader(s, self.cache, plan.sync_threshold, self.N)
            moved = True
            if plan.output_trace:
                self._trace_sync(synced, leader)
        return moved

    def refresh(self) -> bool:
        """Refresh the due rows; returns whether any were. With ``divergence`` a row can be due
        without any window having moved, so the loop asks every step; ``periodic`` rows become due
        only as windows move."""
        # With advance_after_full, a refresh that completes its block moves the window into a new
        # block, which is due at once: refresh again (a block starts with a full forward), else the
        # next block step would query a window against a cache that predates the last commits.
        # Terminates: every full step commits at least one token per row.
        refreshed = False
        while True:
            due = due_rows(self.state, self.plan.refresh, self.plan.refresh_interval, self.cache,
                           self.plan.divergence_threshold)  # fmt: skip
            rows = due.nonzero().squeeze(1)
            if not rows.numel():
                return refreshed
            self.full_step(rows, "refresh")
            refreshed = True
            if not self.plan.advance_after_full:
                return refreshed
            self.state.advance()

    def settle(self, moved: bool) -> tuple[bool, bool]:
        """End of a step: requests that ended leave, *then* the due rows are refreshed (a request
        whose branch completed a block holding EOS ends there, without the refresh its moved window
        would trigger: BLOCKBATCH.md, stop), and a refresh may end requests in turn.

        Returns ``(no request left, a window may have moved)``."""
        finished = self.finish() if moved else False
        if not finished and (moved or self.plan.refresh == "divergence") and self.refresh():
            moved = True
            finished = self.finish()
        return finished, moved

    def finish(self) -> bool:
        """Retire finished requests; True when none is left.

        A finished request's rows are *retired* at once (done: no forward or policy step touches
        them again) and physically dropped from the state and the cache only once at least half
        of the rows are retired. Dropping copies every kept cache row, so doing it whenever any
        request of a batch finished cost O(finishes x cache); halving keeps it O(cache) overall.
        """
        s = self.state
        # a request can only end once one of its live rows is done (or hit EOS, with early stop);
        # retired rows are done and have no EOS hit
        ready = s.done ^ s.retired
        if self.plan.early_stop:
            ready |= s.eos_hit
        if not bool(ready.any()):
            return False
        finished = stop_mod.finished_requests(s, self.B, self.plan.early_stop, self.N)
        if not bool(finished.any()):
            return False
        winner, by_eos = stop_mod.pick_winners(s, finished, self.plan.early_stop, self.N)
        req = finished.nonzero().squeeze(1)
        rows = winner[req]
        out = s.canvas[rows]
        eos_req = by_eos[req]
        if bool(eos_req.any()):
            filled = stop_mod.fill_after_eos(out, self.gs, self.mask_id, self.pad_id)
            out = torch.where(eos_req[:, None], filled, out)
        self.sequences[req] = out
        self.by_eos[req] = eos_req
        self.nfe_block[req] = self.block_steps
        self._record_stats(req, rows, eos_req)
        s.retire(finished[s.request], self.pad_id)
        n_retired = int(s.retired.sum())
        if n_retired == s.num_rows:
            return True
        if 2 * n_retired >= s.num_rows:
            keep = (~s.retired).nonzero().squeeze(1)
            s.select(keep)
            if self.cache is not None:
                self.cache.keep_rows(keep)
        return False

    # ------------------------------------------------------------------ bookkeeping
    def _record_stats(self, req: torch.Tensor, winners: torch.Tensor, by_eos: torch.Tensor) -> None:
        s = self.state
        decoded = s.decoded()
        cols = {
            "request": s.request, "branch": s.branch, "block": s.block, "committed": s.committed,
            "merged": s.merged, "copied": s.copied, "syncs": s.syncs, "refreshes": s.refreshes, "decoded": decoded,
        }  # fmt: skip
        host = dict(zip(cols, torch.stack(list(cols.values())).tolist()))
        if self._eos_rank is not None:  # what ranked the EOS hitters (stop.pick_winners)
            eos_hit, eos_prob = s.eos_hit.tolist(), s.eos_prob.tolist()
        wanted = set(req.tolist())
        rows_of: dict[int, list[int]] = {r: [] for r in wanted}
        for i, r in enumerate(host["request"]):  # one pass over the rows, whatever finished
            if r in wanted:
                rows_of[r].append(i)
        keys = ("committed", "merged", "copied", "syncs", "refreshes", "decoded")
        for r_i, w, e in zip(req.tolist(), winners.tolist(), by_eos.tolist()):
            branches = [{"block_size": host["block"][i], **{k: host[k][i] for k in keys}} for i in rows_of[r_i]]
            if self._eos_rank is not None:
                for b, i in zip(branches, rows_of[r_i]):
                    b["eos_hit"], b["eos_probability"] = eos_hit[i], eos_prob[i] if eos_hit[i] else None
            self.stats[r_i] = {
                "strategy": self.plan.strategy,
                "winner_block_size": host["block"][w],
                "winner_branch": host["branch"][w],
                "stopped_by": "eos" if e else "complete",
                "nfe": self._nfe(r_i),
                "nfe_block": int(self.nfe_block[r_i]),
                "nfe_refresh": int(self.nfe_refresh[r_i]),
                "syncs": sum(b["syncs"] for b in branches),
                "merged": sum(b["merged"] for b in branches),
                "branches": branches,
            }
            if self.plan.output_trace:
                self.stats[r_i]["trace"] = self.trace[r_i]

    def _trace_commit(self, rows, positions, select, phase) -> None:
        s = self.state
        req, br = s.request[rows].tolist(), s.branch[rows].tolist()
        ws, we = s.win_start[rows].tolist(), s.win_end[rows].tolist()
        for i, (r, b) in enumerate(zip(req, br)):
            pos = positions[i][select[i]]
            self.trace[r].append({"step": self._nfe(r), "phase": phase, "branch": b,
                                  "window": [ws[i] - self.gs, we[i] - self.gs], "committed": (pos - self.gs).tolist(),
                                  "tokens": s.canvas[rows[i], pos].tolist()})  # fmt: skip

    def _trace_positions(self, taken: torch.Tensor, phase: str) -> None:
        s = self.state
        for i in taken.any(-1).nonzero().squeeze(1).tolist():
            r = int(s.request[i])
            pos = taken[i].nonzero().squeeze(1)
            self.trace[r].append({"step": self._nfe(r), "phase": phase, "branch": int(s.branch[i]),
                                  "positions": pos.tolist(), "tokens": s.canvas[i, self.gs + pos].tolist()})  # fmt: skip

    def _trace_sync(self, synced: torch.Tensor, leader: torch.Tensor) -> None:
        s = self.state
        for i in synced.nonzero().squeeze(1).tolist():
            r = int(s.request[i])
            self.trace[r].append({"step": self._nfe(r), "phase": "sync", "branch": int(s.branch[i]),
                                  "leader": int(s.branch[leader[i]])})  # fmt: skip

    def stream(self, final: bool = False) -> None:
        """Send request 0's newly agreed left-to-right prefix to the streamer."""
        if self.streamer is None:
            return
        s = self.state
        if final:
            gen = self.sequences[0, self.gs :]
            stop = torch.isin(gen, self.stream_end_ids) | (gen == self.mask_id)
            n = int(stop.float().argmax()) if bool(stop.any()) else gen.shape[0]
        else:
            rows = ((s.request == 0) & ~s.retired).nonzero().squeeze(1)
            if rows.numel() == 0:
                return
            gen = s.canvas[rows, self.gs :]
            agree = (gen != self.mask_id).all(0) & (gen == gen[:1]).all(0) & ~torch.isin(gen[0], self.stream_end_ids)
            n = int((~agree).float().argmax()) if bool((~agree).any()) else agree.shape[0]
            gen = gen[0]
        if n > self.streamed:
            self.streamer.put(gen[self.streamed : n].cpu())
            self.streamed = n

    # ------------------------------------------------------------------ loop
    def run(self) -> DecodeResult:
        plan = self.plan
        self._suppress = torch.tensor(plan.suppress_logit_ids, device=self.state.canvas.device) if plan.suppress_logit_ids else None
        self._lowconf = torch.tensor(plan.low_confidence_ids, device=self.state.canvas.device) if plan.low_confidence_ids else None
        t0 = time.perf_counter()
        self.initial_step()
        self.after_commit(full=True)
        finished, _ = self.settle(moved=True)
        self.stream()
        guard = 4 * plan.max_new_tokens + 16
        rows = None
        while not finished:
            guard -= 1
            if guard < 0:
                raise RuntimeError("Decoding made no progress; this is a bug in hf-blockbatch, please report it.")
            if rows is None:
                rows = (~self.state.done).nonzero().squeeze(1)
            if rows.numel():
                moved = self.after_commit(full=False, completed=self.block_step(rows))
            else:
                moved = True
            # While no window moves, no row becomes done or hits EOS (that needs a completed window),
            # so no request can finish and the active rows and their windows stay as they are.
            finished, moved = self.settle(moved)
            self.stream()
            if moved:
                rows = self._windows = None
        self.stream(final=True)
        if self.streamer is not None:
            self.streamer.end()
        if self._cuda:  # the call's wall time includes its last kernels; then the events can be read
            torch.cuda.synchronize()
            self.forward_seconds = sum(a.elapsed_time(b) for a, b in self._forward_events) / 1000
        total = time.perf_counter() - t0
        for st in self.stats:
            st["seconds"] = total
            st["forward_seconds"] = self.forward_seconds
            st["sample_seconds"] = self.sample_seconds
        return DecodeResult(self.sequences, 1 + self.nfe_block + self.nfe_refresh, self.stats)


@torch.no_grad()
def run_plan(
    model,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    plan: DecodePlan,
    mask_id: int,
    eos_ids: list[int],
    pad_id: int,
    generator: torch.Generator | None = None,
    streamer=None,
    stream_end_ids: list[int] | None = None,
) -> DecodeResult:
    """Decode ``plan.max_new_tokens`` new tokens for every row of ``input_ids`` (left-padded).
    The streamer's text ends at the first of ``eos_ids`` or ``stream_end_ids`` (end of turn)."""
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    if streamer is not None:
        streamer.put(input_ids[0][attention_mask[0].bool()].cpu())
    with reuse_storage():  # the run's cache never leaves it: its CPU storage serves the next call
        return _Run(model, input_ids, attention_mask, plan, mask_id, eos_ids, pad_id, generator, streamer,
                    stream_end_ids).run()  # fmt: skip
