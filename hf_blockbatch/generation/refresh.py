"""Refresh policies: which rows get a full-sequence forward (a *refresh*), and running it.

Window steps leave the keys and values outside the window stale. A refresh recomputes a row's
whole cache row, its probability map, and applies the transfer rule to its window. Fast-dLLM's
block-start forward is the same operation with ``interval = block_length``: the row becomes due
exactly when its window enters a new block.

* :class:`Periodic`: due once the window advanced ``interval`` generated tokens since the last
  refresh;
* :class:`AfterCommits`: also due once the row's canvas gained ``commits`` tokens since a full forward
  last wrote its cache (Fast-dLLM's ``refresh_after_commits``): the cached prompt and suffix keys were
  computed over masks that are tokens now. It can fire without any window moving;
* :class:`Divergence`: also due when the row's last-layer keys over the generated region drift
  from the mean of its request's rows by more than ``threshold`` (relative; the authors' optional
  trigger). It can fire without any window moving, so the engine asks it every step;
* :class:`ReferenceRefresh`: the authors' (``BlockBatchConfig(variant="reference")``);
* :class:`Off`: never.

A row synced this step is never refreshed in the same step (the sync already gave it the
leader's cache). A policy carries out its refresh through the engine's full forward
(``run.full_step``), so it decides *and* runs, and the engine never asks which policy it holds.

See docs/algorithm.md, "BlockBatch — Refresh".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch

from hf_blockbatch.cache import BranchCache
from hf_blockbatch.generation.state import DecodeState

if TYPE_CHECKING:
    from hf_blockbatch.generation.engine import Run

__all__ = ["AfterCommits", "Divergence", "Off", "Periodic", "ReferenceRefresh", "make_refresh"]


@dataclass(frozen=True)
class Periodic:
    """Due once the window advanced ``interval`` generated tokens since the row's last full forward: Fast-dLLM's
    block-start forward (``interval = block_length``) and BlockBatch's periodic refresh. The base of the policies
    that add other triggers (:meth:`stale`)."""

    interval: int = 32
    every_step: ClassVar[bool] = False  # a row ages only as its window moves

    def due(self, state: DecodeState, cache: BranchCache) -> torch.Tensor:
        """[R] bool: rows to refresh now."""
        due = self.stale(state, cache) & ~state.done
        return due if state.synced_now is None else due & ~state.synced_now

    def stale(self, state: DecodeState, cache: BranchCache) -> torch.Tensor:
        """[R] bool: rows whose cache is old enough to rewrite (:meth:`due` sets done and just-synced rows
        aside); the subclasses add their own triggers to the window's age."""
        return state.since_refresh >= self.interval

    def refresh(self, run: Run) -> bool:
        """Refresh the due rows once; returns whether any were.

        After a full forward that completes its block (``advance_after_full``), the window moves
        into a new block, which is due at once: the engine asks again (a block starts with a full
        forward), after retiring the requests that ended, so that a block the refresh completed
        with an end token stops its request there (``Run.settle``).
        """
        rows = self.due(run.state, run.cache).nonzero().squeeze(1)
        if not rows.numel():
            return False
        run.full_step(rows, "refresh")
        if run.plan.advance_after_full:
            run.state.advance()
        return True


@dataclass(frozen=True)
class AfterCommits(Periodic):
    """Periodic, and a main row (branch 0: never a lookahead draft) whose canvas gained ``commits``
    tokens since its last full forward; asked after every step. Refreshing runs as Periodic's:
    one full forward per due row, and more only while the plan advances after full forwards."""

    needs: ClassVar[tuple[str, ...]] = ("decoded_at_full",)

    commits: int = 16
    every_step: ClassVar[bool] = True  # rows go stale by committing, not only by moving

    def stale(self, state: DecodeState, cache: BranchCache) -> torch.Tensor:
        """Also a row that gained ``commits`` tokens, unless its window has no mask left. Such a window is kept
        after the full forward that completed it only for the official extra step (``skip_completed_block_step``
        off); that step commits nothing, and the block its row moves to next starts with a full forward (or the
        row is done). A refresh there changed no token and cost a forward; with sparse queries the extra step then
        had no position left to query, and the decode failed."""
        gained = (state.decoded() - state.decoded_at_full >= self.commits) & (state.branch == 0)
        gained &= state.window_mask_count(state.win_start, state.win_end) > 0
        return super().stale(state, cache) | gained


