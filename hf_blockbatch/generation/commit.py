"""A step's commit: the model's proposals at the slots it read, the transfer rule inside each
row's window, and what follows from the commits (the probability map, commit probabilities, EOS).

``packed`` holds the logits predicting the slots the step reads (``Span.read``), in row-major slot
order; with every slot read, ``slot_index`` ``[A, W]`` may instead give the row of ``packed`` for
each slot (the initial step's branches share their request's logits).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from hf_blockbatch.generation.forward import Span
from hf_blockbatch.generation.rules import TransferRule, candidate_scores
from hf_blockbatch.generation.sampling import Sampled, eos_probability, runner_up
from hf_blockbatch.generation.state import DecodeState
from hf_blockbatch.generation.stop import mark_eos

__all__ = ["Proposal", "completed_windows", "map_entries", "mark_eos_hits", "note_runner_ups", "propose", "write_commits"]


@dataclass
class Proposal:
    """What the rule ranks and what a commit writes, per slot ``[A, W]``."""

    scores: torch.Tensor  # confidence at candidate slots, -inf elsewhere
    tokens: torch.Tensor  # proposed token at read slots (the current token elsewhere)
    sampled: Sampled
    slot_index: torch.Tensor | None  # [A, W] row of the packed proposals (every slot read)
    entropy: torch.Tensor | None = None  # [A, W] at the read slots, when the sampling computed it
    # [A, W] each slot's entry in the flat [R * G] probability maps (``row * G + position - gen_start``), when the
    # plan keeps a map: the step's map update and its runner-up drafts index the maps with it
    entries: torch.Tensor | None = None


def map_entries(state: DecodeState, span: Span) -> torch.Tensor:
    """``[A, W]`` each slot's entry in the flat ``[R * G]`` probability maps: ``row * G + position - gen_start``."""
    return torch.add(span.positions - state.gen_start, span.rows[:, None], alpha=state.prob_p.shape[1])


def propose(state: DecodeState, span: Span, sampled: Sampled, slot_index: torch.Tensor | None,
            slots: Callable[[torch.Tensor | None, int, int], torch.Tensor], suppressed: bool) -> Proposal:  # fmt: skip
    """The rule's scores and the proposed tokens, and the probability map update. ``slots``: how the
    packed rows map to ``[A, W]`` slots when every slot is read and no ``slot_index`` is given
    (:meth:`~hf_blockbatch.generation.forward.Forwards.slots`). ``suppressed``: some confidences may
    be ``-inf`` (``confidence_eos_eot_inf``); they stay candidates."""
    A, W = span.positions.shape
    if span.keep is not None:  # greedy: proposals at the slots read (the masked ones, + EOS slots)
        need = span.keep
        confidence = sampled.confidence
        if suppressed:
            confidence = confidence.clamp_min(torch.finfo(confidence.dtype).min)
        # the rules' scores directly: -inf off the masked slots (padded slots hold no mask)
        scores = torch.full((A, W), float("-inf"), dtype=confidence.dtype, device=span.masked.device)
        scores.masked_scatter_(need, confidence)
        if need is not span.masked:  # EOS slots are read for their probability, never committed
            scores.masked_fill_(~span.masked, float("-inf"))
        if span.in_win is not span.valid:  # a span wider than the window
            scores.masked_fill_(~span.in_win, float("-inf"))
        tokens = span.current.masked_scatter(need, sampled.tokens)
        top_probs, top_ids = sampled.top_probs, sampled.top_ids
        entropy = None
        if sampled.entropy is not None:
            entropy = torch.zeros((A, W), dtype=sampled.entropy.dtype, device=need.device).masked_scatter_(need, sampled.entropy)
    else:
        need = span.valid
        if slot_index is None:
            slot_index = slots(span.valid, A, W)
        scores, tokens = sampled.confidence[slot_index], sampled.tokens[slot_index]
        entropy = None if sampled.entropy is None else sampled.entropy[slot_index]
        if state.prob_p is not None:
            keep = slot_index.reshape(-1) if span.valid is None else slot_index[span.valid]
            top_probs, top_ids = sampled.top_probs[keep], sampled.top_ids[keep]
        scores = candidate_scores(scores, span.masked if span.in_win is None else span.masked & span.in_win)
    entries = None
    if state.prob_p is not None:  # one flat index into the [R * G] map entries: two row copies
        k = state.prob_p.shape[2]
        entries = map_entries(state, span)
        entry = entries.reshape(-1) if need is None else entries[need]
        state.prob_p.view(-1, k).index_copy_(0, entry, top_probs)
        state.prob_ids.view(-1, k).index_copy_(0, entry, top_ids)
    return Proposal(scores, tokens, sampled, slot_index, entropy, entries)


