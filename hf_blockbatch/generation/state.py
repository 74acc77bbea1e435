"""The rows of a decoding batch, as tensors, and their request-major layout.

A row is one branch of one request (Fast-dLLM and vanilla have one branch per request;
BlockBatch one per block size). Rows are request-major, ``branches`` per request, and whole
requests are kept together, so a per-request question is a ``[requests, branches]`` view
(:meth:`DecodeState.per_request`): no mechanism takes the branch count or rebuilds views itself.
Every per-row quantity is a tensor of shape ``[R]`` or ``[R, ...]``, so the policy (rule, advance,
merge, sync, refresh, stop) is a handful of tensor operations per step, never a Python loop over
rows or positions.

Derived quantities are not stored: a row's decoded count is the number of non-mask tokens in its
generated region, its window is the block of its own size that holds its first mask.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field, fields
from typing import Any

import torch

__all__ = ["DecodeState", "canvas_positions", "in_window"]


def _zeros(n: int, device: torch.device, dtype: torch.dtype = torch.long) -> torch.Tensor:
    return torch.zeros(n, dtype=dtype, device=device)


# A decode reads two or three lengths (its canvas, and the forward's offsets); a server meets a new
# canvas length with every prompt length, so the cache is bounded rather than one tensor per length
# ever seen (unbounded, that is the sum of all lengths up to the context: 67 MB at 4k, on the device).
CANVAS_POSITIONS_CACHED = 32


@functools.lru_cache(maxsize=CANVAS_POSITIONS_CACHED)
def canvas_positions(length: int, device: torch.device) -> torch.Tensor:
    """``[length]`` canvas positions ``0..length-1``, built once per length and device (window tests
    run every step; read-only). The last ``CANVAS_POSITIONS_CACHED`` (length, device) pairs are kept."""
    return torch.arange(length, device=device)


def in_window(at: torch.Tensor, start: torch.Tensor, end: torch.Tensor) -> torch.Tensor:
    """``[A, W]`` bool: which positions ``at`` (``[A, W]``, or ``[W]`` shared by every row) fall in
    each row's window ``[start, end)`` (``[A]``). The decoding core's one window test."""
    return (at >= start[:, None]) & (at < end[:, None])


@dataclass
class DecodeState:
    """Every row of a decode as ``[R, ...]`` tensors, request-major (module docstring); build it with :meth:`start`.
    The policies change it in place; fields a plan does not need (its ``features``) stay ``None``."""

    canvas: torch.Tensor  # [R, L] prompt (left-padded) + generated region
    attention_mask: torch.Tensor  # [R, L] bool, False on left padding
    request: torch.Tensor  # [R] index of the row's request in the caller's batch
    branch: torch.Tensor  # [R] branch index within the request
    block: torch.Tensor  # [R] block size of the row
    gen_start: int
    mask_id: int
    branches: int  # rows per request
    quota: bool = False  # keep the fixed-quota counters (only the quota rule reads them)
    map_k: int = 0  # entries per position of the probability map (0: no map)
    keep_commit_prob: bool = False
    # per-row counters only some parts read (their ``needs``): "moves" (ReferenceRefresh),
    # "count_offset" (Sync(count="rule")), "step_syncs" and "pruned" (Prune; Lookahead parks its draft
    # rows with it), "lookahead" (Lookahead: ``drafted``, ``kv_from``, ``adopted``), "runner_up" (Lookahead's
    # runner-up drafts: ``runner_p``, ``runner_ids``); absent ones are None,
    # so that a plan without those parts pays no operation for them
    features: frozenset[str] = frozenset()
    # filled by __post_init__ from the shapes above
    win_start: torch.Tensor = field(default=None)  # [R] current window [win_start, win_end)
    win_end: torch.Tensor = field(default=None)  # [R]
    done: torch.Tensor = field(default=None)  # [R] bool: no mask left
    since_refresh: torch.Tensor = field(default=None)  # [R] generated tokens the window advanced since the last full forward
    steps_in_block: torch.Tensor = field(default=None)  # [R] commits since the window moved (fixed quota)
    masked_at_block_start: torch.Tensor = field(default=None)  # [R] masks in the window when it moved (fixed quota)
    prob_p: torch.Tensor | None = None  # [R, G, k] probability map: top-k probabilities per generated position
    prob_ids: torch.Tensor | None = None  # [R, G, k] and their token ids
    eos_hit: torch.Tensor = field(default=None)  # [R] bool: a fully decoded window holding EOS
    eos_prob: torch.Tensor = field(default=None)  # [R] float64 probability of that EOS (ranks the hitters)
    committed: torch.Tensor = field(default=None)  # [R] tokens committed by the transfer rule
    merged: torch.Tensor = field(default=None)  # [R] tokens committed by merging
    copied: torch.Tensor = field(default=None)  # [R] tokens gained by syncing to the leader
    syncs: torch.Tensor = field(default=None)  # [R] times this row was synced
    refreshes: torch.Tensor = field(default=None)  # [R] full forwards that refreshed this row
    block_forwards: torch.Tensor = field(default=None)  # [R] block steps that carried this row
    block_queries: torch.Tensor = field(default=None)  # [R] positions this row fed through them
    moves: torch.Tensor = field(default=None)  # [R] window moves since the last full forward (a jump is one)
    count_offset: torch.Tensor = field(default=None)  # [R] a sync's correction to ``committed`` (see Sync.count)
    synced_now: torch.Tensor | None = None  # [R] bool: synced in this step (no refresh right after a sync)
    retired: torch.Tensor = field(default=None)  # [R] bool: the row's request has finished
    # [R] bool: out of the steps: retired early by the Prune policy (policies/prune.py): done from
    # then on, its masks kept; never queried, refreshed, merged, synced or a leader again; or a
    # Lookahead draft row parked between the block steps that carry a draft (policies/lookahead.py)
    pruned: torch.Tensor = field(default=None)
    step_syncs: torch.Tensor = field(default=None)  # [R] syncs after block steps (Prune counts them)
    # [R, G] float64: each decoded position's probability when it was committed or merged (kept only
    # for ``eos_confidence="commit"``, which ranks EOS hitters by it, and ``merge_source_confidence``)
    commit_prob: torch.Tensor | None = None
    # [R, L]: the token each position held when its K/V in the cache were last written, -1 for a mask
    # (kept only for ``window_queries="sparse"``, feature "kv_tokens"): a decoded position whose token
    # differs has stale K/V, computed while it was still masked, and is queried once more
    kv_tokens: torch.Tensor | None = None
    # Lookahead (feature "lookahead", policies/lookahead.py): [R, L] the canvas each draft row held
    # when it was drafted; [R] the refresh count of its main row whose K/V the draft row's cache holds
    # outside the window; [R] the block steps a main row skipped by adopting a verified draft
    drafted: torch.Tensor | None = None
    kv_from: torch.Tensor | None = None
    adopted: torch.Tensor | None = None
    # [R] bool: a Lookahead draft row (branch > 0), kept so that parking the draft rows and the sparse step's tests
    # of which rows are drafts are one operation each (instead of per-request views and slices, every step)
    draft_row: torch.Tensor | None = None
    draft_parked: torch.Tensor | None = None  # [R] bool: the draft row was parked for the last block step
    # [R] the branch whose next state a draft row extends (0: the main row; another draft: a chain),
    # -1 for main rows; sparse steps build a draft's K/V from it (forward.Forwards.positions)
    draft_parent: torch.Tensor | None = None
    # [R, L] bool, lookahead with sparse steps: the positions where a draft row's cached K/V may differ
    # from its main row's (it wrote its own there, or missed the main row's writes while parked);
    # restored from the main row before the draft's next step (policies/lookahead.py)
    kv_dirty: torch.Tensor | None = None
    # [R, G] lookahead's runner-up drafts (feature "runner_up", ``Lookahead.runner_up``): at the masks of a window left
    # with few masks, the probability and id of the most probable token after the map's (ids -1 where none is known)
    runner_p: torch.Tensor | None = None
    runner_ids: torch.Tensor | None = None
    # [R] the row's decoded tokens when a full forward last wrote its cache (refresh_after_commits)
    decoded_at_full: torch.Tensor | None = None
    # keyed sampling noise (feature "noise", generation/noise.py): [R] the row's key (its request's and lane's),
    # and [R] the commits its decoder has made, which keys each step's noise (a draft row: its main row's, plus
    # the steps it stands ahead)
    noise_key: torch.Tensor | None = None
    steps: torch.Tensor | None = None

    def __post_init__(self) -> None:
        """Allocate the fields left ``None`` that every plan, or this plan's ``features``, needs: zeros, -1 where a
        token id or a row is not known yet, ``drafted`` a copy of the canvas. A group allocated together (e.g. the
        lookahead's fields, keyed on ``drafted``) is skipped whole when its key is given."""
        R, dev, G = self.canvas.shape[0], self.canvas.device, self.canvas.shape[1] - self.gen_start
        for name in ("win_start", "win_end", "since_refresh", "steps_in_block", "masked_at_block_start", "committed",
                     "merged", "copied", "syncs", "refreshes", "block_forwards", "block_queries",
                     *(n for n in ("step_syncs", "moves", "count_offset", "decoded_at_full") if n in self.features)):  # fmt: skip
            if getattr(self, name) is None:
                setattr(self, name, _zeros(R, dev))
        for name in ("done", "eos_hit", "retired", *(("pruned",) if "pruned" in self.features else ())):
            if getattr(self, name) is None:
                setattr(self, name, _zeros(R, dev, torch.bool))
        if self.eos_prob is None:
            self.eos_prob = _zeros(R, dev, torch.float64)
        if self.map_k and self.prob_p is None:
            self.prob_p = torch.zeros(R, G, self.map_k, dtype=torch.float32, device=dev)  # sampling.py: float32
            self.prob_ids = torch.full((R, G, self.map_k), -1, dtype=torch.long, device=dev)
        if "lookahead" in self.features and self.drafted is None:
            self.drafted = self.canvas.clone()
            self.kv_from = _zeros(R, dev)  # none yet: the initial forward writes main rows only (engine)
            self.adopted = _zeros(R, dev)
            self.draft_parked = _zeros(R, dev, torch.bool)
            self.draft_parent = torch.full((R,), -1, dtype=torch.long, device=dev)
            self.draft_row = self.branch > 0
        if "runner_up" in self.features and self.runner_p is None:
            self.runner_p = torch.zeros(R, G, dtype=torch.float32, device=dev)
            self.runner_ids = torch.full((R, G), -1, dtype=torch.long, device=dev)
        if "noise" in self.features and self.steps is None:
            self.noise_key, self.steps = _zeros(R, dev), _zeros(R, dev)
        if "kv_tokens" in self.features and self.kv_tokens is None:
            self.kv_tokens = torch.full_like(self.canvas, -1)  # nothing written yet
            if "lookahead" in self.features:
                self.kv_dirty = torch.zeros_like(self.canvas, dtype=torch.bool)  # set clean when it takes its main row's K/V (kv_from)
        if (self.keep_commit_prob or "commit_prob" in self.features) and self.commit_prob is None:
            self.commit_prob = torch.zeros(R, G, dtype=torch.float64, device=dev)

    @classmethod
    def start(cls, input_ids: torch.Tensor, attention_mask: torch.Tensor, block_sizes: list[int], max_new_tokens: int,
              mask_id: int, **options: Any) -> DecodeState:  # fmt: skip
        """Every request's rows at the start: prompt + ``max_new_tokens`` masks, one row per block
        size, windows on each row's first block. ``options``: the dataclass's settings (``quota``,
        ``map_k``, ``keep_commit_prob``, ``features``)."""
        B, Lp = input_ids.shape
        N, device = len(block_sizes), input_ids.device
        canvas = torch.cat([input_ids, input_ids.new_full((B, max_new_tokens), mask_id)], dim=1)
        attn = torch.cat([attention_mask.bool(), attention_mask.new_ones((B, max_new_tokens)).bool()], dim=1)
        rep = torch.arange(B, device=device).repeat_interleave(N)
        state = cls(canvas=canvas[rep], attention_mask=attn[rep], request=rep, branch=torch.arange(N, device=device).repeat(B),
                    block=torch.tensor(block_sizes, device=device, dtype=torch.long).repeat(B), gen_start=Lp,
                    mask_id=mask_id, branches=N, **options)  # fmt: skip
        state.win_start.fill_(Lp - 1)  # so the first advance counts as a move and sets the quota
        state.advance()
        state.since_refresh.zero_()
        if state.moves is not None:
            state.moves.zero_()
        return state

    @property
    def num_rows(self) -> int:
        """R: rows (requests × branches), finished requests included until :meth:`select` drops them."""
        return self.canvas.shape[0]

    @property
    def length(self) -> int:
        """L: canvas positions, prompt (left-padded) and generated region."""
        return self.canvas.shape[1]

    def first_rows(self) -> torch.Tensor:
        """[requests] the first row of each request."""
        return torch.arange(0, self.num_rows, self.branches, device=self.canvas.device)

    def per_request(self, t: torch.Tensor) -> torch.Tensor:
        """A per-row tensor ``[R, ...]`` as ``[requests, branches, ...]``."""
        return t.view(-1, self.branches, *t.shape[1:])

    def main_rows(self, t: torch.Tensor) -> torch.Tensor:
        """A per-row tensor ``[R, ...]`` at each request's first row (branch 0: Lookahead's main row), as
        ``[requests, ...]``: one strided view, where :meth:`per_request` and an index make two."""
        return t[:: self.branches]

    def decoded(self) -> torch.Tensor:
        """[R] non-mask tokens in each row's generated region."""
        return self.decoded_rows(None)

    def decoded_rows(self, rows: torch.Tensor | None) -> torch.Tensor:
        """:meth:`decoded` of ``rows`` only (all when ``None``)."""
        gen = self.canvas[:, self.gen_start :] if rows is None else self.canvas[rows, self.gen_start :]
        return (gen != self.mask_id).sum(-1)

    def advance(self) -> None:
        """Move every row's window to the block (of its own size) holding its first mask; rows
        with no mask left (or retired, or pruned) are done."""
        gs, L = self.gen_start, self.length
        masks = self.canvas[:, gs:] == self.mask_id
        has_mask = masks.any(-1)
        first = masks.byte().argmax(-1)
        start = torch.where(has_mask, gs + first - first % self.block, L)
        # Windows only move right: commits and merges only fill masks, and a retired row has none.
        # A sync may move a row's window back to the leader's; the sync restores the copied age.
        self.since_refresh += start - self.win_start
        if self.moves is not None:
            self.moves += (start != self.win_start) & has_mask
        if self.quota:
            end = (start + self.block).clamp_max(L)
            moved = start != self.win_start
            self.masked_at_block_start = torch.where(moved, self.window_mask_count(start, end), self.masked_at_block_start)
            self.steps_in_block = self.steps_in_block.masked_fill(moved, 0)
        self.win_start, self.win_end = start, (start + self.block).clamp_max(L)
        self.done = ~has_mask if self.pruned is None else ~has_mask | self.pruned  # a retired row has no mask left

    def retire(self, rows: torch.Tensor, fill_id: int) -> None:
        """Mark the [R] bool ``rows`` (whole finished requests) retired: done from now on. Their
        masks are filled with ``fill_id`` (the answer was already taken) so that every later
        advance sees them done, and their EOS hits are cleared."""
        self.retired |= rows
        self.done |= rows
        self.eos_hit &= ~rows
        gen = self.canvas[:, self.gen_start :]
        gen.masked_fill_((gen == self.mask_id) & rows[:, None], fill_id)

    def window_mask_count(self, start: torch.Tensor, end: torch.Tensor) -> torch.Tensor:
        """[R] masks in each row's ``[start, end)`` (``[R]`` each): a window's masks, or where it would move."""
        inside = in_window(canvas_positions(self.length, self.canvas.device), start, end)
        return ((self.canvas == self.mask_id) & inside).sum(-1)

    def take(self, t: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """``t[rows]`` without a copy when ``rows`` is every row (rows come from ``nonzero``:
        ascending and unique, so all of them is ``arange(R)``). ``index_select``, not ``t[rows]``: on
        CPUs advanced indexing of a ``[R, L]`` long tensor costs 2-4x as much at a batch of 16-32
        requests (13 against 6 us at 40 of 64 rows, 23 against 6 at 100 of 128; RESULTS §26)."""
        return t if rows.shape[0] == self.num_rows else t.index_select(0, rows)

    def kv_written(self, rows: torch.Tensor | None, where: torch.Tensor | None = None,
                   written: torch.Tensor | None = None) -> None:  # fmt: skip
        """The cache's K/V of ``rows`` (all when ``None``) were just computed from their canvases, at
        every position or at the ``[A, L]`` bool ``where``; call it before the step commits. A mask
        is recorded as -1, so that :meth:`stale_kv` always names it. ``written``: the rows' :meth:`kv_record`
        of their canvases, when the caller has it already (a sparse step builds it before its forward)."""
        if self.kv_tokens is None:
            return
        if written is None:
            written = self.kv_record(self.canvas if rows is None else self.take(self.canvas, rows))
        if rows is None:
            self.kv_tokens.copy_(written)
        else:
            self.kv_tokens[rows] = written if where is None else torch.where(where, written, self.take(self.kv_tokens, rows))

    def kv_record(self, canvas: torch.Tensor) -> torch.Tensor:
        """What :attr:`kv_tokens` records for K/V computed from ``canvas``: its tokens, -1 for a mask."""
        return canvas.masked_fill(canvas == self.mask_id, -1)

    def stale_kv(self, rows: torch.Tensor, canvas: torch.Tensor | None = None,
                 records: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
        """``[A, L]`` bool: the positions of ``rows`` whose cached K/V a sparse step recomputes:
        every mask (a dense step rewrites the masks' K/V each step, and the masks attend to each
        other), and every decoded position whose K/V were computed for another token (a mask, before
        its commit). ``canvas`` and ``records``: the rows' canvases and :attr:`kv_tokens`, when the caller
        holds them already (a sparse step with drafts asks several times before its forward)."""
        canvas = self.take(self.canvas, rows) if canvas is None else canvas
        return canvas != (self.take(self.kv_tokens, rows) if records is None else records)

    def select(self, rows: torch.Tensor) -> None:
        """Keep only ``rows`` (whole requests: drop finished ones)."""
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, torch.Tensor):
                setattr(self, f.name, value.index_select(0, rows))

    def copy_rows(self, src: torch.Tensor, dst: torch.Tensor, names: tuple[str, ...]) -> None:
        """``row[dst] = row[src]`` for the named per-row tensors (a leader sync, a draft's adoption; ``dst``
        unique). Each tensor is gathered once through one ``[R]`` row map (``dst`` reads ``src``, every other row
        itself): one operation per tensor, where reading ``src`` and writing ``dst`` made two. So the named
        tensors are replaced, not written in place: a view of one taken before the call keeps the old rows."""
        source = canvas_positions(self.num_rows, dst.device).index_copy(0, dst, src)  # (a cached arange)
        for name in names:
            value = getattr(self, name)
            if value is not None:
                setattr(self, name, value.index_select(0, source))
