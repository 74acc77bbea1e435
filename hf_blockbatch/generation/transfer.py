"""What a step commits: token sampling and the transfer rules, on whole tensors.

Sampling works on packed logits ``[T, V]`` (only the window positions a step needs, never the
whole canvas); the rules work on padded ``[A, W]`` confidences with a mask of candidate slots
(masked positions inside the row's window): ``*_rule(confidence, candidates, ...)``, or
``*_select(scores, ...)`` on scores that are already ``-inf`` outside the candidates (what the
engine builds, see :func:`candidate_scores`). Nothing here loops over rows or positions.

Rules (see ``shared/docs/BLOCKBATCH.md``):

* threshold τ: commit every candidate with confidence ≥ τ, and always the single most confident;
* factor f: sort by confidence, commit the largest n with (n + 1)(1 − c_n) < f, at least one;
* quota k: commit the k most confident (LLaDA's fixed schedule).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = [
    "Sampled", "candidate_scores", "eos_probability", "factor_rule", "factor_select", "quota_rule", "quota_schedule",
    "quota_select", "sample_tokens", "threshold_rule", "threshold_select",
]  # fmt: skip


@dataclass
class Sampled:
    """Per packed position: the proposed token, its confidence (what the transfer rule ranks), its
    probability under the model, and the top-k probabilities that the probability map keeps (for
    merging; ``None`` when no map is kept)."""

    tokens: torch.Tensor  # [T] long
    confidence: torch.Tensor  # [T] float64
    probability: torch.Tensor  # [T] float64: the softmax probability of the proposed token
    top_probs: torch.Tensor | None = None  # [T, k] float32
    top_ids: torch.Tensor | None = None  # [T, k] long


def eos_probability(logits: torch.Tensor, eos_ids: torch.Tensor) -> torch.Tensor:
    """``[n]`` total probability of the end-of-sequence ids under ``logits`` ``[n, V]``."""
    return torch.log_softmax(logits.float(), dim=-1).index_select(-1, eos_ids).exp().sum(-1)


def sample_tokens(
    logits: torch.Tensor,
    temperature: float,
    remasking: str,
    top_k: int,
    generator: torch.Generator | None = None,
    suppress_logit_ids: torch.Tensor | None = None,
    low_confidence_ids: torch.Tensor | None = None,
    mask_id: int | None = None,
) -> Sampled:
    """Propose a token for every packed position.

    Greedy at temperature 0; otherwise Gumbel-max on float64 logits (LLaDA's
    ``exp(logits) / (-log u)^T``), since low-precision Gumbel noise hurts masked diffusion. The
    confidence is the softmax probability of the proposed token (``low_confidence``) or a
    uniform random number (``random`` remasking). ``top_k = 0`` skips the top-k map.

    ``mask_id`` is never proposed: committing it would leave the position masked, and a step that
    commits only masks makes no progress (an untrained or a peaked model can rank it first). It is
    taken out after the softmax, so every other token keeps the probability the model gives it.
    """
    if suppress_logit_ids is not None:
        logits = logits.index_fill(-1, suppress_logit_ids, float("-inf"))
    # One fused log-softmax pass in float32, then only the entries a step reads are exponentiated
    # in float64: a float64 softmax over the vocabulary costs ~4x more on CPUs and moves a
    # probability by ~1e-7 relative. This is the largest cost of the policy on a small model.
    logp = torch.log_softmax(logits if logits.dtype == torch.float32 else logits.float(), dim=-1)
    if mask_id is not None:  # in place: logp is this function's own tensor
        logp[:, mask_id] = float("-inf")
    top_probs = top_ids = None
    if top_k > 1:
        top_logp, top_ids = logp.topk(min(top_k, logp.shape[-1]), dim=-1)
        top_probs = top_logp.exp()
        best_logp, best_ids = top_logp[:, 0], top_ids[:, 0]
    elif top_k == 1 or temperature == 0:  # a max is several times cheaper than a top-k on CPUs
        best_logp, best_ids = logp.max(dim=-1)
        if top_k == 1:
            top_probs, top_ids = best_logp.exp()[:, None], best_ids[:, None]
    if temperature > 0:
        logits64 = logits.double()
        noise = torch.rand(logits.shape, dtype=torch.float64, device=logits.device, generator=generator)
        gumbel = logits64.exp() / (-torch.log(noise)) ** temperature  # >= 0
        if mask_id is not None:
            gumbel[:, mask_id] = -1.0
        tokens = torch.argmax(gumbel, dim=-1)
        token_logp = logp.gather(-1, tokens[:, None]).squeeze(-1)
    else:
        tokens, token_logp = best_ids, best_logp
    probability = token_logp.double().exp()
    if remasking == "random":
        confidence = torch.rand(tokens.shape, dtype=torch.float64, device=logits.device, generator=generator)
    else:
        confidence = probability
    if low_confidence_ids is not None:
        hit = torch.isin(tokens, low_confidence_ids)
        confidence = confidence.masked_fill(hit, float("-inf"))
    return Sampled(tokens, confidence, probability, top_probs, top_ids)


def candidate_scores(confidence: torch.Tensor, candidates: torch.Tensor) -> torch.Tensor:
    """What the ``*_select`` rules read: the confidence at candidates, ``-inf`` elsewhere.

    Candidates stay finite (a suppressed ``-inf`` confidence becomes the lowest finite value) so
    that a row with candidates always has a best one: progress is guaranteed, a step can never
    commit nothing while masks remain. The engine builds these scores directly where it can.
    """
    finite = confidence.clamp_min(torch.finfo(confidence.dtype).min)
    return torch.where(candidates, finite, float("-inf"))


def threshold_select(scores: torch.Tensor, threshold: float) -> torch.Tensor:
    """Commit candidates scoring ≥ threshold, and each row's single best candidate."""
    best = scores.argmax(dim=-1, keepdim=True)
    return (scores >= threshold).scatter_(-1, best, scores.gather(-1, best) > float("-inf"))


