"""Token proposals: what the model proposes at each packed position, and how confident it is.

Sampling works on packed logits ``[T, V]`` (only the positions a step reads, never the whole
canvas). Which proposals are committed is the transfer rule's job (:mod:`.rules`).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from hf_blockbatch.checks import check_real
from hf_blockbatch.generation.configs import _REMASKING
from hf_blockbatch.generation.noise import (
    UNIFORM_MAX,
    UNIFORM_MIN,
    code_uniforms,
    confidence_uniform,
    uniform,
    uniform_at,
    uniform_codes,
)

__all__ = ["Sampled", "eos_probability", "gumbel_tokens", "keyed_floor", "noise_screen", "row_max", "runner_up",
           "sample_tokens"]

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

    Where a row's logits hold NaN or +inf, its probability and (either remasking) its confidence are NaN: no rule
    commits it (:mod:`.rules`), and a decode that stalls on such rows fails saying why (the engine).

    A negative or NaN ``temperature`` took no branch of the draw (an UnboundLocalError), and a misspelt
    ``remasking`` was read as ``low_confidence``: both are refused (Python-level checks, no host sync).
    """
    if check_real("temperature", temperature) < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature!r}.")
    if remasking not in _REMASKING:
        raise ValueError(f"remasking must be one of {_REMASKING}, got {remasking!r}.")
    rows = max(1, SAMPLE_CHUNK_ELEMENTS // max(logits.shape[-1], 1))
    options = (temperature, top_k, generator, suppress_logit_ids, mask_id, entropy)
    if logits.shape[0] <= rows:
        tokens, probability, top_probs, top_ids, h = _propose_rows(logits, *options, noise_keys)
    else:
        parts = [_propose_rows(logits[i : i + rows], *options, None if noise_keys is None else noise_keys[i : i + rows])
                 for i in range(0, logits.shape[0], rows)]  # fmt: skip
        tokens, probability, top_probs, top_ids, h = (None if p[0] is None else torch.cat(p) for p in zip(*parts))
    if remasking == "random":
        if noise_keys is not None:
            confidence = confidence_uniform(noise_keys)
        else:
            confidence = torch.rand(tokens.shape, dtype=torch.float64, device=logits.device, generator=generator)
        # a proposal from NaN or +inf logits (NaN probability, an arbitrary token) is never committed, as under
        # low_confidence, where its confidence is that NaN: a random order committed it
        confidence = torch.where(probability.isnan(), probability, confidence)
    else:
        confidence = probability
    if low_confidence_ids is not None:
        hit = torch.isin(tokens, low_confidence_ids)
        confidence = confidence.masked_fill(hit, float("-inf"))
    return Sampled(tokens, confidence, probability, top_probs, top_ids, h)


def _log_probs(logits: torch.Tensor, mask_id: int | None) -> torch.Tensor:
    """``[T, V]`` float32 log-probabilities, the mask id's at ``-inf`` (never proposed). One fused log-softmax pass in
    float32; the entries a step reads are exponentiated in float64 by the callers: a float64 softmax over the whole
    vocabulary is several times dearer on CPUs and moves a probability by ~1e-7 relative."""
    logp = torch.log_softmax(logits if logits.dtype == torch.float32 else logits.float(), dim=-1)
    if mask_id is not None:  # in place: logp is this function's own tensor
        logp[:, mask_id] = float("-inf")
    return logp


def runner_up(logits: torch.Tensor, best_ids: torch.Tensor, suppress_logit_ids: torch.Tensor | None,
              mask_id: int | None) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """``([n] float32, [n] long)``: the probability and id of each row's most probable token other than ``best_ids``
    under ``logits`` ``[n, V]``, with the proposals' own vocabulary (suppressed ids and the mask id out). For the few
    positions that need one (lookahead's runner-up drafts), instead of a top-2 over every proposal: a top-k is 2-8x
    a row maximum on CPUs (3.2 against 0.4 ms for 16 rows of a 126k vocabulary)."""
    if suppress_logit_ids is not None:
        logits = logits.index_fill(-1, suppress_logit_ids, float("-inf"))
    logp = _log_probs(logits, mask_id)
    logp.scatter_(1, best_ids[:, None], float("-inf"))
    value, ids = row_max(logp)
    return value.exp(), ids


def _propose_rows(logits: torch.Tensor, temperature: float, top_k: int, generator: torch.Generator | None,
                  suppress_logit_ids: torch.Tensor | None, mask_id: int | None, entropy: bool,
                  noise_keys: torch.Tensor | None = None) -> tuple:  # fmt: skip
    """:func:`sample_tokens`' work on the vocabulary, for some rows: ``(tokens, probability, top_probs, top_ids,
    entropy)``."""
    if suppress_logit_ids is not None:
        logits = logits.index_fill(-1, suppress_logit_ids, float("-inf"))
    logp = _log_probs(logits, mask_id)
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
        tokens = gumbel_tokens(logits, temperature, generator, noise_keys, mask_id)
        token_logp = logp.gather(-1, tokens[:, None]).squeeze(-1)
    else:
        tokens, token_logp = best_ids, best_logp
    h = torch.special.entr(logp.exp()).sum(-1).double() if entropy else None  # entr(0) = 0: the removed ids
    return tokens, token_logp.double().exp(), top_probs, top_ids, h


#: a pruned draw (:func:`gumbel_tokens`) scores at most this share of its logits; where more ids can still win, it
#: scores the whole vocabulary (one vectorised pass over everything beats gathering much of it: on the tiny models
#: a pruned draw ran 0.9x the full one's speed with 9 % of the ids kept, 1.6-2.3x with 1-4 %)
PRUNED_DRAW_MAX_SHARE = 0.1
#: below this many logits (rows x vocabulary) the full draw is cheaper than the pruning's own operations
PRUNED_DRAW_MIN_NUMEL = 2**15
#: below this many logits the full draw is about as cheap as the noise screen (:func:`noise_screen`), which hashes
#: every id too (replayed draws of the tiny models at T 1: at 2^15 the small draws of batch 4 ran 10-15 % slower
#: than the full draw; at 2^17 every suite ran as fast or faster, 1.2-1.5x where the batch is 16)
SCREENED_DRAW_MIN_NUMEL = 2**17
#: the rows that first say whether pruning can pay (a flat or hot draw keeps most ids: it then costs only these)
_PROBE_ROWS = 16
#: slack on the pruning bound, far above the last-bit differences of the float64 logarithms (scores are ~1e1)
_BOUND_SLACK = 1e-6


def _scores(u: torch.Tensor, temperature: float, logits: torch.Tensor) -> torch.Tensor:
    """Gumbel scores from uniforms ``u`` (float64, overwritten) and the matching logits: LLaDA's score
    ``exp(logits) / (-log u)^T`` as its logarithm ``logits - T log(-log u)``. The same argmax (log is increasing;
    RESULTS §39), two transcendental passes instead of four, no overflow of exp above 709."""
    return u.log_().neg_().log_().mul_(-temperature).add_(logits)


def _lift(u: float) -> float:
    """The Gumbel noise ``-log(-log u)`` that a uniform ``u`` adds to a score, in T (:func:`_scores`)."""
    return -math.log(-math.log(u))


# A decode samples at one temperature; a server meets every temperature its clients ask for, so the spreads are
# bounded rather than one entry per temperature ever seen (unbounded, about 200 bytes each, for the process's life).
SPREADS_CACHED = 64


@functools.lru_cache(maxsize=SPREADS_CACHED)
def _spread(temperature: float, dtype: torch.dtype) -> float:
    """How far apart the keyed noise can put two ids' scores beyond their logits at ``temperature`` (the lift of
    :data:`~.noise.UNIFORM_MAX` less that of :data:`~.noise.UNIFORM_MIN`, about 26.0 T), with a slack, as the least
    value of ``dtype`` (float32 or float64) not below it. The last ``SPREADS_CACHED`` (temperature, dtype) pairs are
    kept."""
    x = temperature * (_lift(UNIFORM_MAX) - _lift(UNIFORM_MIN)) + _BOUND_SLACK
    y = torch.tensor(x, dtype=dtype)
    return float(y if float(y) >= x else torch.nextafter(y, y.new_tensor(math.inf)))


@functools.cache
def _minus_infinity(dtype: torch.dtype) -> torch.Tensor:
    """-inf as a ``dtype`` tensor, the direction :func:`keyed_floor` rounds to (built once per dtype)."""
    return torch.tensor(-math.inf, dtype=dtype)


def keyed_floor(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """``[T]`` per row of ``logits`` ``[T, V]``, a value below every logit that can win a keyed draw at
    ``temperature``: the top logit less the noise's spread (:func:`_spread`, rounded up), the difference rounded one
    step down (float32, or float64 for float64 logits). An id whose logit is below it can neither win nor tie."""
    top = logits.amax(-1)
    top = top if top.dtype == torch.float64 else top.float()  # (bfloat16 logits: float32 holds them exactly)
    return torch.nextafter(top - _spread(temperature, top.dtype), _minus_infinity(top.dtype))


def _first_best(rows: torch.Tensor, ids: torch.Tensor, scores: torch.Tensor, n: int, vocab: int) -> torch.Tensor | None:
    """``[n]`` each row's id of the highest of ``scores``, given at the (row, id) pairs ``rows``, ``ids`` (ids
    ascending within a row, as ``nonzero`` gives them), the first such id on a tie, as a full draw's row max picks it;
    ``None`` when a row has no finite score among them (the full draw decides that row)."""
    best = torch.full((n,), -math.inf, dtype=scores.dtype, device=scores.device).scatter_reduce_(0, rows, scores, "amax")
    if not bool(torch.isfinite(best).all()):
        return None
    first = torch.full((n,), vocab, dtype=torch.long, device=scores.device)
    return first.scatter_reduce_(0, rows, torch.where(scores == best[rows], ids, vocab), "amin")


#: the noise screen's levels (:func:`noise_screen`), descending: the codes of the largest 2^-8 and 2^-4 of the
#: uniforms (:func:`~.noise.uniform_codes`), and the lifts (in T) that no code below each reaches (5.5 and 2.7): each
#: level's own, rounded up (the lift grows with the uniform; these uniforms are exact in float64, 1e-9 is far above
#: the logarithms' rounding)
_SCREEN_CODES = (2**31 - 2**24, 2**31 - 2**28)
_SCREEN_LIFTS = tuple(_lift(u) + 1e-9 for u in code_uniforms(torch.tensor(_SCREEN_CODES, dtype=torch.int32)).tolist())


def noise_screen(logits: torch.Tensor, temperature: float, codes: torch.Tensor,
                 mask_id: int | None) -> torch.Tensor | None:  # fmt: skip
    """``[T, V]`` bool: the ids of a keyed draw whose noise can still lift them to a score their row reaches, from the
    codes of every id's uniform (``codes`` ``[T, V]``, :func:`~.noise.uniform_codes`); ``None`` where a row's logits
    are not finite (the full draw's row max decides those).

    Why: where the logits are flat or the temperature hot, most ids lie within the noise's spread of their row's top
    logit, and :func:`gumbel_tokens`' logit bound keeps them all; yet a draw is won by an id whose logit *and* noise
    are large. Each row's score ``S`` of two ids is computed exactly (its largest uniform's, its top logit's): the
    winner scores at least ``S``. An id whose code is below a level of :data:`_SCREEN_CODES` draws less noise than
    that level's lift (:data:`_SCREEN_LIFTS`: 5.5 T below the largest 2^-8 of the uniforms, 2.7 T below the
    largest 2^-4), so it can reach ``S`` only if its logit is at least ``S`` less that lift. What stays in: the ids
    above the first level, those between the levels with a logit within 5.5 T of ``S``, the rest within 2.7 T; 0.4
    to 2.6 % of the ids on normal rows of 1,024 and 8,192 ids (sd 0.5 to 4, T 0.5 to 1), where the logit bound kept
    29 to 100 %. It compares int32 codes and logits, where the full draw takes two float64 logarithms of every id."""
    top, top_id = row_max(logits)
    if not bool(torch.isfinite(top).all()):  # a NaN or an infinite logit
        return None
    ids = torch.stack((row_max(codes)[1], top_id), 1)  # each row's largest uniform, and its top logit
    lower = _scores(code_uniforms(codes.gather(1, ids)), temperature, logits.gather(1, ids))
    if mask_id is not None:
        lower.masked_fill_(ids == mask_id, -math.inf)  # the mask id never wins
    lower = lower.amax(1)
    keep = codes >= _SCREEN_CODES[0]
    for k, lift in enumerate(_SCREEN_LIFTS):
        # (rounded down to the logits' precision, as keyed_floor does: a logit at the bound stays in; -inf where
        # neither id scores, and all stay in)
        bound = lower - (temperature * lift + _BOUND_SLACK)
        bound = bound if logits.dtype == torch.float64 else bound.float()
        within = logits >= torch.nextafter(bound, _minus_infinity(bound.dtype))[:, None]
        keep |= within if k + 1 == len(_SCREEN_CODES) else within.logical_and_(codes >= _SCREEN_CODES[k + 1])
    if mask_id is not None:
        keep[:, mask_id] = False
    return keep


def _screened_draw(logits: torch.Tensor, temperature: float, codes: torch.Tensor, mask_id: int | None,
                   share: float) -> torch.Tensor | None:  # fmt: skip
    """:func:`gumbel_tokens`' keyed draw from the codes of every id's uniform, scoring only the ids
    :func:`noise_screen` keeps, with the full draw's float64 operations on the same numbers (so the tokens are the
    full draw's); ``None`` where more than ``share`` of the ids stay in, or the screen declines."""
    T, V = logits.shape
    keep = noise_screen(logits, temperature, codes, mask_id)
    if keep is None or int(keep.count_nonzero()) > share * T * V:
        return None
    r, j = keep.nonzero(as_tuple=True)
    return _first_best(r, j, _scores(code_uniforms(codes[r, j]), temperature, logits[r, j]), T, V)


def _full_draw(u: torch.Tensor, temperature: float, logits: torch.Tensor, mask_id: int | None) -> torch.Tensor:
    """``[T]`` the Gumbel argmax over every id of ``logits`` ``[T, V]`` with uniforms ``u`` (float64, overwritten)."""
    scores = _scores(u, temperature, logits)
    if mask_id is not None:
        scores[:, mask_id] = float("-inf")
    return row_max(scores)[1]


def gumbel_tokens(logits: torch.Tensor, temperature: float, generator: torch.Generator | None,
                  noise_keys: torch.Tensor | None, mask_id: int | None,
                  max_share: float | None = None) -> torch.Tensor:  # fmt: skip
    """``[T]`` the sampled id of each row of ``logits`` ``[T, V]``: the argmax of its Gumbel scores
    (:func:`_scores`), the first id on a tie, never ``mask_id``; uniforms from ``noise_keys`` (keyed noise) or
    else ``generator``.

    Why pruned: the keyed noise lifts a score above its logit by at least ``-T log(-log u_min)`` and at most
    ``-T log(-log u_max)`` (:data:`~.noise.UNIFORM_MIN`, :data:`~.noise.UNIFORM_MAX`; about -3.1 T and 22.9 T).
    So the row's top logit plus the least lift is a score its winner reaches, and an id whose logit is more than
    the spread between the two (26.0 T) below the top logit can neither win nor tie. Only the other ids are
    scored, their uniforms hashed for them alone (:func:`~.noise.uniform_at`) and their two logarithms taken:
    at T 0.5 a few percent of the tiny models' ids, fewer on a peaked real model, where the hash and the
    logarithms over the vocabulary were most of a keyed sampled step's policy. An id's score is the same float64
    operations on the same numbers either way, so the tokens are the full draw's (up to the last-bit differences
    PyTorch's vectorised and scalar loops can make, which decide a token only on an exact tie).

    Where more than ``max_share`` (default :data:`PRUNED_DRAW_MAX_SHARE`) of the logits stay in (a flat
    distribution, a hot temperature: the first :data:`_PROBE_ROWS` rows say so before the rest are looked at), or a
    row's top logit is not finite or is the mask id's (no id of the row is kept, a case of untrained models), every
    id is hashed, and a screen on the noise keeps the ids that can still win (:func:`noise_screen`). The whole
    vocabulary is scored where that keeps more than ``max_share`` too, for fewer than
    :data:`PRUNED_DRAW_MIN_NUMEL` logits (:data:`SCREENED_DRAW_MIN_NUMEL` for the screen), at ``max_share`` 0, off
    the CPU (both read counts back to the host), and with a generator, whose stream must be drawn for every id
    anyway (there pruning measured slower than the full draw)."""
    T, V = logits.shape
    share = PRUNED_DRAW_MAX_SHARE if max_share is None else max_share
    if noise_keys is None:
        return _full_draw(torch.rand(logits.shape, dtype=torch.float64, device=logits.device, generator=generator),
                          temperature, logits, mask_id)  # fmt: skip
    if logits.device.type != "cpu" or share <= 0 or T * V < PRUNED_DRAW_MIN_NUMEL:
        return _full_draw(uniform(noise_keys, V), temperature, logits, mask_id)
    # (a NaN or infinite logit leaves a row without a finite winner below, and the screen or the full draw decides it)
    # (counts by ``count_nonzero``: a bool ``sum`` took ten times as long over 4 M ids)
    probe = logits[:_PROBE_ROWS] if T > _PROBE_ROWS else None
    if probe is None or int((probe >= keyed_floor(probe, temperature)[:, None]).count_nonzero()) <= share * probe.numel():
        keep = logits >= keyed_floor(logits, temperature)[:, None]
        if mask_id is not None:
            keep[:, mask_id] = False
        if int(keep.count_nonzero()) <= share * T * V:
            r, j = keep.nonzero(as_tuple=True)
            tokens = _first_best(r, j, _scores(uniform_at(noise_keys[r], j, V), temperature, logits[r, j]), T, V)
            if tokens is not None:
                return tokens
    if T * V < SCREENED_DRAW_MIN_NUMEL:
        return _full_draw(uniform(noise_keys, V), temperature, logits, mask_id)
    codes = uniform_codes(noise_keys, V)
    tokens = _screened_draw(logits, temperature, codes, mask_id, share)
    return tokens if tokens is not None else _full_draw(code_uniforms(codes), temperature, logits, mask_id)
