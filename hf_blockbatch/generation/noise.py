"""Keyed sampling noise: a sampled step's random numbers as a function of *what* they decide, not of a stream.

Why: with a ``torch.Generator`` a sampled decode draws its noise in the order the packed forward reads its
slots, so a request's samples depend on the other requests in its batch (how many slots come before its own),
on left padding, and on any row that rides along (Lookahead's drafts draw noise too). Sampled decoding then
matches the decoder's law in distribution only, and a request cannot be re-run alone to see why it decoded as
it did. With ``seed`` set (``DiffusionGenerationConfig.seed``), each uniform number is a hash of

    (seed, request, lane, step, position, token id)

* request: the prompt's tokens (its unpadded content), and the number of identical prompts before it in the
  batch, so that ``num_return_sequences`` copies draw apart and the first copy decodes as the prompt alone;
* lane: the row's branch for BlockBatch (each block size draws its own noise, as with a generator); 0 for
  Lookahead's draft rows, which stand for their main row's later steps;
* step: the commits the row's decoder has made (its forwards, plus the steps an adopted draft stood for), so
  that a draft row drawing for its main row's next step draws exactly what that step would;
* position: the offset in the generated region (not the canvas position, which moves with left padding).

So a request decodes the same tokens alone or in any batch, at any padding; and (``exact`` acceptance, sparse or
dense steps) with drafts or without, sample for sample, as it does greedily: up to floating-point differences in
the logits, which a near-tie between two noisy scores can turn into a different token.

The hash is ``lowbias32`` (C. Wellons' hash-prospector, a bijection of 32-bit integers) applied to each key
part in turn, computed in place: keys in int64 tensors, the vocabulary-wide hash on int32 bit patterns. On this
CPU that takes 0.72 against ``torch.rand``'s 0.53 s for 530 slots of 126,464 ids (a proposal step's chunk; 1.2 s
in int64), and half of ``torch.rand``'s time at the tiny models' 1,024 ids. The tests check the numbers against a
pure-Python copy in exact integers, so a platform that computed them otherwise would fail there.

Since a token id's noise depends on nothing but its key, a draw can hash only the ids that can win it
(:func:`uniform_at`; ``sampling.gumbel_tokens`` prunes the others by the noise's bounds, :data:`UNIFORM_MIN` and
:data:`UNIFORM_MAX`), which a generator's stream, drawn in order, cannot; and where most ids stay in, it can compare
the hashes themselves (:func:`uniform_codes`, in the uniforms' order) to find the few whose noise is large enough.

A uniform is the 32-bit hash plus one half, over 2^32: in (0, 1), never 0 or 1, with 2^-32 resolution (a Gumbel
score is cut off at about 23, which a 126k vocabulary exceeds with probability below 1e-4 per position). Keys are
32 bits: two slots of a decode share their noise with probability 2^-32 per pair, a dependence far below anything
a sample can show.
"""

from __future__ import annotations

import functools

import torch

__all__ = ["MASK32", "UNIFORM_MAX", "UNIFORM_MIN", "code_uniforms", "confidence_uniform", "draws_noise", "lane_keys",
           "mix32", "request_keys", "slot_keys", "uniform", "uniform_at", "uniform_codes"]

MASK32 = 0xFFFFFFFF
# distinct offsets per key part, so that the same small integer means different things in different parts
_LANE, _STEP, _POSITION, _TOKEN, _CONFIDENCE, _PROMPT, _COPY = (0x9E3779B9 * (k + 1) & MASK32 for k in range(7))


def draws_noise(temperature: float, remasking: str) -> bool:
    """Whether a decode draws random numbers: it samples (a temperature), or commits in a random order."""
    return temperature > 0 or remasking == "random"


#: lowbias32's steps: each a right shift to xor in, then a multiplier (none after the last)
_LOWBIAS32 = ((16, 0x21F0AAAD), (15, 0xD35A2D97), (15, None))


