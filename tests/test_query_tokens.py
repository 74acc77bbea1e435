"""Query tokens per request (positions fed through the model over the request's forwards) and the
authors' NFE count, checked against counts made by hand and against the trace."""

from __future__ import annotations

import pytest
from _generation_helpers import peaked, run_padded
from conftest import make_tiny_dream, make_tiny_llada

import hf_blockbatch as hb
from hf_blockbatch.generation.trace import CommitEvent


def test_fast_dllm_query_tokens_counted_by_hand():
    """Dual cache, 8 new tokens in blocks of 4, a fixed quota of 2 per step: init (the whole canvas),
    one block step (the 4-token window), the refresh that starts block 2 (the whole canvas), one
    block step. A 4-token prompt: 12 + 4 + 12 + 4 = 32; a 2-token prompt beside it, left-padded:
    10 + 4 + 10 + 4 = 28 (padding is not the request's)."""
    cfg = hb.FastDLLMConfig(max_new_tokens=8, block_length=4, threshold=None, steps=4, cache="dual")
    out = run_padded(make_tiny_llada(), [[5, 6, 7, 8], [9, 10]], cfg)
    assert out.nfe.tolist() == [4, 4]
    assert [st["query_tokens"] for st in out.stats] == [32, 28]
    assert [st["nfe_authors"] for st in out.stats] == [4, 4]


def test_prefix_and_vanilla_query_tokens_counted_by_hand():
    """Prefix cache: a block step queries from the window to the end of the canvas (8 then 4);
    vanilla: every step is a full forward of the whole canvas."""
    model = make_tiny_llada()
    prefix = hb.FastDLLMConfig(max_new_tokens=8, block_length=4, threshold=None, steps=4, cache="prefix")
    assert run_padded(model, [[5, 6, 7, 8]], prefix).stats[0]["query_tokens"] == 12 + 8 + 12 + 4
    vanilla = hb.VanillaDiffusionConfig(max_new_tokens=8, steps=4, block_length=8)
    out = run_padded(model, [[5, 6, 7, 8]], vanilla)
    assert int(out.nfe[0]) == 4 and out.stats[0]["query_tokens"] == 4 * 12


def test_a_shifted_models_windows_count_the_slot_before_them():
    """Dream's logits at p predict p + 1, so a cached window [s, e) is fed from s - 1: that slot is a
    position fed through the model like the window's own (a sparse step counted it; a dense one did not).
    Dual cache, as above: 12 + (4 + 1) + 12 + (4 + 1) = 34; prefix cache: 12 + (8 + 1) + 12 + (4 + 1) = 38;
    without a cache the canvas, as for LLaDA."""
    model = make_tiny_dream()
    dual = hb.FastDLLMConfig(max_new_tokens=8, block_length=4, threshold=None, steps=4, cache="dual")
    assert run_padded(model, [[5, 6, 7, 8], [9, 10]], dual).stats[0]["query_tokens"] == 34
    prefix = hb.FastDLLMConfig(max_new_tokens=8, block_length=4, threshold=None, steps=4, cache="prefix")
    assert run_padded(model, [[5, 6, 7, 8]], prefix).stats[0]["query_tokens"] == 38
    none = hb.FastDLLMConfig(max_new_tokens=8, block_length=4, threshold=None, steps=4, cache="none")
    assert run_padded(model, [[5, 6, 7, 8]], none).stats[0]["query_tokens"] == 4 * 12


@pytest.mark.parametrize("prune", [None, 1])
@pytest.mark.parametrize("family", ["llada", "dream"])
def test_blockbatch_query_tokens_equal_the_trace(family, prune):
    """Every row of a block step commits at least one token, so it leaves one commit event: the
    request's query tokens are the windows of its block events, a whole canvas per refresh event,
    and one whole canvas for the initial forward its branches share. A pruned branch leaves no
    event and adds no query token once pruned."""
    model = peaked(family)
    cfg = hb.BlockBatchConfig(max_new_tokens=24, block_sizes=[2, 4, 8], threshold=0.47, sync_threshold=2,
                              refresh_interval=4, output_trace=True, prune_after_syncs=prune)  # fmt: skip
    prompts = [[5, 3, 8, 1, 9, 2], [7, 7, 1]]
    out = run_padded(model, prompts, cfg)
    for p, st in zip(prompts, out.stats):
        length = len(p) + 24
        events = [e for e in st["trace"] if isinstance(e, CommitEvent)]
        # a shifted model (Dream) feeds each window from the slot before it, whose logits predict its first position
        block = sum(e.window[1] - e.window[0] + model.logit_shift for e in events if e.phase == "block")
        refresh = sum(length for e in events if e.phase == "refresh")
        assert st["query_tokens"] == block + refresh + length
        winner = st["winner_branch"]
        carried = {e.step for e in events if e.branch == winner}
        assert st["nfe_authors"] == len(carried) <= st["nfe"]
        alone = run_padded(model, [p], cfg).stats[0]
        assert (alone["query_tokens"], alone["nfe_authors"]) == (st["query_tokens"], st["nfe_authors"])
