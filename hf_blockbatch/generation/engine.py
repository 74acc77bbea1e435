"""The model-agnostic decoding loop shared by vanilla, Fast-dLLM and BlockBatch.

A :class:`~hf_blockbatch.generation.plans.DecodePlan` names a strategy's parts; :class:`Run`
runs any plan on any model that implements the forward contract of
:mod:`hf_blockbatch.models.base`, without asking which strategy it is. One step:

1. **forward**: one packed forward over the windows of every active row of every request
   (:mod:`.forward`; a full forward for ``cache="none"``), reading only the slots the step needs
   (with lookahead, :class:`~.policies.Lookahead` first writes the draft rows that ride along);
2. **rule**: the transfer rule commits inside each window (:mod:`.commit`, :mod:`.rules`);
3. **policies**: advance, merge, sync, ... in the plan's order (:mod:`.policies`);
4. **stop**: requests that ended leave (:mod:`.stop`), *then*
5. **refresh**: the refresh policy refreshes the rows that are due, through :meth:`Run.full_step`
   (:mod:`.refresh`), and a refresh may end requests in turn.

NFE, stats, the trace and streaming are recorded by :class:`~.trace.Recorder`.

See docs/algorithm.md, "BlockBatch — Step" and "NFE and query tokens".
"""

from __future__ import annotations

import logging
import math
import time
from typing import Any

import torch

from hf_blockbatch.cache import reuse_storage
from hf_blockbatch.generation.commit import (
    completed_windows,
    mark_eos_hits,
    note_runner_ups,
    propose,
    write_commits,
)
from hf_blockbatch.generation.forward import Forwards, Span
from hf_blockbatch.generation.memory import explain_decode_error, new_cache
from hf_blockbatch.generation.noise import draws_noise, lane_keys, request_keys, slot_keys
from hf_blockbatch.generation.outputs import DecodeResult
from hf_blockbatch.generation.plans import DecodePlan
from hf_blockbatch.generation.policies import StepContext
from hf_blockbatch.generation.rules import needs_entropy
from hf_blockbatch.generation.sampling import Sampled, sample_tokens
from hf_blockbatch.generation.state import DecodeState, in_window
from hf_blockbatch.generation.trace import Recorder, for_streamer

logger = logging.getLogger(__name__)

__all__ = ["Run", "run_plan"]


def nonfinite_logits_error(when: str) -> ValueError:
    """The error of a decode whose model gives NaN or +inf logits where it decodes (``when``: at its first forward,
    or for how long it stalled). A proposal from such logits has a NaN probability and is never committed
    (:mod:`.rules`), so a decode that keeps meeting them cannot end: it stopped only at the loop's guard, after
    ``4 * max_new_tokens + 16`` idle forwards, with a message that blamed this library."""
    return ValueError(
        f"The model's logits hold NaN or +inf {when}, and no token can be decoded from them: a float16 model often "
        "overflows (load it in bfloat16 or float32, e.g. torch_dtype=torch.bfloat16); otherwise check the checkpoint "
        "and any hook that edits the logits."
    )


def _ids(ids: list[int], device: torch.device) -> torch.Tensor | None:
    return torch.tensor(ids, device=device, dtype=torch.long) if ids else None