def write_commits(state: DecodeState, span: Span, proposal: Proposal,
                  rule: TransferRule) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """Apply the rule and write its commits to the canvas; returns ``(select [A, W], new [A, W],
    commits per row [A])``."""
    rows, positions = span.rows, span.positions
    if proposal.entropy is None:
        select = rule.select(proposal.scores, state, rows, span)
    else:
        select = rule.select(proposal.scores, state, rows, span, proposal.entropy)
    new = torch.where(select, proposal.tokens, span.current)
    if rows.shape[0] == state.num_rows and span.valid is None:
        state.canvas.scatter_(1, positions, new)
    else:
        state.canvas[rows] = span.canvas.scatter_(1, positions, new)[:, : state.length]
    n_select = select.sum(-1)
    state.committed.index_add_(0, rows, n_select)
    if state.commit_prob is not None:
        prob = proposal.sampled.probability
        if span.keep is not None:  # kept slots are the masked ones (no EOS slot is read)
            prob = torch.zeros(positions.shape, dtype=prob.dtype, device=prob.device).masked_scatter_(span.keep, prob)
        else:
            prob = prob[proposal.slot_index]
        A, W = positions.shape
        state.commit_prob[rows[:, None].expand(A, W)[select], positions[select] - state.gen_start] = prob[select]
    return select, new, n_select


def completed_windows(span: Span, n_select: torch.Tensor) -> tuple[bool, torch.Tensor | None]:
    """Whether a window may have completed, and which (``None``: unknown, the span is wider than
    the window): a window span's masked slots left unselected remain masked."""
    if span.in_win is not span.valid:
        return True, None
    complete = span.masked.sum(-1) <= n_select
    return bool(complete.any()), complete


def mark_eos_hits(state: DecodeState, span: Span, proposal: Proposal, new: torch.Tensor, packed: torch.Tensor,
                  eos_ids: torch.Tensor, eos_rank: str | None, complete: torch.Tensor | None,
                  eos_dtype: torch.dtype = torch.float32) -> None:  # fmt: skip
    """Record the rows whose window is now fully decoded and holds EOS, with the probability that
    ranks them (see ``stop.StopRule``)."""
    rows, positions = span.rows, span.positions
    W = positions.shape[1]

    def eos_prob_at(local: torch.Tensor, slot: torch.Tensor) -> torch.Tensor:
        if eos_rank in (None, "widest"):  # no probability ranks the hitters
            return torch.zeros(local.shape, dtype=torch.float64, device=local.device)
        if eos_rank == "commit":
            return state.commit_prob[rows[local], positions[local, slot] - state.gen_start]
        if span.keep is not None:  # the packed row of a kept slot: the kept slots up to it
            row = span.keep.reshape(-1).cumsum(0)[local * W + slot] - 1
        else:
            row = proposal.slot_index[local, slot]
        return eos_probability(packed[row], eos_ids, eos_dtype)

    mark_eos(state, rows, new, span.in_win, eos_prob_at, eos_ids, complete)


def note_runner_ups(state: DecodeState, span: Span, proposal: Proposal, select: torch.Tensor, n_select: torch.Tensor,
                    packed: torch.Tensor, most: int, suppress_logit_ids: torch.Tensor | None) -> None:  # fmt: skip
    """Lookahead's runner-up drafts (``Lookahead.runner_up``): after a step's commits, the most probable token other
    than the probability map's at each mask of a window left with 2 to ``most`` masks, where a draft row's own shape
    cannot ride next (``state.runner_p``, ``state.runner_ids``; -1 where none was computed). Only those few masks:
    the map keeps one token per position, and a top-2 over every proposal would cost 2-8x its maximum. The step's
    rows forget their older runner-ups, which their map's new entries may have made stale. ``n_select``: the step's
    commits per row (``write_commits``)."""
    state.runner_ids.index_fill_(0, span.rows, -1)
    if span.in_win is span.valid:  # a window span (every step of a lookahead plan): its masks are its window's
        n = span.masked.sum(-1) - n_select
    else:
        n = (span.masked & span.in_win & ~select).sum(-1)
    spare = n == 2 if most == 2 else (n >= 2) & (n <= most)
    if not bool(spare.any()):
        return
    left = span.masked & ~select & spare[:, None]  # [A, W] the masks whose runner-up a spare row may draft
    if span.in_win is not span.valid:
        left &= span.in_win
    # their logits (packed row-major, as the masks are read) and their entries in the [R * G] maps
    logits = packed[left[span.keep]] if span.keep is not None else packed[proposal.slot_index[left]]
    entry = (map_entries(state, span) if proposal.entries is None else proposal.entries)[left]
    best = state.prob_ids.view(-1, state.prob_ids.shape[-1])[entry, 0]  # the map's token, which the drafts guess
    p, ids = runner_up(logits, best, suppress_logit_ids, state.mask_id)
    state.runner_p.view(-1)[entry] = p
    state.runner_ids.view(-1)[entry] = torch.where(p > 0, ids, -1)
