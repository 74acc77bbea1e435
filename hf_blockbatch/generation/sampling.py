"""Token proposals: what the model proposes at each packed position, and how confident it is.

Sampling works on packed logits ``[T, V]`` (only the positions a step reads, never the whole
canvas). Which proposals are committed is the transfer rule's job (:mod:`.rules`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hf_blockbatch.generation.noise import confidence_uniform, uniform

__all__ = ["Sampled", "eos_probability", "row_max", "sample_tokens"]

# Below this many entries a plain max(dim) is cheaper than the blocked one (measured on CPU).
_BLOCKED_MAX_MIN_NUMEL = 32768


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
    entropy: torch.Tensor | None = None  # [T] float64: of the proposal distribution (entropy-bounded commits)


def eos_probability(logits: torch.Tensor, eos_ids: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``[n]`` total probability of the end-of-sequence ids under ``logits`` ``[n, V]``; ``dtype``
    other than float32: a softmax in that precision (the authors' winner rule uses bfloat16)."""
    if dtype != torch.float32:
        return logits.to(dtype).softmax(-1).index_select(-1, eos_ids).float().sum(-1)
    return torch.log_softmax(logits.float(), dim=-1).index_select(-1, eos_ids).exp().sum(-1)


def row_max(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x.max(dim=-1)`` of a ``[T, V]`` tensor: the values and the *first* index of each row's maximum.

    On CPUs PyTorch's reduction with indices is not vectorised (about 7 ms for 64 rows of a
    126k vocabulary, against 0.15 ms for ``amax``), so large tensors are reduced in blocks of 64
    columns: ``amax`` per block (vectorised), the first block holding the row maximum, then the
    first maximum inside that block. No earlier block can hold the maximum, so the index is the
    same first index, and the value the same float, as ``max(dim=-1)`` returns (5x faster at a
    real vocabulary, 2-3x at the tiny models' batch 16). Elsewhere (GPUs, small tensors, widths
    that 32 does not divide) it is ``max(dim=-1)``.
    """
    T, V = x.shape
    c = 64 if V % 64 == 0 else 32
    if x.device.type != "cpu" or x.numel() < _BLOCKED_MAX_MIN_NUMEL or V % c or not x.is_contiguous():
        return x.max(dim=-1)
    blocks = x.view(T, V // c, c)
    values, block = blocks.amax(-1).max(-1)
    inner = blocks.gather(1, block.view(T, 1, 1).expand(T, 1, c)).squeeze(1).max(-1).indices
    return values, block * c + inner


#: at most this many logits (rows x vocabulary) are proposed from at once: the float32 log-probabilities (and, when
#: sampling, the float64 noise and scores) are copies of the logits, so an initial forward of 16 requests x 256
#: masks at LLaDA's 126k vocabulary held about 4 GB of them (some 20 GB sampling) beside 1 GB of bf16 logits; in
#: row chunks about 0.5 GB (2.8 GB; RESULTS §37). Row-wise work, so the proposals are the same; at the tiny models'
#: vocabulary nothing chunks
SAMPLE_CHUNK_ELEMENTS = 2**26


def sample_tokens(
    logits: torch.Tensor,
    temperature: float,
    remasking: str,
    top_k: int,
    generator: torch.Generator | None = None,
    suppress_logit_ids: torch.Tensor | None = None,
    low_confidence_ids: torch.Tensor | None = None,
    mask_id: int | None = None,
    entropy: bool = False,
    noise_keys: torch.Tensor | None = None,
) -> Sampled:
    """Propose a token for every packed position.

    Greedy at temperature 0; otherwise Gumbel-max on float64 logits (LLaDA's
    ``exp(logits) / (-log u)^T``, computed as its logarithm), since low-precision Gumbel noise hurts masked
    diffusion. The confidence is the softmax probability of the proposed token (``low_confidence``) or a
    uniform random number (``random`` remasking). ``top_k = 0`` skips the top-k map.

    ``mask_id`` is never proposed: committing it would leave the position masked, and a step that
    commits only masks makes no progress (an untrained or a peaked model can rank it first). It is
    taken out after the softmax, so every other token keeps the probability the model gives it.
    ``entropy``: also each position's predictive entropy in nats (one more pass over the vocabulary),
    for the entropy-bounded rule.

    ``noise_keys`` (``[T]`` int64, :mod:`.noise`): each position's noise is a hash of its key instead of the
    generator's next numbers, so that it does not depend on what else the step reads.

    Rows are proposed in chunks of :data:`SAMPLE_CHUNK_ELEMENTS` logits (the noise drawn chunk after chunk: on a
    CPU the same numbers as in one draw).
    """
    rows = max(1, SAMPLE_CHUNK_ELEMENTS // max(logits.shape[-1], 1))
    options = (temperature, top_k, generator, suppress_logit_ids, mask_id, entropy)
    if logits.shape[0] <= rows:
        tokens, probability, top_probs, top_ids, h = _propose_rows(logits, *options, noise_keys)
    else:
        parts = [_propose_rows(logits[i : i + rows], *options, None if noise_keys is None else noise_keys[i : i + rows])
                 for i in range(0, logits.shape[0], rows)]  # fmt: skip
        tokens, probability, top_probs, top_ids, h = (None if p[0] is None else torch.cat(p) for p in zip(*parts))
    if remasking == "random" and noise_keys is not None:
        confidence = confidence_uniform(noise_keys)
    elif remasking == "random":
        confidence = torch.rand(tokens.shape, dtype=torch.float64, device=logits.device, generator=generator)
    else:
        confidence = probability
    if low_confidence_ids is not None:
        hit = torch.isin(tokens, low_confidence_ids)
        confidence = confidence.masked_fill(hit, float("-inf"))
    return Sampled(tokens, confidence, probability, top_probs, top_ids, h)


def _propose_rows(logits: torch.Tensor, temperature: float, top_k: int, generator: torch.Generator | None,
                  suppress_logit_ids: torch.Tensor | None, mask_id: int | None, entropy: bool,
                  noise_keys: torch.Tensor | None = None) -> tuple:  # fmt: skip
    """:func:`sample_tokens`' work on the vocabulary, for some rows: ``(tokens, probability, top_probs, top_ids,
    entropy)``."""
    if suppress_logit_ids is not None:
        logits = logits.index_fill(-1, suppress_logit_ids, float("-inf"))
    # One fused log-softmax pass in float32, then only the entries a step reads are exponentiated
    # in float64: a float64 softmax over the whole vocabulary is several times dearer on CPUs and
    # moves a probability by ~1e-7 relative.
    logp = torch.log_softmax(logits if logits.dtype == torch.float32 else logits.float(), dim=-1)
    if mask_id is not None:  # in place: logp is this function's own tensor
        logp[:, mask_id] = float("-inf")
    top_probs = top_ids = None
    if top_k > 1:
        top_logp, top_ids = logp.topk(min(top_k, logp.shape[-1]), dim=-1)
        top_probs = top_logp.exp()
        best_logp, best_ids = top_logp[:, 0], top_ids[:, 0]
    elif top_k == 1 or temperature == 0:  # a max is cheaper than a top-k
        best_logp, best_ids = row_max(logp)
        if top_k == 1:
            top_probs, top_ids = best_logp.exp()[:, None], best_ids[:, None]
    if temperature > 0:
        if noise_keys is None:
            noise = torch.rand(logits.shape, dtype=torch.float64, device=logits.device, generator=generator)
        else:
            noise = uniform(noise_keys, logits.shape[-1])
        # LLaDA's score exp(logits) / (-log u)^T, as its logarithm logits - T log(-log u), in place on the noise:
        # the same argmax (log is increasing; RESULTS §39), two transcendental passes instead of four, no overflow
        # of exp above 709
        gumbel = noise.log_().neg_().log_().mul_(-temperature).add_(logits)
        if mask_id is not None:
            gumbel[:, mask_id] = float("-inf")
        tokens = row_max(gumbel)[1]
        token_logp = logp.gather(-1, tokens[:, None]).squeeze(-1)
    else:
        tokens, token_logp = best_ids, best_logp
    h = torch.special.entr(logp.exp()).sum(-1).double() if entropy else None  # entr(0) = 0: the removed ids
    return tokens, token_logp.double().exp(), top_probs, top_ids, h
