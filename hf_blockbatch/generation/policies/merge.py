"""Confidence-gated merging: a branch adopts tokens that another, compatible branch has decoded.

Two rows of a request are *compatible* when every position decoded in both holds the same token.
A destination row looks at the positions inside the current windows of its compatible sources;
for each of those positions still masked in the destination, it takes, among the tokens its
sources have decoded there, the one its own probability map rates highest, and commits it when
that probability exceeds ``merge_threshold``.

As in the reference, destinations are ordered by decreasing window end and each takes only from
the rows behind it (smaller window end; equal ends by row order). Sources are therefore never
destinations already merged in the same pass, so the whole pass is computed at once on the
pre-merge canvases, as ``[R, R, G]`` masked comparisons, with no loop over rows or positions.

The probability map keeps the top-k probabilities per position with ``k = ceil(1 / threshold) - 1``
(at least 1), which is exact for this test: fewer than ``1 / threshold`` tokens can each hold more
than ``threshold``, so a token above it is always among the top k (the top-1 at threshold 0.5).
``tests/test_blockbatch.py`` checks the pass against a plain loop over rows and positions.

See docs/algorithm.md, "BlockBatch — Merge".
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hf_blockbatch.generation.policies import StepContext
from hf_blockbatch.generation.state import DecodeState

__all__ = ["Merge", "merge"]


@dataclass(frozen=True)
class Merge:
    """``agreement`` r > 0: a source offers its token at p only where source and destination hold
    the same at every position p ± 1 … p ± r (the same token, or both masked); ``source_confidence``
    c: only tokens the source holds at a probability ≥ c (committed, merged or copied at it); see
    :func:`merge`."""

    threshold: float = 0.5
    agreement: int = 0
    source_confidence: float | None = None

    @property
    def needs(self) -> tuple[str, ...]:
        """The state's optional tensors this policy reads (``DecodeState.features``)."""
        return ("commit_prob",) if self.source_confidence is not None else ()

    def apply(self, ctx: StepContext) -> bool:
        """One merge pass over every request (:func:`merge`); returns True: merged tokens may complete a window."""
        taken = merge(ctx.state, self.threshold, self.agreement, self.source_confidence)
        ctx.recorder.positions(ctx.state, taken, "merge")
        return True


def neighbourhood_agrees(gen: torch.Tensor, radius: int) -> torch.Tensor:
    """``[B, dst, src, G]`` bool: rows ``dst`` and ``src`` hold the same (token, or mask) at every
    position within ``radius`` of each position, the position itself excluded (positions beyond
    the generated region agree)."""
    same = gen[:, :, None, :] == gen[:, None, :, :]  # [B, N, N, G]
    ok = torch.ones_like(same)
    for d in range(1, radius + 1):  # a loop over offsets (r is 1 or 2), never over positions
        ok[..., d:] &= same[..., :-d]
        ok[..., :-d] &= same[..., d:]
    return ok


def _sources(state: DecodeState, gen: torch.Tensor, decoded: torch.Tensor) -> torch.Tensor:
    """``[b, dst, src]`` bool: the rows each destination may take from."""
    B, N, _ = gen.shape
    idx = torch.arange(N, device=gen.device)
    # sources stand behind the destination: a smaller window end, or an equal end and a higher
    # row. One key orders both: end * (N + 1) - row.
    key = state.win_end.view(B, N) * (N + 1) - idx
    behind = key[:, None, :] < key[:, :, None]
    # Compatible: the positions decoded in both (a batched matmul of counts, exact in float32)
    # all agree. With each row's masks tagged by a distinct negative number, tokens compare
    # equal exactly where both rows decoded the same token.
    fdec = decoded.float()
    both = fdec @ fdec.transpose(1, 2)
    tagged = torch.where(decoded, gen, -1 - idx[:, None])
    agree = (tagged[:, :, None] == tagged[:, None]).sum(-1)
    # sources are active rows; so are destinations (a done row has no mask left, except a pruned
    # one, which keeps its masks and must take nothing)
    done = state.done.view(B, N)
    sources = behind & (agree == both) & ~done[:, None, :]
    return sources if state.pruned is None else sources & ~done[:, :, None]