class Run:
    """One call of :func:`run_plan`: the state and the steps that change it."""

    def __init__(self, model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor, plan: DecodePlan,
                 mask_id: int, eos_ids: list[int], pad_id: int, generator: torch.Generator | None,
                 streamer: Any) -> None:  # fmt: skip
        """Start the decode state (keyed noise lanes when it draws noise with a seed) and allocate the cache
        (none for ``cache="none"``), the forwards, the recorder and the output: the prompt, then
        ``max_new_tokens`` masks."""
        self.model, self.plan, self.generator, self.pad_id = model, plan, generator, pad_id
        device = input_ids.device
        self.eos_ids = torch.tensor(eos_ids, device=device, dtype=torch.long)
        self.B, self.gs = input_ids.shape
        # keyed noise (noise.py): a sampled step's numbers hashed from what they decide, not drawn from a stream
        draws = draws_noise(plan.temperature, plan.remasking)
        keyed = draws and plan.seed is not None
        self.state = DecodeState.start(
            input_ids, attention_mask, plan.block_sizes, plan.max_new_tokens, mask_id, quota=plan.rule.keeps_quota,
            map_k=plan.map_k, keep_commit_prob=plan.stop.eos_rank == "commit",
            features=frozenset().union(*(getattr(part, "needs", ()) for part in (plan.refresh, *plan.policies)),
                                       ("kv_tokens",) if plan.sparse_queries else (), ("noise",) if keyed else ()),
        )  # fmt: skip
        if keyed:  # a draft row stands for its main row's later steps: its lane is the main row's
            s = self.state
            lane = s.branch if plan.lookahead is None else torch.zeros_like(s.branch)
            s.noise_key = lane_keys(request_keys(plan.seed, input_ids, attention_mask)[s.request], lane)
        self.L, self.N = self.state.length, self.state.branches
        self.cache = None if plan.cache == "none" else new_cache(model, self.state.num_rows, self.L,
                                                                 self.state.attention_mask, plan, self.B)  # fmt: skip
        # the slots a step proposes at: the masks alone, where nothing else is ranked. A sampled (or randomly
        # remasked) dense step drawing from a generator reads its whole window, so that its noise is drawn as the
        # official samplers draw it; a sparse step queries the masks and their neighbours only, so reading every
        # slot would query the whole window; keyed noise does not depend on the slots read
        masked_only = not plan.read_all_slots and (plan.sparse_queries or keyed or not draws)
        self.fwd = Forwards(model, self.state, self.cache, plan.cache, pad_id, self.eos_ids, masked_only,
                            eos_slot=plan.stop.eos_rank == "completion", requery_radius=plan.requery_radius,
                            draft_depth=plan.lookahead.depth if plan.lookahead and plan.sparse_queries else 0,
                            draft_radius=plan.lookahead.draft_radius if plan.lookahead else None)  # fmt: skip
        self.recorder = Recorder(self.B, device, self.gs, plan.strategy, plan.output_trace, plan.stop.eos_rank,
                                 streamer, _ids(plan.end_ids or eos_ids, device), mask_id)  # fmt: skip
        self.sequences = torch.cat([input_ids, input_ids.new_full((self.B, plan.max_new_tokens), mask_id)], dim=1)
        self.suppress, self.lowconf = _ids(plan.suppress_logit_ids, device), _ids(plan.low_confidence_ids, device)
        self.sample_seconds = 0.0
        # the last step's proposal probabilities (NaN where its logits held NaN or +inf): read back only at the
        # first forward and when the loop's guard stops a stalled decode, to say why (nonfinite_logits_error)
        self.last_probability: torch.Tensor | None = None
        self.rule_entropy = needs_entropy(plan.rule)
        # lookahead's runner-up drafts: after each commit, the runner-up tokens of windows left with this few masks
        self.runner_up_masks = plan.lookahead.spare_masks if plan.lookahead is not None else 0
        self._windows: tuple[torch.Tensor, torch.Tensor, tuple] | None = None

    # ------------------------------------------------------------------ commits
    def _sample(self, packed_logits: torch.Tensor, noise_keys: torch.Tensor | None) -> Sampled:
        """Proposals for the packed positions; timed apart, since the softmax over the vocabulary
        is the one policy cost that grows with the model."""
        plan = self.plan
        t = time.perf_counter()
        out = sample_tokens(packed_logits, plan.temperature, plan.remasking, plan.map_k, self.generator, self.suppress,
                            self.lowconf, self.state.mask_id, entropy=self.rule_entropy, noise_keys=noise_keys)  # fmt: skip
        self.sample_seconds += time.perf_counter() - t
        self.last_probability = out.probability
        return out

    def noise_keys(self, span: Span) -> torch.Tensor:
        """``[T]`` the keyed noise's key of each slot the span reads, in the packed logits' order (row-major):
        its row's key and step, and its offset in the generated region (noise.py)."""
        s = self.state
        rows, positions, read = span.rows[:, None].expand_as(span.positions), span.positions, span.read
        rows, positions = (rows.reshape(-1), positions.reshape(-1)) if read is None else (rows[read], positions[read])
        return slot_keys(s.noise_key[rows], s.steps[rows], positions - s.gen_start)

    def commit(self, span: Span, packed: torch.Tensor, phase: str, slot_index: torch.Tensor | None = None,
               key_span: Span | None = None) -> bool:  # fmt: skip
        """Propose, apply the rule inside each row's window, write the commits; update the
        probability map and EOS hits. Returns whether a window may have completed (exact for
        window spans); while none has, advancing would change nothing. ``key_span``: the span whose
        slots ``packed`` holds, when it is not ``span`` (the initial step's shared logits)."""
        s, plan = self.state, self.plan
        keys = None if s.steps is None else self.noise_keys(span if key_span is None else key_span)
        proposal = propose(s, span, self._sample(packed, keys), slot_index, self.fwd.slots, self.lowconf is not None)
        select, new, n_select = write_commits(s, span, proposal, plan.rule)
        if self.runner_up_masks:
            note_runner_ups(s, span, proposal, select, n_select, packed, self.runner_up_masks, self.suppress)
        if s.steps is not None:
            s.steps.index_add_(0, span.rows, torch.ones_like(span.rows))
        completed, complete = completed_windows(span, n_select)
        if plan.stop.early_stop and completed and phase in plan.stop.eos_phases:  # a hit needs a fully decoded window
            mark_eos_hits(s, span, proposal, new, packed, self.eos_ids, plan.stop.eos_rank, complete, plan.stop.eos_dtype)
        self.recorder.commit(s, span.rows, span.positions, select, phase)
        return completed

    # ------------------------------------------------------------------ forwards
    def block_step(self, rows: torch.Tensor) -> bool:
        """One forward over the windows of ``rows``; returns whether a window may have completed.

        The windows' layout is kept from the previous block step until the loop drops it (a
        window moved, or rows finished): most steps only commit inside unmoved windows."""
        s = self.state
        if self._windows is None:
            starts, ends = s.take(s.win_start, rows), s.take(s.win_end, rows)
            lengths = ends - starts
            self._windows = (starts, ends, self.fwd.layout(starts, lengths))
            if not self.plan.sparse_queries:  # a sparse step counts its own queries
                # what each row feeds: a cached window from one slot early on a shifted model (Dream), whose
                # logits there predict the window's first position; without a cache the real canvas
                shift = self.model.logit_shift
                queried = {"none": lambda: s.attention_mask[rows].sum(-1), "prefix": lambda: self.L - starts + shift}
                self.fwd.new_layout(rows, queried[self.plan.cache]() if self.plan.cache in queried else lengths + shift)
        starts, ends, layout = self._windows
        span = self.fwd.span(s, rows, layout, window_only=True)
        if self.cache is None:
            packed = self.fwd.full(s, span, write_cache=False)
            self.fwd.block_step()
        elif self.plan.sparse_queries:
            packed = self.fwd.positions(s, span)
        else:
            packed = self.fwd.windows(s, span, starts, ends)
            self.fwd.block_step()
        self.recorder.block_steps += 1
        return self.commit(span, packed, "block")

    def full_step(self, rows: torch.Tensor, phase: str) -> None:
        """A full forward over ``rows`` (the initial forward, or a refresh): rewrite their cache
        rows, update their probability maps (everywhere, or in their windows when the plan's
        ``map_everywhere`` is off), commit in their windows."""
        s = self.state
        everywhere = s.prob_p is not None and self.plan.map_everywhere
        if everywhere:
            starts = torch.full_like(rows, self.gs)
            lengths = torch.full_like(rows, self.L - self.gs)
        else:
            starts = s.win_start[rows]
            lengths = (s.win_end[rows] - starts).clamp_min(1)
        span = self.fwd.span(s, rows, self.fwd.layout(starts, lengths), window_only=not everywhere)
        packed = self.fwd.full(s, span, write_cache=self.cache is not None)
        if s.decoded_at_full is not None:  # what the cache was written over, before this step commits
            s.decoded_at_full[rows] = s.decoded_rows(rows)
        if phase == "refresh":
            self.recorder.count_refresh(s, rows)
        s.refreshes.index_add_(0, rows, torch.ones_like(rows))
        s.since_refresh[rows] = 0
        self.commit(span, packed, phase)

    def initial_step(self) -> None:
        """One full forward per request (not per branch): BlockBatch's branches share its K/V
        (broadcast to every branch's row) and its logits; Lookahead's draft rows wait for a draft."""
        s = self.state
        first = s.first_rows()
        if self.N == 1 or self.plan.lookahead is not None:
            # Lookahead's draft rows are written from their main row before each step that carries a
            # draft (canvas and window; K/V when they first draft after a forward that wrote the main
            # row: a request often ends or refreshes first): the initial forward is the main rows'
            self.full_step(first, "init")
            if self.N > 1:
                s.refreshes.fill_(1)  # every row's count holds its request's initial forward, as below
            return
        # One forward per request over its whole generated region; the K/V and the logits are then
        # shared by every branch (their canvases are identical): each branch's slots point at its
        # request's logits, and each branch commits inside its own first window.
        G = self.L - self.gs
        layout = self.fwd.layout(torch.full_like(first, self.gs), torch.full_like(first, G))
        span = self.fwd.span(s, first, layout, True, shared=True)
        packed = self.fwd.full(s, span, write_cache=self.cache is not None)
        if self.cache is not None:
            self.cache.broadcast_rows(self.N)
            s.kv_written(None)
        positions = span.positions.repeat_interleave(self.N, 0)
        in_win = in_window(positions, s.win_start, s.win_end)
        branches = Span(torch.arange(s.num_rows, device=first.device), positions, None, in_win, s.canvas,
                        span.current.repeat_interleave(self.N, 0), span.masked.repeat_interleave(self.N, 0), None)  # fmt: skip
        s.refreshes += 1
        self.commit(branches, packed, "init", slot_index=self.fwd.slots(None, first.shape[0], G).repeat_interleave(self.N, 0),
                    key_span=span)

    # ------------------------------------------------------------------ policies, stop, refresh
    def apply_policies(self, full: bool, completed: bool = True) -> bool:
        """The plan's branch policies in order; returns whether a window may have moved (else no
        row can be due for a refresh: the last refresh left none, and only a moving window ages a row)."""
        ctx = StepContext(self.state, self.cache, self.recorder, full, completed)
        moved = False
        for policy in self.plan.policies:
            moved |= policy.apply(ctx)
        return moved

    def settle(self, moved: bool) -> tuple[bool, bool]:
        """End of a step: requests that ended leave, *then* the due rows are refreshed (a request
        whose branch completed a block holding EOS ends there, without the refresh its moved window
        would trigger), and a refresh may end requests in turn.

        With ``plan.advance_after_full`` a refresh that completes its block moves the window into a
        new block, due at once: refresh again until none is due, retiring ended requests between
        (an early stop must not pay for the next block's forward).

        Returns ``(no request left, a window may have moved)``."""
        finished = self.finish() if moved else False
        if finished or not (moved or self.plan.refresh.every_step):
            return finished, moved
        while self.plan.refresh.refresh(self):
            moved = True
            finished = self.finish()
            if finished or not self.plan.advance_after_full:
                break
        return finished, moved

    def finish(self) -> bool:
        """Record and retire the requests that ended; True when none is left."""
        ending = self.plan.stop.ending(self.state, self.B, self.pad_id)
        if ending is None:
            return False
        self.sequences[ending.requests] = ending.sequences
        self.recorder.finished(self.state, ending)
        return self.plan.stop.retire(self.state, self.cache, ending, self.pad_id, self.count_finished)

    def count_finished(self) -> None:
        """The finished requests' query tokens and authors' NFE, while their rows are still here."""
        self.fwd.flush(self.state)
        self.recorder.fill_counts(self.state)

    def step_rows(self) -> tuple[torch.Tensor, bool]:
        """The rows of the next block step: every active row, or (``plan.step_complete_windows``
        off, the authors' order) only those whose window still holds a mask; and whether an active
        row was left out (its complete window is to be advanced after the step)."""
        s = self.state
        active = ~s.done
        if self.plan.step_complete_windows:
            return active.nonzero().squeeze(1), False
        stepping = active & (s.window_mask_count(s.win_start, s.win_end) > 0)
        return stepping.nonzero().squeeze(1), bool((active & ~stepping).any())

    # ------------------------------------------------------------------ loop
    def run(self) -> DecodeResult:
        """Decode to the end. Running out of memory raises the same error type with what the decode holds and
        what shrinks it (:func:`~.memory.explain_decode_error`); other errors pass unchanged."""
        try:
            return self._run()
        except RuntimeError as err:
            explained = explain_decode_error(err, self.model, self.plan, self.B, self.B * self.N, self.L,
                                             self.fwd.in_forward)  # fmt: skip
            if explained is err:
                raise
            raise explained from err

    def _run(self) -> DecodeResult:
        t0 = time.perf_counter()
        self.initial_step()
        # one read per decode (a sum and its value: NaN iff a proposal's is): a model that gives NaN or +inf
        # logits from its first forward fails here, not 4 * max_new_tokens + 16 idle forwards later
        if math.isnan(self.last_probability.sum()):
            raise nonfinite_logits_error("at the first forward")
        self.apply_policies(full=True)
        finished, _ = self.settle(moved=True)
        self.recorder.stream(self.state, self.sequences)
        guard = steps_allowed = 4 * self.plan.max_new_tokens + 16
        rows, left_out = None, False
        while not finished:
            guard -= 1
            if guard < 0:
                if math.isnan(self.last_probability.sum()):  # why it stalled, read once
                    raise nonfinite_logits_error(
                        f"where the decode stalled ({steps_allowed} steps for {self.plan.max_new_tokens} tokens)")
                raise RuntimeError("Decoding made no progress; this is a bug in hf-blockbatch, please report it.")
            # draft rows join this step or are parked: new rows when that changed
            if self.plan.lookahead is not None and self.plan.lookahead.draft(self):
                rows = self._windows = None
            if rows is None:
                rows, left_out = self.step_rows()
            completed = (self.block_step(rows) if rows.numel() else True) or left_out
            if self.plan.stop.before_policies and completed:  # the authors check EOS before anything else
                if self.finish():
                    break
                rows = self._windows = None
            moved = self.apply_policies(full=False, completed=completed)
            # While no window moves, no row becomes done or hits EOS (that needs a completed window),
            # so no request can finish and the active rows and their windows stay as they are.
            finished, moved = self.settle(moved)
            self.recorder.stream(self.state, self.sequences)
            if moved:
                rows = self._windows = None
        self.count_finished()
        self.recorder.stream(self.state, self.sequences, final=True)
        self.recorder.timings(time.perf_counter() - t0, self.fwd.forward_seconds(), self.sample_seconds)
        return DecodeResult(self.sequences, self.recorder.total_nfe(), self.recorder.stats)