def factor_select(scores: torch.Tensor, factor: float) -> torch.Tensor:
    """Commit the n best candidates, n the largest with (n + 1)(1 − c_n) < factor (≥ 1)."""
    sorted_conf, order = scores.sort(dim=-1, descending=True)
    n = torch.arange(1, scores.shape[-1] + 1, device=scores.device)
    ok = ((n + 1) * (1 - sorted_conf) < factor) & torch.isfinite(sorted_conf)
    count = torch.where(ok, n, torch.zeros_like(n)).amax(dim=-1).clamp_min(1)
    return quota_select(scores, count, order=order)


def quota_select(scores: torch.Tensor, count: torch.Tensor, order: torch.Tensor | None = None) -> torch.Tensor:
    """Commit the ``count[a]`` best candidates of each row (never a non-candidate)."""
    if order is None:
        order = scores.sort(dim=-1, descending=True).indices
    ranks = torch.empty_like(order).scatter_(-1, order, torch.arange(order.shape[-1], device=order.device).expand_as(order))
    return (scores > float("-inf")) & (ranks < count[:, None])


def threshold_rule(confidence: torch.Tensor, candidates: torch.Tensor, threshold: float) -> torch.Tensor:
    """Commit candidates with confidence ≥ threshold, and at least the most confident one."""
    return threshold_select(candidate_scores(confidence, candidates), threshold)


def factor_rule(confidence: torch.Tensor, candidates: torch.Tensor, factor: float) -> torch.Tensor:
    """Commit the n most confident candidates, n the largest with (n + 1)(1 − c_n) < factor (≥ 1)."""
    return factor_select(candidate_scores(confidence, candidates), factor)


def quota_rule(confidence: torch.Tensor, candidates: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """Commit the ``count[a]`` most confident candidates of each row (never a non-candidate)."""
    return quota_select(candidate_scores(confidence, candidates), count)


def quota_schedule(masked_at_block_start: torch.Tensor, steps_per_block: int, step: torch.Tensor) -> torch.Tensor:
    """LLaDA's even schedule: ``n`` masked tokens over ``s`` steps gives ``n // s`` per step plus one
    more in the first ``n % s`` steps (as its ``get_num_transfer_tokens``)."""
    base = masked_at_block_start // steps_per_block
    return base + (step < masked_at_block_start % steps_per_block).long()
