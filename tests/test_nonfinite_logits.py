"""NaN and infinite logits (a float16 overflow, a bad fine-tune, a quantized model, a logits hook).

A proposal from a row of logits holding NaN or +inf has a NaN probability (``log_softmax`` spreads either over the
row) and an arbitrary token; no rule commits it, whichever remasking. So:

* a model whose logits hold them from its first forward fails there, with one line naming the cause and the fix
  (it ran 4 x max_new_tokens + 16 idle forwards, then blamed this library: "Decoding made no progress");
* one that starts to give them later fails the same way where the decode stalls;
* a forward that gives them now and then costs one forward: the decode ends, with the decoding invariants, no
  mask and no garbage token, and greedy decodes the finite model's tokens;
* ``-inf`` logits (every id but one) are a valid distribution and decode as one.
"""

from __future__ import annotations

import pytest
import torch
from _generation_helpers import output_head, peaked, run_padded
from conftest import EOS_ID, MASK_ID, VOCAB

import hf_blockbatch as hb

G = 8
PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9]]
DECODERS = {
    "vanilla": lambda **c: hb.VanillaDiffusionConfig(block_length=4, steps=G, **c),
    "fast-dense": lambda **c: hb.FastDLLMConfig(block_length=4, early_stop=True, **c),
    "fast-sparse": lambda **c: hb.FastDLLMConfig(block_length=4, early_stop=True, window_queries="sparse",
                                                 requery_radius=2, **c),  # fmt: skip
    "blockbatch": lambda **c: hb.BlockBatchConfig(block_sizes=[2, 4, 8], **c),
    "lean": lambda **c: hb.BlockBatchConfig.lean(**c),
    "drafted": lambda **c: hb.FastDLLMConfig.drafted(block_length=4, **c),
    "drafted-inexact": lambda **c: hb.FastDLLMConfig.drafted(exact=False, block_length=4, **c),
    "random-remasking": lambda **c: hb.FastDLLMConfig(block_length=4, remasking="random", **c),
}
MODES = {"greedy": {}, "sampled": {"temperature": 1.0, "seed": 3}}


def _spoil(logits: torch.Tensor, case: str) -> torch.Tensor:
    """``logits`` with non-finite values written in: NaN everywhere, at one position, at one id; +inf at one id."""
    logits = logits.clone()
    if case == "nan-all":
        logits[:] = float("nan")
    elif case == "nan-position":
        logits[..., -1, :] = float("nan")
    elif case == "nan-id":
        logits[..., 7] = float("nan")
    elif case == "inf-id":
        logits[..., 7] = float("inf")
    elif case == "minus-inf-but-one":
        keep = logits[..., 7].clone()
        logits[:] = float("-inf")
        logits[..., 7] = keep
    return logits


def _hooked(family: str, case: str, forwards: set[int] | None):
    """A peaked tiny model whose head's output is spoiled (:func:`_spoil`) at the forwards numbered in ``forwards``
    (from 1; ``None``: at every forward), and its forward count."""
    model, calls = peaked(family), [0]

    def hook(module, args, out):
        calls[0] += 1
        return _spoil(out, case) if forwards is None or calls[0] in forwards else out

    output_head(model).register_forward_hook(hook)
    return model, calls


def _config(name: str, mode: str, **extra) -> hb.DiffusionGenerationConfig:
    return DECODERS[name](max_new_tokens=G, **MODES[mode], **extra)


@pytest.mark.parametrize("family", ["llada", "dream"])
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("name", list(DECODERS))
def test_nan_logits_from_the_first_forward_fail_there_saying_why(name, mode, family):
    """Was: 4 x max_new_tokens + 16 idle forwards, then RuntimeError "... this is a bug in hf-blockbatch"."""
    for case in ("nan-all", "nan-position", "nan-id", "inf-id"):
        model, calls = _hooked(family, case, None)
        with pytest.raises(ValueError, match=r"logits hold NaN or \+inf at the first forward.*bfloat16 or float32"):
            run_padded(model, PROMPTS, _config(name, mode))
        assert calls[0] == 1, case


@pytest.mark.parametrize("family", ["llada", "dream"])
@pytest.mark.parametrize("name", list(DECODERS))
def test_nan_logits_from_a_later_forward_fail_where_the_decode_stalls(name, family):
    model, calls = _hooked(family, "nan-all", set(range(2, 1000)))
    with pytest.raises(ValueError, match=r"logits hold NaN or \+inf where the decode stalled \(48 steps for 8 tokens\)"):
        run_padded(model, PROMPTS, _config(name, "greedy"))


def _check_invariants(out, prompts: list[list[int]]) -> None:
    width = max(len(p) for p in prompts)
    for i, p in enumerate(prompts):
        seq = out.sequences[i].tolist()
        assert seq[width - len(p) : width] == p  # the prompt is untouched
        gen = seq[width:]
        assert MASK_ID not in gen and all(0 <= t < VOCAB for t in gen)
        assert out.stats[i]["nfe"] == int(out.nfe[i])


@pytest.mark.parametrize("family", ["llada", "dream"])
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("name", list(DECODERS))
def test_a_forward_with_nonfinite_logits_now_and_then_costs_that_forward(name, mode, family):
    """NaN or +inf logits at the 2nd forward only (or the 3rd), or -inf at every id but one at every forward: the
    decode ends with the invariants; greedy decodes the finite model's tokens in at most two more forwards."""
    finite = run_padded(peaked(family), PROMPTS, _config(name, mode))
    for case in ("nan-all", "nan-position", "nan-id", "inf-id"):
        for k in (2, 3):
            model, calls = _hooked(family, case, {k})
            out = run_padded(model, PROMPTS, _config(name, mode))
            _check_invariants(out, PROMPTS)
            if mode == "greedy" and name != "random-remasking":
                assert out.sequences.equal(finite.sequences), (case, k)
                # the spoiled forward commits nothing where it read NaN (and the drafts it carried are lost)
                assert ((out.nfe >= finite.nfe) & (out.nfe <= finite.nfe + 2)).all(), (case, k)
    model, _ = _hooked(family, "minus-inf-but-one", None)
    out = run_padded(model, PROMPTS, _config(name, mode))
    _check_invariants(out, PROMPTS)
    width = max(len(p) for p in PROMPTS)
    # the one finite id is the answer (EOS may end it early in Fast-dLLM's stop: none here, 7 is no end token)
    assert set(out.sequences[:, width:].reshape(-1).tolist()) == {7} != {EOS_ID}
    alone = [run_padded(model, [p], _config(name, mode)).sequences[0, len(p) :] for p in PROMPTS]
    assert all(a.equal(out.sequences[i, width:]) for i, a in enumerate(alone))


@pytest.mark.parametrize("family", ["llada", "dream"])
def test_random_remasking_commits_no_proposal_of_nan_logits(family):
    """Random remasking ranks by a uniform, not the probability: it committed the arbitrary token of NaN logits
    (every mask of the step's window turned into id 0 there)."""
    for cfg in (hb.FastDLLMConfig(max_new_tokens=G, block_length=4, remasking="random", output_trace=True),
                hb.FastDLLMConfig(max_new_tokens=G, block_length=4, remasking="random", temperature=1.0, seed=1,
                                  output_trace=True)):  # fmt: skip
        model, _ = _hooked(family, "nan-all", {2})
        out = run_padded(model, PROMPTS, cfg)
        _check_invariants(out, PROMPTS)
        for stats in out.stats:
            events = [ev for ev in stats["trace"] if ev.step == 2]  # (step: the NFE)
            assert events and all(not ev.committed for ev in events), events