def mix32(x: torch.Tensor) -> torch.Tensor:
    """``lowbias32``: a bijective 32-bit hash with low bias, in place on an int64 tensor holding values in
    [0, 2^32) (returned). A product of two such values can pass 2^63 and wrap, which keeps its low 32 bits: the
    only ones kept. (Keys are hashed so; the vocabulary-wide hash of a sampled step runs on int32 bit patterns:
    :func:`_mix32_bits`.)

    Another dtype is refused (a free check): an int32 tensor's products wrap at 2^31 and its shifts copy the sign
    bit, which gives another hash, and a converted copy would break the in-place contract."""
    if x.dtype != torch.int64:
        raise TypeError(f"mix32 hashes an int64 tensor in place, got {x.dtype}: pass x.long() (values in [0, 2^32)).")
    for shift, factor in _LOWBIAS32:
        x ^= x >> shift
        if factor is not None:
            x.mul_(factor).bitwise_and_(MASK32)
    return x


def _mix32_bits(x: torch.Tensor) -> torch.Tensor:
    """:func:`mix32` in place on an int32 tensor of 32-bit patterns: the same bits in half the memory, and on this
    CPU in a third of the time (0.6 against 2.0 ms for 32 slots of 8,192 ids, with the uniforms): the
    vocabulary-wide hash of a sampled step. The shifts go to a spare tensor (a fresh temporary per shift costs as
    much again in page faults on a CPU). An int32 right shift copies the sign bit, so each shift is masked to the
    logical one; a product wraps to its low 32 bits, the only ones kept."""
    spare = torch.empty_like(x)
    for shift, factor in _LOWBIAS32:
        x ^= torch.bitwise_right_shift(x, shift, out=spare).bitwise_and_((1 << (32 - shift)) - 1)
        if factor is not None:
            x.mul_(factor - (1 << 32) if factor >> 31 else factor)  # the multiplier's bits as an int32
    return x


def _absorb(key: torch.Tensor, part: torch.Tensor | int, offset: int) -> torch.Tensor:
    """A new key: ``key`` after taking in one more part (``part + offset`` hashed, then hashed with the key)."""
    part = torch.full_like(key, part) if isinstance(part, int) else part
    return mix32(key ^ mix32((part + offset) & MASK32))