@dataclass(frozen=True)
class Divergence(Periodic):
    """Periodic, and a row whose last-layer keys over the generated region drift more than ``threshold`` (relative)
    from its request's mean; asked after every step, since drift needs no window move."""

    threshold: float = 0.1
    every_step: ClassVar[bool] = True

    def stale(self, state: DecodeState, cache: BranchCache) -> torch.Tensor:
        """Also a row whose keys drifted from its request's mean (each request's rows compared among themselves)."""
        keys = cache.layers[-1].keys[:, state.gen_start :].float().flatten(1)  # [R, G*H*D]
        # Rows are request-major, ``branches`` per request (:meth:`DecodeState.per_request`), so a row's place among
        # the requests still running is its index // branches: known on the host, where ``state.request.max()`` was
        # a device read every step. Each request's sum adds the same rows in the same order as before, and every
        # request has ``branches`` rows.
        R = keys.shape[0]
        local = torch.arange(R, device=keys.device) // state.branches
        B = R // state.branches
        sums = torch.zeros(B, keys.shape[1], dtype=keys.dtype, device=keys.device).index_add_(0, local, keys)
        mean = sums[local] / state.branches
        drift = (keys - mean).norm(dim=-1) / mean.norm(dim=-1).clamp_min(1e-6)
        return super().stale(state, cache) | (drift > self.threshold)


@dataclass(frozen=True)
class ReferenceRefresh:
    """The authors' refresh: a row is due once its window moves since its last full forward times
    its block size reach ``interval`` (a jump over several blocks is one move; a sync neither
    counts nor resets); once any active row of a request is due, *every* active row of that
    request is refreshed, synced ones included, in one full forward. No advance follows: a window
    the refresh completed is skipped by the next block step (``DecodePlan.step_complete_windows``)."""

    needs: ClassVar[tuple[str, ...]] = ("moves",)

    interval: int = 32
    every_step: ClassVar[bool] = False

    def due(self, state: DecodeState, cache: BranchCache) -> torch.Tensor:
        """[R] bool: every active row of a request with a due row (synced rows too)."""
        due = (state.moves * state.block >= self.interval) & ~state.done
        return state.per_request(due).any(-1).repeat_interleave(state.branches) & ~state.done

    def refresh(self, run: Run) -> bool:
        """Refresh the due rows in one full forward, with no advance after it; returns whether any were."""
        rows = self.due(run.state, run.cache).nonzero().squeeze(1)
        if not rows.numel():
            return False
        run.full_step(rows, "refresh")
        run.state.moves[rows] = 0
        return True


@dataclass(frozen=True)
class Off:
    """Never refresh: vanilla (no cache), and a cache kept as the window steps wrote it (``refresh="off"``)."""

    every_step: ClassVar[bool] = False

    def refresh(self, run: Run) -> bool:
        """Nothing is ever due: ``False``."""
        return False


def make_refresh(policy: str, interval: int, divergence_threshold: float, cached: bool,
                 after_commits: int | None = None) -> Periodic | ReferenceRefresh | Off:  # fmt: skip
    """The refresh policy of a plan; a strategy without a cache has nothing to refresh."""
    if policy == "off" or not cached:
        return Off()
    if after_commits is not None:
        return AfterCommits(interval, after_commits)
    if policy == "divergence":
        return Divergence(interval, divergence_threshold)
    if policy == "reference":
        return ReferenceRefresh(interval)
    return Periodic(interval)