def run_plan(model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, plan: DecodePlan,
             mask_id: int, eos_ids: list[int], pad_id: int, generator: torch.Generator | None = None,
             streamer: Any = None) -> DecodeResult:  # fmt: skip
    """Decode ``plan.max_new_tokens`` new tokens for every row of ``input_ids`` (left-padded), on any ``model``
    that implements the forward contract. ``streamer`` (transformers-style: ``put``/``end``) gets row 0's prompt and
    answer (:meth:`~.trace.Recorder.stream`) but no ``end()``: the caller ends it, returning or raising.

    The decode runs in ``torch.inference_mode``: no tensor of it needs autograd's version counters
    or views tracking, and skipping them makes each of the policy's many small operations cheaper
    (with the tiny models on this CPU, 1-10 % off a whole decode, forwards included; RESULTS §21).
    What it returns is cloned out of inference mode when the caller is outside it, so the sequences
    can be edited in place or fed to a training step as any tensor can."""
    caller_in_inference = torch.is_inference_mode_enabled()
    with torch.inference_mode():
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        if streamer is not None:
            streamer.put(for_streamer(input_ids[0][attention_mask[0].bool()]))
        with reuse_storage():  # the run's cache never leaves it: its CPU storage serves the next call
            result = Run(model, input_ids, attention_mask, plan, mask_id, eos_ids, pad_id, generator, streamer).run()
    if not caller_in_inference:  # two small tensors; the stats are host values
        result.sequences, result.nfe = result.sequences.clone(), result.nfe.clone()
    return result