def merge(state: DecodeState, merge_threshold: float, agreement: int = 0,
          source_confidence: float | None = None) -> torch.Tensor:  # fmt: skip
    """Apply one merge pass in place; returns the [R, G] bool of merged positions.

    ``agreement`` r > 0 guards against splicing two answer forms: a source's token at p was
    chosen in the source's context, the destination's own commits next to p in its context; where
    one of them decoded a neighbour the other left masked (or they differ there, which
    compatibility already forbids for positions decoded in both), neither chose p knowing the
    other's neighbour, and the pair can read as two forms cut together (``return x +  x``). With
    the neighbourhood in the same state in both rows, the token at p was chosen in the context
    the destination has.

    ``source_confidence`` c keeps a source's unsure tokens private: a branch's rule commits its
    window's single best candidate when none reaches the threshold, and in a narrow window that
    forced commit is often one of two answer forms (``x`` of ``x > 2`` where the wide branch, left
    alone, writes ``2 < x``); merged into a wide branch at its own probability > ``merge_threshold``,
    it becomes the wide branch's next context. A source offers p only where it holds its token at a
    probability ≥ c (``state.commit_prob``: the probability it was committed, merged or copied at).

    Every comparison is within a request, ``[B, N, N, G]`` over the state's request-major layout:
    linear in the batch, not quadratic in rows.

    Only a token in the destination's top-k map can score above the threshold, and the map is
    sorted by probability, so instead of rating every source's token the pass asks, for each of
    the destination's k candidate tokens, whether some usable source decoded it; the first
    candidate offered and above the threshold is the best one.
    """
    gs, mask_id = state.gen_start, state.mask_id
    R, G = state.num_rows, state.length - gs
    N = state.branches
    B = R // N
    gen = state.canvas[:, gs:].view(B, N, G)
    decoded = gen != mask_id
    sources = _sources(state, gen, decoded)

    pos = torch.arange(gs, gs + G, device=gen.device)
    in_window = (pos >= state.win_start[:, None]) & (pos < state.win_end[:, None])  # [R, G]
    scanned = (sources.float() @ in_window.view(B, N, G).float()) > 0  # [b, dst, G]: in some source's window

    k = state.prob_p.shape[-1]
    top_ids = state.prob_ids.view(B, N, G, k)
    wanted = (state.prob_p.view(B, N, G, k) > merge_threshold) & (top_ids != mask_id)  # a source token is never the mask
    usable = sources[..., None] if agreement <= 0 else sources[..., None] & neighbourhood_agrees(gen, agreement)
    if source_confidence is not None:  # [b, 1, src, G]: what each source holds confidently
        usable = usable & (state.commit_prob.view(B, N, G) >= source_confidence)[:, None]
    offered = ((gen[:, None, :, :, None] == top_ids[:, :, None]) & usable[..., None]).any(2)  # [b, dst, G, k]
    ok = wanted & offered & (scanned & ~decoded)[..., None]
    if k == 1:
        take, token = ok[..., 0], top_ids[..., 0]
    else:
        take = ok.any(-1)
        choice = ok.byte().argmax(-1, keepdim=True)
        token = top_ids.gather(-1, choice).squeeze(-1)
    state.canvas[:, gs:] = torch.where(take, token, gen).view(R, G)
    if state.commit_prob is not None:  # a merged token is committed at the destination's own probability
        prob = state.prob_p.view(B, N, G, k)
        prob = prob[..., 0] if k == 1 else prob.gather(-1, choice).squeeze(-1)
        state.commit_prob.copy_(torch.where(take, prob.double(), state.commit_prob.view(B, N, G)).view(R, G))
    take = take.view(R, G)
    state.merged += take.sum(-1)
    return take