def request_keys(seed: int, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """``[B]`` int64: each request's key, from the seed, its prompt's tokens (left padding ignored) and how many
    identical prompts come before it in the batch. Vectorised over the batch and the prompt (no loop)."""
    mask = attention_mask.bool()
    index = mask.long().cumsum(-1) - 1  # each token's offset in its unpadded prompt
    tokens = _absorb(mix32(index.clamp_min(0) & MASK32), input_ids, _PROMPT)
    content = (tokens * mask).sum(-1) & MASK32  # a sum of hashed (offset, token) pairs: order held by the offsets
    copies = _copy_numbers(input_ids.masked_fill(~mask, -1))
    base = mix32(torch.full_like(content, seed & MASK32) ^ mix32(torch.full_like(content, (seed >> 32) & MASK32)))
    return _absorb(_absorb(_absorb(base, mask.sum(-1), _PROMPT), content, _PROMPT), copies, _COPY)


def _copy_numbers(rows: torch.Tensor) -> torch.Tensor:
    """``[B]``: how many identical rows come before each row of ``rows`` ``[B, Lp]``. Rows are grouped by a sort
    (``unique``), O(B · Lp) memory: comparing every pair held a ``[B, B, Lp]`` boolean (67 MB at batch 256 and
    1,024-token prompts). A stable sort of the group ids keeps the batch's order inside each group."""
    group = torch.unique(rows, dim=0, return_inverse=True)[1]
    ordered, order = torch.sort(group, stable=True)
    sizes = torch.bincount(group)
    first = sizes.cumsum(0) - sizes  # each group's first place in the sorted order
    rank = torch.arange(rows.shape[0], device=rows.device) - first[ordered]
    return torch.empty_like(rank).scatter_(0, order, rank)


def lane_keys(request_key: torch.Tensor, lane: torch.Tensor) -> torch.Tensor:
    """``[R]`` each row's key: its request's, with its lane (the branch; 0 for a draft row)."""
    return _absorb(request_key, lane, _LANE)


def slot_keys(row_key: torch.Tensor, step: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
    """``[T]`` the key of each packed slot: its row's key (``[T]``), the row's step and the slot's offset in
    the generated region."""
    return _absorb(_absorb(row_key, step, _STEP), offset, _POSITION)


@functools.cache
def _token_parts(vocab: int, device: torch.device) -> torch.Tensor:
    """``[V]`` each token id's hashed part, built once per vocabulary and device (read-only)."""
    return mix32((torch.arange(vocab, device=device) + _TOKEN) & MASK32)


def _to_uniform(h: torch.Tensor) -> torch.Tensor:
    """32-bit hashes (int64 values in [0, 2^32)) as float64 uniforms in (0, 1): plus one half, over 2^32."""
    return h.double().add_(0.5).mul_(2.0**-32)


@functools.cache
def _token_bits(vocab: int, device: torch.device) -> torch.Tensor:
    """:func:`_token_parts` as int32 bit patterns, for :func:`_mix32_bits` (read-only)."""
    return _token_parts(vocab, device).to(torch.int32)


def _codes(keys: torch.Tensor, token_bits: torch.Tensor) -> torch.Tensor:
    """int32 codes of each key (int64 values in [0, 2^32)) xored with its token id's part (int32 bits, broadcast
    against ``keys``): the hash on int32 bits with its top bit flipped, so that the codes, read as signed, order the
    hashes read as unsigned."""
    h = _mix32_bits(keys.to(torch.int32) ^ token_bits)  # (an int64 in [0, 2^32) casts to its low 32 bits)
    return h.bitwise_xor_(-(1 << 31))


def code_uniforms(codes: torch.Tensor) -> torch.Tensor:
    """Float64 uniforms in (0, 1) of int32 ``codes`` (:func:`uniform_codes`): the hash, unsigned (the code plus 2^31),
    plus one half, over 2^32. A larger code is a larger uniform."""
    return codes.double().add_(2.0**31 + 0.5).mul_(2.0**-32)


def uniform_codes(keys: torch.Tensor, vocab: int) -> torch.Tensor:
    """``[T, V]`` int32: the codes of :func:`uniform`'s numbers (:func:`code_uniforms` turns them into those
    numbers), in their order. A draw can compare codes, four bytes and no conversion per id, to find the few ids
    whose noise is large enough to matter (``sampling.gumbel_tokens``)."""
    return _codes(keys[:, None], _token_bits(vocab, keys.device))


def uniform(keys: torch.Tensor, vocab: int) -> torch.Tensor:
    """``[T, V]`` float64 uniforms in (0, 1): the noise of each packed slot's ``V`` token ids."""
    return code_uniforms(uniform_codes(keys, vocab))


def uniform_at(keys: torch.Tensor, ids: torch.Tensor, vocab: int) -> torch.Tensor:
    """``[n]`` float64: the uniforms of ``n`` chosen (slot, token id) pairs, given as the slot's key ``keys[i]`` and
    the id ``ids[i]``: the entries :func:`uniform` holds there (the same integers hashed, so the same numbers),
    without the rest of the vocabulary. What a sampled step needs where only a few ids can win its draw."""
    return code_uniforms(_codes(keys, _token_bits(vocab, keys.device)[ids]))


#: the smallest and largest uniforms :func:`uniform` returns (32-bit hashes of all zeros and all ones): the noise
#: any id draws lies between what these give
UNIFORM_MIN, UNIFORM_MAX = 0.5 * 2.0**-32, (MASK32 + 0.5) * 2.0**-32


def confidence_uniform(keys: torch.Tensor) -> torch.Tensor:
    """``[T]`` float64 uniforms in (0, 1): random remasking's confidence of each packed slot (its own part, apart
    from every token id's)."""
    return _to_uniform(_absorb(keys, 0, _CONFIDENCE))
