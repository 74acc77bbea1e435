"""The rows of a decoding batch, as tensors.

A row is one branch of one request (Fast-dLLM and vanilla have one branch per request;
BlockBatch one per block size). Every per-row quantity is a tensor of shape ``[R]`` or
``[R, ...]``, so the policy (transfer, advance, merge, sync, refresh, stop) is a handful of
tensor operations per step, never a Python loop over rows or positions.

Derived quantities are not stored: a row's decoded count is the number of non-mask tokens in its
generated region, its window is the block of its own size that holds its first mask.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

__all__ = ["DecodeState"]


@dataclass
class DecodeState:
    canvas: torch.Tensor  # [R, L] prompt (left-padded) + generated region
    attention_mask: torch.Tensor  # [R, L] bool, False on left padding
    request: torch.Tensor  # [R] index of the row's request in the caller's batch
    branch: torch.Tensor  # [R] branch index within the request
    block: torch.Tensor  # [R] block size of the row
    win_start: torch.Tensor  # [R] current window [win_start, win_end)
    win_end: torch.Tensor  # [R]
    done: torch.Tensor  # [R] bool: no mask left
    since_refresh: torch.Tensor  # [R] generated tokens the window advanced since the last full forward
    steps_in_block: torch.Tensor  # [R] commits since the window moved (fixed-quota schedule)
    masked_at_block_start: torch.Tensor  # [R] masks in the window when it moved (fixed quota)
    prob_p: torch.Tensor | None  # [R, G, k] probability map: top-k probabilities per generated position
    prob_ids: torch.Tensor | None  # [R, G, k] and their token ids
    eos_hit: torch.Tensor  # [R] bool: a fully decoded window holding EOS
    eos_prob: torch.Tensor  # [R] probability of that EOS (to pick the winner)
    committed: torch.Tensor  # [R] tokens committed by the transfer rule
    merged: torch.Tensor  # [R] tokens committed by merging
    copied: torch.Tensor  # [R] tokens gained by syncing to the leader
    syncs: torch.Tensor  # [R] times this row was synced
    refreshes: torch.Tensor  # [R] full forwards that refreshed this row
    synced_now: torch.Tensor | None  # [R] bool: synced in this step (no refresh right after a sync); None: no sync
    retired: torch.Tensor  # [R] bool: the row's request has finished (the row stays done until dropped)
    gen_start: int
    mask_id: int
    quota: bool = True  # keep the fixed-quota counters (the other rules never read them)
    # [R, G] float64: each decoded position's probability when it was committed or merged (kept only
    # for ``eos_confidence="commit"``, which ranks EOS hitters by it); None: not kept
    commit_prob: torch.Tensor | None = None

    @property
    def num_rows(self) -> int:
        return self.canvas.shape[0]

    @property
    def length(self) -> int:
        return self.canvas.shape[1]

    def first_rows(self, branches: int) -> torch.Tensor:
        """[requests] the first row of each request: rows are request-major, ``branches`` per request
        (whole requests are kept together), so per-request questions are ``view(-1, branches)``."""
        return torch.arange(0, self.num_rows, branches, device=self.canvas.device)

    def decoded(self) -> torch.Tensor:
        """[R] non-mask tokens in each row's generated region."""
        return (self.canvas[:, self.gen_start :] != self.mask_id).sum(-1)

    def advance(self) -> None:
        """Move every row's window to the block (of its own size) holding its first mask; rows
        with no mask left (or retired) are done."""
        gs, L = self.gen_start, self.length
        masks = self.canvas[:, gs:] == self.mask_id
        has_mask = masks.any(-1)
        first = masks.byte().argmax(-1)
        start = torch.where(has_mask, gs + first - first % self.block, L)
        # Windows only move right: commits and merges only fill masks, and a retired row has none.
        # A sync may move a row's window back to the leader's; the sync restores the copied age.
        self.since_refresh += start - self.win_start
        if self.quota:
            end = (start + self.block).clamp_max(L)
            moved = start != self.win_start
            self.masked_at_block_start = torch.where(moved, self.window_mask_count(start, end), self.masked_at_block_start)
            self.steps_in_block = self.steps_in_block.masked_fill(moved, 0)
        self.win_start, self.win_end = start, (start + self.block).clamp_max(L)
        self.done = ~has_mask  # a retired row has no mask left (see retire)

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
        pos = torch.arange(self.length, device=self.canvas.device)
        inside = (pos[None, :] >= start[:, None]) & (pos[None, :] < end[:, None])
        return ((self.canvas == self.mask_id) & inside).sum(-1)

    def select(self, rows: torch.Tensor) -> None:
        """Keep only ``rows`` (drop finished requests)."""
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, torch.Tensor):
                setattr(self, f.name, value.index_select(0, rows))

    def copy_rows(self, src: torch.Tensor, dst: torch.Tensor, names: tuple[str, ...]) -> None:
        """``row[dst] = row[src]`` for the named per-row tensors (leader sync)."""
        for name in names:
            value = getattr(self, name)
            if value is not None:
                value.index_copy_(0, dst, value.index_select(0, src))
